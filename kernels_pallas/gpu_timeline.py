"""Per-CTA timelines of a Mosaic GPU kernel: when each CTA reached each point of its program, and on which SM.

Where a kernel's time goes between its phases (a query's load, a pipeline's first step, the tiles, a merge) is
not in a profiler's trace, which sees the kernel whole, and this GPU has no hardware counters for it. A kernel
built with a timeline writes, from one thread of each CTA (or of each of its warpgroups), the GPU's global
nanosecond timer (`%globaltimer`, one clock for all SMs) at each of its points and the SM it ran on, into an extra
output: uint32 [CTAs, points + 1], the last column the SM id, the times the timer's low 32 bits (differences stay
exact over 4 s). `phases` turns it into the spread of each phase over the CTAs, and the kernel's span;
`phases_by_group` does so for each warpgroup's own columns.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.gpu_wgmma import i32_const, index_of

_SPLAT = plgpu.Layout.WG_SPLAT(shape=())


def emit_stamp(timeline, row, point, thread: int = 0) -> None:
    """`stamp` inside an inline_mgpu body (timeline: its gmem memref; row, point: i32 values): for a point inside a
    helper that a kernel body calls whole (a merge's barriers)."""
    i32 = ir.IntegerType.get_signless(32)
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), i32_const(thread))):
        now = mgpu_utils.inline_ptx("mov.u32 $0, %globaltimer_lo;", result_types=i32, has_side_effects=True)
        memref.store(now, timeline, [index_of(row), index_of(point)])
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, point, i32_const(0))):
            sm = mgpu_utils.inline_ptx("mov.u32 $0, %smid;", result_types=i32, has_side_effects=True)
            last = ir.MemRefType(timeline.type).shape[1] - 1
            memref.store(sm, timeline, [index_of(row), index_of(i32_const(last))])


@functools.cache
def _stamp(thread: int):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _SPLAT, _SPLAT))
    def write(ctx, timeline, row, point):
        del ctx
        emit_stamp(timeline, row.registers.item(), point.registers.item(), thread)

    return write


def stamp(timeline, row, point, thread: int = 0) -> None:
    """In a kernel body: timeline[row, point] = the timer's low 32 bits now, from thread `thread` of the CTA
    (timeline gmem u32 [CTAs, points + 1], or None: a kernel built without a timeline, nothing emitted; row, point:
    int32 scalars, traced or not; thread: the first thread of the warpgroup whose progress it marks); point 0 also
    writes the SM id in the last column."""
    if timeline is not None:
        _stamp(thread)(timeline, jnp.asarray(row, jnp.int32), jnp.asarray(point, jnp.int32))


def phases(timeline: np.ndarray, names: list[str]) -> dict:
    """The timeline u32 [CTAs, len(names) + 1] of one call -> {"span_us": first stamp to last, "sms": SMs used,
    "ctas_per_sm": most CTAs an SM ran, name: (median, 90th percentile, max) us of the phase that ends at point
    `name` (from the point before it; the first name: from the kernel's first stamp to each CTA's point 0)}.
    Phases of one kind repeated per item, named "kind i" (i an integer), are also summed per CTA as "kind *"."""
    t = np.asarray(timeline, np.int64)
    times = ((t[:, :-1] - t[0, 0] + 2**31) % 2**32) - 2**31  # the timer's wrap undone around CTA 0's start
    times = (times - times.min()) / 1e3
    prev = np.concatenate([np.zeros((len(times), 1)), times[:, :-1]], axis=1)
    spans = {name: times[:, i] - prev[:, i] for i, name in enumerate(names)}
    for name in list(spans):
        kind, _, item = name.rpartition(" ")
        if kind and item.isdigit():
            spans[f"{kind} *"] = spans.get(f"{kind} *", 0) + spans[name]
    out = {"span_us": float(times.max()), "sms": int(len(np.unique(t[:, -1]))),
           "ctas_per_sm": int(np.bincount(t[:, -1]).max())}
    for name, d in spans.items():
        out[name] = tuple(round(float(v), 2) for v in (np.median(d), np.percentile(d, 90), d.max()))
    return out


def phases_by_group(timeline: np.ndarray, groups: dict[str, list[str]]) -> dict:
    """`phases` of each group of columns (a kernel's warpgroups, each stamping its own points): groups maps a name
    to its points, the groups' columns one after the other in the timeline, the SM id last. Each group's first
    point is its own start."""
    t = np.asarray(timeline)
    firsts = np.cumsum([0] + [len(v) for v in groups.values()])
    if firsts[-1] + 1 != t.shape[1]:
        raise ValueError(f"{firsts[-1]} points and the SM id, for a timeline of {t.shape[1]} columns")
    return {group: phases(np.concatenate([t[:, at:at + len(names)], t[:, -1:]], axis=1), names)
            for at, (group, names) in zip(firsts, groups.items())}
