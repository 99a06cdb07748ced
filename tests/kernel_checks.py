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


def bf16_bits_to_float(bits_u16: np.ndarray) -> np.ndarray:
    """float64 values of bf16 bit patterns (uint16)."""
    return (bits_u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def run_decode_ptx(ptx: str, word: np.ndarray, exp_u8: np.ndarray) -> np.ndarray:
    """float64 [..., 4, 2]: a keys' decode PTX (`gpu_wgmma.DECODE_PTX`'s operands: $4 the uint32 words, $5 the
    bf16x2 factor 2**(E8M0 byte - 1); outputs $0 .. $3, low and high lane) run instruction by instruction in numpy.
    It knows the instructions those decodes use and refuses any other; an fma.rn.bf16x2 must be exact (each
    product a bf16, the addend -0), which it asserts."""
    mult = ((exp_u8.astype(np.uint32) + 126) << 7).astype(np.uint16)  # bf16 2**(E + 126), E = byte - 127
    regs = {"$4": word.astype(np.uint32)}
    outs = {}

    def val(x):
        return regs[x] if x in regs else np.uint32(int(x, 0))

    body = ptx.strip()[1:-1]  # "{ .reg ...; op; op; }"
    for ins in (s.strip() for s in body.split(";") if s.strip()):
        op, args = ins.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == ".reg":
            continue
        if op == "mov.b32":
            regs[a[0]] = val(a[1]) + np.zeros_like(word, np.uint32)
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> np.uint32(int(a[2]))
        elif op == "shf.l.wrap.b32":  # {a[2]:a[1]} << n, upper word; a[1] == a[2]: a rotate
            assert a[1] == a[2], ins
            n = np.uint32(int(a[3]) % 32)
            x = val(a[1])
            regs[a[0]] = (x << n) | (x >> (np.uint32(32) - n)) if n else x
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "mul.lo.u32":
            regs[a[0]] = ((val(a[1]).astype(np.uint64) * int(val(a[2]))) & 0xFFFFFFFF).astype(np.uint32)
        elif op == "fma.rn.bf16x2":
            assert a[2] == "$5" and np.all(val(a[3]) == 0x80008000), ins  # times the factor, plus -0
            t = val(a[1])
            lanes = np.stack([t & np.uint32(0xFFFF), t >> np.uint32(16)], -1).astype(np.uint16)
            prod = bf16_bits_to_float(lanes) * bf16_bits_to_float(mult)[..., None]
            assert np.all(np.asarray(jnp.asarray(prod, jnp.bfloat16), np.float64) == prod), "an inexact product"
            outs[int(a[0][1:])] = prod
        else:
            raise AssertionError(f"the numpy model does not know {op!r}")
    assert sorted(outs) == [0, 1, 2, 3], sorted(outs)
    return np.stack([outs[i] for i in range(4)], -2)
