"""A small serving engine over the pure API: fixed decode slots, chunked prefill, prefix reuse
through the host and disk tiers (`dsv41_jax.tiers`)."""

from dsv41_jax.serving.engine import Engine, EngineConfig, Request, Result, plan_slots, slots_for_budget

__all__ = ["Engine", "EngineConfig", "Request", "Result", "plan_slots", "slots_for_budget"]
