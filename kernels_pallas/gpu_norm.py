"""RMSNorms of a decode step's few rows, several projections' outputs in one launch (Pallas, Triton lowering).

An attention layer normalizes two projections of its input before it goes on: q_norm(wq_a x), whose output
wq_b reads next, and kv_norm(wkv x). On the H200 XLA ran them as ~4 small kernels between the wq_a / wkv launch
and wq_b (the projections' cast to the model's dtype, a reduction per norm, the scaling: 4.0-5.8 us from wq_a's
end to wq_b's start in the H200's batch-1 step, read from
`python -m experiments.profile_step --from-events docs/bench_decode/h200_session29_call7_events.json.gz --timeline`). Here one program per
(row, input) reads the projection's f32 output, rounds it to the model's dtype as the jnp path does, and writes
`dsv41_jax.layers.rms_apply` of it (the model's function, traced on the loaded slices of the row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.gpu_hyper import MAX_CHUNKS, row_slices, store_normalized
from kernels_pallas.gpu_hyper import row_supported as supported  # rows read as the hyper kernel reads its stream's


def _row(n, x_ref, w_ref, o_ref, *, norm, eps: float):
    """Row n of one input: rounded to the output's dtype (as the jnp path), normalized in f32."""
    xs = [x_ref[n, c].astype(o_ref.dtype).astype(jnp.float32) for c in row_slices(x_ref.shape[1])]
    store_normalized(n, xs, w_ref, o_ref, norm=norm, eps=eps)


@functools.partial(jax.jit, static_argnames=("norm", "eps", "out_dtype", "num_warps", "interpret"))
def rms_norms(xs: tuple, weights: tuple, *, norm, eps: tuple, out_dtype, num_warps: int = 4,
              interpret: bool = False) -> list:
    """[norm(x.astype(out_dtype) in f32, w, mean square, eps) in out_dtype] for each x [N, D_i] (any float dtype;
    `supported(D_i)`), weight [D_i] and eps of `xs`, `weights`, `eps`: grid N x len(xs). `norm`:
    `dsv41_jax.layers.rms_apply`."""
    n = xs[0].shape[0]
    for x, w in zip(xs, weights):
        if x.ndim != 2 or x.shape[0] != n or w.shape != x.shape[1:] or not supported(x.shape[1]):
            raise ValueError(f"rms_norms takes rows [N, D] of one N with weights [D], D in at most {MAX_CHUNKS} "
                             f"power-of-two slices of >= 16; got {[x.shape for x in xs]}, "
                             f"{[w.shape for w in weights]}")
    k = len(xs)

    def kernel(*refs):
        row, which = pl.program_id(0), pl.program_id(1)
        for i in range(k):
            pl.when(which == i)(functools.partial(_row, row, refs[i], refs[k + i], refs[2 * k + i], norm=norm,
                                                  eps=eps[i]))

    return list(pl.pallas_call(
        kernel, grid=(n, k), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        out_shape=[jax.ShapeDtypeStruct(x.shape, out_dtype) for x in xs], name="rms_norms",
    )(*xs, *weights))
