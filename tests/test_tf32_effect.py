"""experiments.tf32_effect's variants: only the hc_fn leaves change, rounded to TF32 or moved one ulp."""

from __future__ import annotations

import jax
import numpy as np

from dsv41_jax import api, config
from experiments import tf32_effect


def test_variants_change_only_hc_fn_as_named():
    cfg = config.preset("tiny")
    params = api.init_params(cfg, seed=0)
    out = tf32_effect.variants(params, seed=0)
    flat = {name: jax.tree_util.tree_flatten_with_path(p)[0] for name, p in out.items()}
    n_fn, directions = 0, {}
    for (path, ref), (_, tf32), (_, ulp) in zip(flat["as stored"], flat["hc_fn rounded to TF32"],
                                                flat["hc_fn moved 1 ulp"]):
        ref, tf32, ulp = (np.asarray(a) for a in (ref, tf32, ulp))
        if not tf32_effect._is_hc_fn(path):
            assert np.array_equal(tf32, ref) and np.array_equal(ulp, ref), jax.tree_util.keystr(path)
            continue
        n_fn += 1
        bits = tf32.view(np.uint32)
        assert not np.any(bits & 0x1FFF) and np.all(np.abs(tf32 - ref) <= np.abs(ref) * 2.0 ** -11)
        assert np.all(np.abs(ulp.view(np.int32).astype(np.int64) - ref.view(np.int32)) == 1)
        directions.setdefault(ref.shape, []).append(ulp > ref)
    assert n_fn == 2 * (cfg.n_layers + cfg.n_mtp_layers)  # an attention and an FFN projection per block
    # leaves of one shape are moved in their own directions, not all in one pattern
    same = [ds for ds in directions.values() if len(ds) > 1]
    assert same and all(not np.array_equal(ds[0], ds[1]) for ds in same)
