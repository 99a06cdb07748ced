"""`rope.pair_angles`: the angles `apply_rope` turns each channel pair by, as the attention kernels take them to
undo the query's rotation on their output (`gpu_attention.unrotated`)."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.rope import apply_rope, inv_frequencies, pair_angles
from kernels_pallas.gpu_attention import unrotated


def test_unrotated_by_the_pair_angles_is_the_inverse_rope():
    """Rows of 64 channels whose last 16 rotate (YaRN frequencies, positions up to 1M): `unrotated` with
    `pair_angles` equals apply_rope(inverse=True) to an f32 rounding (the same cos and sin; an FMA may round
    differently), leaves the unrotated channels bit for bit, and undoes apply_rope."""
    inv_freq = inv_frequencies(16, 1.6e5, True, 65536, 16.0, 32, 1)
    o = jax.random.normal(jax.random.key(0), (4, 8, 64)) * 5
    pos = jnp.array([0, 1, 4097, (1 << 20) - 1], jnp.int32)
    cos, sin = pair_angles(pos, inv_freq, 64)
    assert cos.shape == sin.shape == (4, 32)
    np.testing.assert_array_equal(cos[:, :24], 1.0)
    np.testing.assert_array_equal(sin[:, :24], 0.0)
    want = apply_rope(o[:, None], pos[:, None], inv_freq, inverse=True)[:, 0]
    got = unrotated(o, cos, sin)
    np.testing.assert_array_equal(got[..., :48], o[..., :48])
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * float(jnp.abs(o).max()))
    back = unrotated(apply_rope(o[:, None], pos[:, None], inv_freq)[:, 0], cos, sin)
    np.testing.assert_allclose(back, o, rtol=0, atol=4e-6 * float(jnp.abs(o).max()))
