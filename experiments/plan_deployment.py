"""Memory per device of a deployment, from the sharding rules, without allocating anything.

    python -m experiments.plan_deployment --preset v41-flash --mesh tensor=8 --batch 64 --context 131072
    python -m experiments.plan_deployment --preset v41-flash --mesh data=4,expert=16 --devices-per-host 4 --hbm-gib 95
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.plan_deployment --mesh expert=8 \
        --layout dp_ep --compile          # a dry run: XLA compiles the sharded step, its bytes beside the plan's

Weights are counted in the released formats (FP8 dense blocks, FP4 routed experts); the Engram tables
are planned in host memory (their lookups depend only on token ids, so rows can be prefetched). Every
number comes from `jax.eval_shape` of the real constructors and the `dsv41_jax.partitioning` tables.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
from jax.sharding import AbstractMesh

import dsv41_jax as d
from dsv41_jax import partitioning as S
from dsv41_jax.cache import init_cache
from experiments import _cli


def weight_config(preset: str):
    """(config, abstract params, "") with the released FP8/FP4 weights or, for a preset whose dimensions are
    not multiples of their scale blocks (tiny), (config, abstract params, the reason) with bf16 weights."""
    cfg = d.preset(preset, weight_format="fp8", param_dtype="bfloat16")
    try:
        return cfg, d.abstract_params(cfg), ""
    except ValueError as e:  # quant: a dimension that is not a multiple of its scale block
        cfg = d.preset(preset, param_dtype="bfloat16")
        return cfg, d.abstract_params(cfg), str(e)


def plan(preset: str, mesh_spec: str, layout: str, batch: int, context: int) -> dict:
    cfg, params, not_fp8 = weight_config(preset)
    sizes = S.parse_mesh(mesh_spec)
    S.check_mesh(cfg, sizes, batch, math.prod(sizes.values()), layout)
    names = tuple(a for a in S.MESH_AXES if a in sizes)
    mesh = AbstractMesh(tuple(sizes[a] for a in names), names)
    by = S.param_bytes(params, mesh, layout)
    (w_total, w_dev), (e_total, e_dev) = by["weights"], by["engram_tables"]
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context))
    c_total, c_dev = S.bytes_per_device(cache, S.cache_specs(cache, mesh, layout), mesh)
    return dict(preset=preset, mesh=sizes, layout=layout, batch=batch, context=context, devices=mesh.size,
                weights_total=w_total, weights_per_device=w_dev, cache_total=c_total, cache_per_device=c_dev,
                engram_host_total=e_total, engram_if_on_device=e_dev, weights_not_fp8=not_fp8)


def compile_decode(preset: str, mesh_spec: str, layout: str, batch: int, context: int) -> dict:
    """Compile one sharded decode step of `preset` for the devices present (no weights allocated: every
    input is abstract) and return XLA's bytes per device: arguments (weights, Engram tables on the device,
    cache, tokens), temporaries, outputs, and the compile time. On CPUs, simulate the devices with
    XLA_FLAGS=--xla_force_host_platform_device_count=N."""
    from dsv41_jax import api

    cfg, params, _ = weight_config(preset)
    sizes = S.parse_mesh(mesh_spec)
    need = math.prod(sizes.values())
    if jax.device_count() < need:
        raise _cli.UserError(f"--compile: mesh {mesh_spec} needs {need} devices, {jax.device_count()} present; on a "
                             f"CPU start with XLA_FLAGS=--xla_force_host_platform_device_count={need}")
    mesh = S.make_mesh(cfg, sizes, batch=batch, devices=jax.devices()[:need], layout=layout)
    where = S.place(cfg, params, mesh, layout, batch=batch)
    on = lambda tree, shardings: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                             tree, shardings)
    cache = on(jax.eval_shape(lambda: init_cache(cfg, batch, context)), where.cache)
    rows = lambda *shape: jax.ShapeDtypeStruct((batch, *shape), jax.numpy.int32, sharding=where.rows)
    # keep_unused: the draft stages and the vision tower, idle in a decode step, are resident all the same
    step = jax.jit(api.forward, static_argnames=("cfg", "all_logits", "kernels"), donate_argnames=("cache",), keep_unused=True,
                   out_shardings=(where.rows, where.cache))
    t0 = time.perf_counter()
    with where.active():
        compiled = step.lower(cfg, on(params, where.params), cache, rows(1), rows(), all_logits=False,
                              kernels="jnp").compile()
    m = compiled.memory_analysis()
    return dict(compile_s=time.perf_counter() - t0, arguments_per_device=m.argument_size_in_bytes,
                temporaries_per_device=m.temp_size_in_bytes, outputs_per_device=m.output_size_in_bytes)


def size(n: float) -> str:
    """Bytes in the binary unit that shows their digits, padded to one width."""
    for unit, b in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= b:
            return f"{n / b:9.1f} {unit}"
    return f"{n / 2**10:9.1f} KiB"


def default_mesh(cfg) -> str:
    """tensor=8 (an 8-GPU host) or, for a model too small to split 8 ways, the widest tensor split it takes."""
    for n in (8, 4, 2):
        try:
            S.check_mesh(cfg, {"tensor": n}, n_devices=n)
            return f"tensor={n}"
        except S.MeshError:
            continue
    return "tensor=1"


@_cli.entry_point
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-flash", choices=sorted(d.PRESETS))
    ap.add_argument("--mesh", help="axis=size pairs, e.g. data=2,expert=4 (default: tensor=8, or the widest "
                    "tensor split a small preset takes)")
    ap.add_argument("--layout", default="tp_ep", choices=sorted(S.LAYOUTS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, help="tokens per sequence (default: 131072, or the preset's "
                    "max_seq_len when smaller)")
    ap.add_argument("--hbm-gib", type=float, default=141.0, help="memory per device (H200: 141; TPU v5p: 95)")
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--compile", action="store_true",
                    help="also compile one decode step on the devices present (simulated on a CPU: see above) and "
                         "put XLA's bytes per device next to the plan's")
    a = ap.parse_args(argv)
    if a.batch < 1 or (a.context is not None and a.context < 1) or a.devices_per_host < 1:
        ap.error("--batch, --context and --devices-per-host must be >= 1")
    cfg = d.preset(a.preset)
    if a.context is not None and a.context > cfg.max_seq_len:
        raise _cli.UserError(f"--context {a.context}: more than {a.preset}'s max_seq_len ({cfg.max_seq_len})")
    a.context = a.context or min(131072, cfg.max_seq_len)
    a.mesh = a.mesh or default_mesh(cfg)
    try:
        p = plan(a.preset, a.mesh, a.layout, a.batch, a.context)
    except S.MeshError as e:
        raise _cli.UserError(f"--mesh {a.mesh}: {e}") from None
    hosts = max(1, p["devices"] // a.devices_per_host)
    need = (p["weights_per_device"] + p["cache_per_device"]) / 2**30
    print(f"{a.preset} on mesh {a.mesh} ({p['devices']} devices, layout {a.layout}), batch {a.batch} x context {a.context:,}")
    if p["weights_not_fp8"]:
        print(f"  (weights counted as bf16: {a.preset} does not fit the released FP8/FP4 formats: "
              f"{p['weights_not_fp8']})")
    kind = "bf16" if p["weights_not_fp8"] else "FP8 dense + FP4 experts"
    print(f"  {'weights (' + kind + ')':34s} total {size(p['weights_total'])}   "
          f"per device {size(p['weights_per_device'])}")
    print(f"  KV cache (FP4 global + FP8 window) total {size(p['cache_total'])}   "
          f"per device {size(p['cache_per_device'])}")
    print(f"  Engram tables (host memory)        total {size(p['engram_host_total'])}   per host   "
          f"{size(p['engram_host_total'] / hosts)} ({hosts} host(s))")
    verdict = "fits" if need <= a.hbm_gib else "does NOT fit"
    print(f"  per device: {size(need * 2**30).strip()} of {a.hbm_gib:.0f} GiB -> {verdict} (activations and workspace "
          "not counted)")
    if a.compile:
        c = compile_decode(a.preset, a.mesh, a.layout, a.batch, a.context)
        # what XLA's arguments hold: the plan's weights and cache, the Engram tables (on the device here) and tokens
        plan_args = p["weights_per_device"] + p["cache_per_device"] + p["engram_if_on_device"]
        print(f"  compiled decode step ({c['compile_s']:.0f} s): arguments {size(c['arguments_per_device']).strip()} "
              f"per device (plan, Engram tables on the device: {size(plan_args).strip()}, ratio "
              f"{c['arguments_per_device'] / plan_args:.3f}); temporaries {size(c['temporaries_per_device']).strip()}, "
              f"outputs {size(c['outputs_per_device']).strip()}")
        p.update(c, plan_arguments_per_device=plan_args)
    return p


if __name__ == "__main__":
    main()
