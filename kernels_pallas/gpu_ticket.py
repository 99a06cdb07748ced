"""The last program of a row finishes it (Pallas, Triton lowering): a launch's programs share a row's work, and
the one that arrives last, by a ticket from an atomic counter, reads what they all wrote.

Used where a decode step ran an XLA dot and a small kernel after it (`gpu_hyper.expand_hyper_in`,
`gpu_router.router_route`): the dot's weight split over many programs (one would read it alone at one SM's
rate), the small kernel's work in the last one. The counter is an int32 per row, zero before the launch (an
aliased `jnp.zeros` input) and zero again after it. Ordering: each program's threads meet at a CTA barrier
before the ticket's acq_rel atomic at GPU scope, and the last program's threads meet again after it, so its
reads (volatile, past the L1) see every other program's writes. Not yet run on a GPU (twenty-fifth session:
interpret-tested and lowered for an H200 only; both kernels are off by default until
`experiments.device_runs.issue12_decode fused` has compiled and timed them).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def last_program(counter_ref, row, programs: int, body, *, interpret: bool) -> None:
    """Call body() in the last of row `row`'s `programs` programs to get here, after every program's earlier
    stores; then zero the row's counter. (Interpret mode runs the programs in order, one thread, no barrier.)"""
    if not interpret:
        plt.debug_barrier()
    ticket = plt.atomic_add(counter_ref, (row,), jnp.int32(1))

    @pl.when(ticket == programs - 1)
    def _last():
        if not interpret:
            plt.debug_barrier()
        body()
        plt.atomic_add(counter_ref, (row,), jnp.int32(-programs))  # every program has arrived: zero again
