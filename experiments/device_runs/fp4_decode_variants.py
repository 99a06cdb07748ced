"""The FP4 / FP8 weight kernels' decode variants on one H200 (sixteenth session): exactness of each variant
against the twin's decode (one-hot rows: the kernel outputs its decoded weights), then the weight kernels
alone per variant, then the kernels' PTX.

    PYTHONPATH=. python3 -m experiments.device_runs.fp4_decode_variants     # ~5 min
"""

import jax.numpy as jnp
import numpy as np

from dsv41_jax import grouped
from experiments.device_runs._steps import OUT, step
from kernels_pallas import gpu_grouped

VARIANTS = {"ptx": dict(), "int": dict(fast_decode="int"), "swap": dict(swap_ab=True),
            "int swap": dict(fast_decode="int", swap_ab=True)}


def exact() -> None:
    rng = np.random.default_rng(0)
    n, k = 64, 512
    vals = jnp.asarray(np.tile(np.arange(256, dtype=np.uint8), n * k // 2 // 256).reshape(1, n, k // 2))
    sc = jnp.asarray(rng.integers(gpu_grouped.FP4_FAST_MAX - 12, gpu_grouped.FP4_FAST_MAX + 1, (1, n, k // 32)), jnp.uint8)
    want = np.asarray(grouped.dequantize_experts({"values": vals, "scales": sc}, jnp.float32)[0])
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    for name, kw in VARIANTS.items():
        got = np.asarray(gpu_grouped.grouped_matmul_fp4(eye, vals, sc, jnp.array([k], jnp.int32), **kw))
        print(f"exact {name}: {np.array_equal(got, want)} (max diff {np.abs(got - want).max():.3g})", flush=True)


if __name__ == "__main__":
    exact()
    step("weights_variants", ["-m", "experiments.bench_weights", "--batch", "1", "8", "--sweep", "--variants", "int",
                              "int swap", "f32 swap", "--out", f"{OUT}/weights_variants.json"], 200)
    step("kernel_ptx", ["-m", "experiments.device_runs.kernel_ptx"], 90)
    for name in ("weights_variants", "kernel_ptx"):
        print(f"\n== {name}\n" + "".join(open(f"{OUT}/{name}.log").readlines()[-60:]))
