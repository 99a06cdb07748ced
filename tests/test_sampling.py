"""`sampling.sample`: greedy rows are the argmax, sampled rows are `jax.random.categorical` with the row's key
fold_in(key(seed), step) at logits / temperature, the same ids bit for bit, rows independent of each other."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.sampling import sample


def _reference(logits_bv, temperature_b, seed_b, step_b):
    out = []
    for logits, t, seed, step in zip(logits_bv, temperature_b, seed_b, step_b):
        if t > 0:
            key = jax.random.fold_in(jax.random.key(int(seed)), int(step))
            out.append(int(jax.random.categorical(key, logits / max(float(t), 1e-5))))
        else:
            out.append(int(jnp.argmax(logits)))
    return out


def test_sample_is_argmax_when_greedy_and_categorical_when_not():
    rng = np.random.default_rng(0)
    b, v = 12, 1000
    logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
    top = logits[3].max() + 1.0
    logits = logits.at[3, 7].set(top).at[3, 900].set(top)  # a greedy tie: the first index
    temp = jnp.asarray([0.0, 0.7, 1.0, 0.0, 2.5, 0.0, 1e-3, 1.3, 0.0, 0.9, 1.0, 0.0], jnp.float32)
    seed = jnp.asarray(rng.integers(0, 2**31, b), jnp.uint32)
    step = jnp.asarray(rng.integers(0, 1000, b), jnp.int32)
    got = np.asarray(sample(logits, temp, seed, step)).tolist()
    assert got == _reference(logits, temp, seed, step)
    assert got[3] == 7
    # a sampled row draws: over 200 steps its ids vary
    many = [int(np.asarray(sample(logits[1:2], temp[1:2], seed[1:2], jnp.asarray([s], jnp.int32)))[0])
            for s in range(200)]
    assert len(set(many)) > 20
