"""Quantizer near-ties: which FP8/FP4 rounding decisions of a run hang on a few float32 ulps, and the
same run with chosen ones pushed across their boundary (tests/test_parity.py uses it).

Why: in float32 the official code and ours compute every quantizer input to within a few ulps, but
summation order differs between CPUs, so an input that lies 1-2 ulps from a rounding boundary (an
FP8/FP4 code midpoint, or the power-of-two / E4M3 step of a group scale) can land on either side.
Such a flip changes a code, then possibly an expert or a selected block downstream, and moves the
logits of that sequence from there on by up to ~10% of their scale. A correct port then matches the
reference to float rounding once those few decisions are made the reference's way; a wrong one
(other quantizer, other semantics, other selection) does not, whatever is flipped.

How: inside `NearTies.active()` the public entry points run through another `jax.jit` of
`dsv41_jax.api.forward`, in which every codec `encode` (activation quantizer and cache quantizers
alike) first passes its input through an ordered host callback. The callback records, per element,
the distance in ulps to the nearest boundary of the element's code and of its group's scale, and
applies the requested nudges. A site is (codec call, its n-th execution in the run, flat element);
a flip moves that element by enough ulps to cross the boundary. The production programs are not
touched: the codecs are patched only while the other jit traces, so only its programs carry the
callbacks.
"""

from __future__ import annotations

from contextlib import contextmanager

import jax
import ml_dtypes
import numpy as np
from jax.experimental import io_callback

from dsv41_jax import api, quant

# Rounding boundaries of |value| for each element format (E4M3: midpoints of its finite magnitudes).
_E4M3 = np.sort(quant.E4M3_VALUES[:127])
_BOUNDS = {"e4m3": (_E4M3[1:] + _E4M3[:-1]) / 2, "e2m1": quant._FP4_MIDS.astype(np.float64)}


def _ulp(v: np.ndarray) -> np.ndarray:
    """float64 size of one float32 ulp at v (from the exponent bits: the host may flush denormals)."""
    exp = (np.asarray(v, np.float32).view(np.int32) >> 23) & 0xFF
    return np.exp2(np.maximum(exp, 1) - 150.0)


def _distance(v: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ulps from |v| to its nearest boundary, +1 where that boundary is above |v| else -1)."""
    a = np.abs(v).astype(np.float64)
    i = np.searchsorted(bounds, a)
    lo, hi = bounds[np.maximum(i - 1, 0)], bounds[np.minimum(i, len(bounds) - 1)]
    near = np.where(np.abs(hi - a) < np.abs(a - lo), hi, lo)
    return np.abs(near - a) / _ulp(v), np.where(near >= a, 1, -1)


def _margins(codec, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per element of x [..., D] (f32): ulps to the nearest boundary of any rounding decision it takes
    part in, and the number of ulps (signed, in |x|) that carries it across that boundary."""
    g = x.reshape(*x.shape[:-1], -1, codec.block).astype(np.float32)
    amax = np.abs(g).max(-1)
    # t: what the group's scale is rounded from, as quant.py computes it
    if isinstance(codec, quant.Fp8Codec):
        fmt, step, t = "e4m3", "e8m0", np.maximum(amax, np.float32(1e-4)) * np.float32(1 / quant.FP8_MAX)
    elif codec.scale_format == "e8m0":
        fmt, step, t = "e2m1", "e8m0", np.maximum(amax, np.float32(6 * 2.0**-126)) * np.float32(1 / quant.FP4_MAX)
    else:
        fmt, step, t = "e2m1", "e4m3", np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(quant.FP4_MAX)
    if step == "e8m0":  # scale 2^ceil(log2 t): the boundary lies just above each power of two
        mant = t.view(np.int32) & 0x7FFFFF
        s_dist, s_dir = np.where(mant < 0x400000, mant, 0x800000 - mant), np.where(mant < 0x400000, -1, 1)
        scale = (((t.view(np.int32) >> 23) + (mant != 0)) << 23).astype(np.int32).view(np.float32)
    else:
        s_dist, s_dir = _distance(t, _BOUNDS["e4m3"])
        scale = t.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    v = np.clip(g / scale[..., None], -6, 6) if fmt == "e2m1" else g / scale[..., None]
    dist, direction = _distance(v, _BOUNDS[fmt])
    # the group's largest element also decides the scale
    is_max = np.abs(g) == amax[..., None]
    s_dist = np.where(is_max, s_dist[..., None], np.inf)
    take_scale = s_dist < dist
    dist = np.where(take_scale, s_dist, dist)
    move = np.where(take_scale, s_dir[..., None], direction) * (2 * np.floor(dist) + 2)
    return dist.reshape(x.shape), move.reshape(x.shape)


class NearTies:
    """Runs of the model with the quantizer inputs' near-ties recorded and chosen ones flipped."""

    def __init__(self, max_ulps: float):
        self.max_ulps = max_ulps
        self.flips: dict[tuple, int] = {}  # (call, execution, element) -> ulps to add to |x|
        self.sites: dict[tuple, tuple[float, int]] = {}  # same key -> (ulps to boundary, move)
        self._runs: dict[int, int] = {}
        self._codecs: list = []
        self._jit = jax.jit(self._forward, static_argnames=("cfg", "all_logits", "layers", "kernels"))

    @staticmethod
    def _forward(cfg, params, cache, tokens_bt, n_new_b, *, all_logits=False, layers=None, kernels="jnp",
                 image_embeds_btd=None, image_mask_bt=None):
        return api.forward(cfg, params, cache, tokens_bt, n_new_b, all_logits=all_logits, layers=layers,
                           kernels=kernels, image_embeds_btd=image_embeds_btd, image_mask_bt=image_mask_bt)

    @contextmanager
    def active(self):
        """`dsv41_jax.prefill` / `decode_step` run through this jit (input checks and all) meanwhile."""
        production = api._forward_jit
        api._forward_jit = self._traced
        try:
            yield
        finally:
            api._forward_jit = production

    def _traced(self, *args, **kwargs):
        with self._patched():  # only a trace sees the patched codecs; compiled programs keep the callbacks
            return self._jit(*args, **kwargs)

    def reset(self, flips: dict[tuple, int] | None = None) -> None:
        """Start a new run: forget the recorded sites and execution counts, flip `flips`."""
        self.flips, self.sites, self._runs = dict(flips or {}), {}, {}

    def _visit(self, call, x):
        x = np.array(x, np.float32)
        n = self._runs.get(call, 0)
        self._runs[call] = n + 1
        dist, move = _margins(self._codecs[call], x)
        for i in np.flatnonzero(dist <= self.max_ulps):
            self.sites[(call, n, int(i))] = (float(dist.flat[i]), int(move.flat[i]))
        flat = x.reshape(-1).view(np.int32)
        for (c, k, i), ulps in self.flips.items():
            if (c, k) == (call, n):
                flat[i] += ulps  # sign-magnitude: adding to the bits moves |x|
        return x

    @contextmanager
    def _patched(self):
        originals = quant.Fp8Codec.encode, quant.Fp4Codec.encode

        def wrap(original):
            def encode(codec, x):
                call = len(self._codecs)
                self._codecs.append(codec)
                seen = io_callback(lambda v: self._visit(call, v), jax.ShapeDtypeStruct(x.shape, np.float32),
                                   x.astype(np.float32), ordered=True)
                return original(codec, seen.astype(x.dtype))
            return encode

        quant.Fp8Codec.encode, quant.Fp4Codec.encode = map(wrap, originals)
        try:
            yield
        finally:
            quant.Fp8Codec.encode, quant.Fp4Codec.encode = originals

    def explain(self, run, count_bad, max_flips: int) -> tuple[dict[tuple, int], np.ndarray]:
        """Flip near-ties, one at a time, while that lowers `count_bad(run())`; returns (flips, logits).

        run(): the case's logits through `dsv41_jax.prefill` / `decode_step` (routed here). Candidates
        are the latest accepted run's sites, nearest first, accepting the first that helps (a flip at
        the first diverging position fixes everything after it). Exact ties (0 ulps) are left alone:
        an input that lies exactly on a boundary is computed exactly, so no summation order moves it."""
        with self.active():
            self.reset()
            out = run()
            bad, flips, sites = count_bad(out), {}, dict(self.sites)
            while bad and len(flips) < max_flips:
                for site, (dist, move) in sorted(sites.items(), key=lambda kv: kv[1][0]):
                    if dist == 0 or site in flips:
                        continue
                    self.reset({**flips, site: move})
                    trial = run()
                    if count_bad(trial) < bad:
                        flips[site], out, bad, sites = move, trial, count_bad(trial), dict(self.sites)
                        break
                else:
                    break
        return flips, out
