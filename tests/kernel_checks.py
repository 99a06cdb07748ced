"""Inputs and checks shared by the GPU, TPU and dispatch kernel tests."""

import functools
from unittest import mock

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from dsv41_jax import ops, quant


def index_case(seed, b, h, d, n):
    """(q f32 [B, H, D] on the FP4 grid, w f32 [B, H], packed index-key records [B, N, ...])."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = quant.fake_quant(quant.INDEX_KEY, jax.random.normal(k1, (b, h, d)) * 2)
    w = jax.random.normal(k2, (b, h))
    rec = quant.INDEX_KEY.encode(jax.random.normal(k3, (b, n, d)))
    return q, w, rec


def pool_blocks(seed, reach_b, n: int, n_blocks: int, block: int) -> jax.Array:
    """int32 [B, n_blocks]: a candidate pool drawn as the model draws it (`ops.candidate_blocks` of random
    scores over N positions), so ascending, the newest reachable block pinned, -1 padded."""
    r = jnp.asarray(reach_b, jnp.int32)[:, None]
    s = ops.mask_unreachable(jax.random.normal(jax.random.key(seed), (r.shape[0], 1, n)), r)
    return ops.candidate_blocks(s, r, n_blocks, block)[:, 0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 5, 6))
def _pool_case(b, h, d, n, reach, block, n_blocks):
    """(q, w, index-key records, pool blocks, `ops.indexer_scores_pool_decode` of them): compiled whole, as
    op-by-op it cost more than the interpreted kernel it checks."""
    q, w, rec = index_case(n + h, b, h, d, n)
    blocks = pool_blocks(n, reach, n, n_blocks, block)
    return q, w, rec, blocks, ops.indexer_scores_pool_decode(q, w, rec, blocks, block, reach, quant.INDEX_KEY)


def check_pool_scan(scan, b, h, d, n, reach, block, n_blocks) -> None:
    """A platform's pool-scan kernel `scan(q, w, values, scales, blocks, reach)` against
    `ops.indexer_scores_pool_decode` on a random case (pool drawn by `pool_blocks`)."""
    reach = jnp.array(reach, jnp.int32)
    q, w, rec, blocks, ref = _pool_case(b, h, d, n, reach, block, n_blocks)
    assert_scan_matches(scan(q, w, rec["values"], rec["scales"], blocks, reach), ref, n, None)


def assert_scan_matches(out, ref, n: int, block: int | None) -> None:
    """Indexer-scan kernel output vs the jnp reference: same -inf pattern, finite scores within 1e-5 of
    the row scale, and (with `block`) per-block maxima equal to the max over the kernel's own scores.
    Also serves the pool scan (block None; n unused)."""
    s = out[0] if block else out
    fin = np.isfinite(np.asarray(ref))
    np.testing.assert_array_equal(np.isfinite(s), fin)
    scale = float(jnp.max(jnp.abs(jnp.where(fin, ref, 0)))) or 1.0
    np.testing.assert_allclose(np.asarray(s)[fin], np.asarray(ref)[fin], atol=1e-5 * scale, rtol=0)
    if block:
        b = s.shape[0]
        nb = -(-n // block)
        want = jnp.pad(s, ((0, 0), (0, nb * block - n)), constant_values=-jnp.inf).reshape(b, nb, block).max(-1)
        np.testing.assert_array_equal(out[1], want)


def lower_for_h200(fn, *args) -> str:
    """StableHLO of jit(fn) on `args` (ShapeDtypeStructs) lowered for CUDA with an H200 as the target: what a
    CPU can check of a GPU kernel, that every operation of its body has a Triton lowering (compiling the
    Triton module needs a GPU). The lowering asks the device for its compute capability: an H200's is given."""
    from jax._src.pallas.triton import gpu_info

    h200 = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    with mock.patch.object(gpu_info, "get_gpu_info", h200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lower_for_tpu(fn, *args, device_kind: str = "TPU v5 lite") -> str:
    """StableHLO of jit(fn) on `args` (ShapeDtypeStructs) lowered for a TPU of `device_kind`, traced as on a TPU
    host (jax.default_backend() "tpu"), the Pallas kernels by Mosaic TPU: what a CPU can check of the TPU kernels
    besides interpret mode, that every operation of their bodies has a Mosaic lowering for that generation
    (compiling the Mosaic modules needs a TPU)."""
    # the lowering reads the TPU generation from the abstract mesh's device; Auto axes (Explicit would type shardings)
    tpu = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                    abstract_device=jax.sharding.AbstractDevice(device_kind, 1, "tpu"))
    with mock.patch.object(jax, "default_backend", lambda: "tpu"), jax.sharding.use_abstract_mesh(tpu):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in a jaxpr, nested jaxprs (jit, custom_vjp, pallas_call) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += dot_precisions(sub)
    return out
