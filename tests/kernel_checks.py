"""Checks shared by the GPU and TPU kernel tests."""

import jax.numpy as jnp
import numpy as np


def assert_scan_matches(out, ref, n: int, block: int | None) -> None:
    """Indexer-scan kernel output vs the jnp reference: same -inf pattern, finite scores within 1e-5 of
    the row scale, and (with `block`) per-block maxima equal to the max over the kernel's own scores."""
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
