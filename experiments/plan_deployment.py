"""Memory per device of a deployment, from the sharding rules, without allocating anything.

    python -m experiments.plan_deployment --preset v41-flash --mesh tensor=8 --batch 64 --context 131072
    python -m experiments.plan_deployment --preset v41-flash --mesh data=4,expert=16 --devices-per-host 4 --hbm-gib 95

Weights are counted in the released formats (FP8 dense blocks, FP4 routed experts); the Engram tables
are planned in host memory (their lookups depend only on token ids, so rows can be prefetched). Every
number comes from `jax.eval_shape` of the real constructors and the `dsv41_jax.sharding` tables.
"""

from __future__ import annotations

import argparse
import math

import jax
from jax.sharding import AbstractMesh

import dsv41_jax as d
from dsv41_jax import sharding as S
from dsv41_jax.cache import init_cache


def _per_device_bytes(pairs, mesh) -> tuple[float, float]:
    """(total bytes, bytes on the most loaded device) of (abstract leaf, PartitionSpec) pairs."""
    total = per_dev = 0.0
    for leaf, spec in pairs:
        n = math.prod(leaf.shape) * leaf.dtype.itemsize
        split = math.prod(mesh.shape[a] for a in spec if a is not None)
        total += n
        per_dev += n / split
    return total, per_dev


def plan(preset: str, mesh_spec: str, layout: str, batch: int, context: int) -> dict:
    cfg = d.preset(preset, weight_format="fp8", param_dtype="bfloat16")
    sizes = S.parse_mesh(mesh_spec)
    S.check_mesh(cfg, sizes, batch, math.prod(sizes.values()))
    names = tuple(a for a in S.MESH_AXES if a in sizes)
    mesh = AbstractMesh(tuple(sizes[a] for a in names), names)
    params = d.abstract_params(cfg)
    specs = jax.tree.leaves(S.param_specs(params, mesh, layout))  # the params' logical-axes metadata
    dev, host = [], []
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], specs, strict=True):
        (host if "engram/table" in S._path_name(path) else dev).append((leaf, spec))
    w_total, w_dev = _per_device_bytes(dev, mesh)
    e_total = sum(math.prod(l.shape) * l.dtype.itemsize for l, _ in host)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context))
    c_total, c_dev = _per_device_bytes(zip(jax.tree.leaves(cache), jax.tree.leaves(S.cache_specs(cache, mesh, layout)),
                                           strict=True), mesh)
    return dict(preset=preset, mesh=sizes, layout=layout, batch=batch, context=context, devices=mesh.size,
                weights_total=w_total, weights_per_device=w_dev, cache_total=c_total, cache_per_device=c_dev,
                engram_host_total=e_total)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="v41-flash", choices=sorted(d.PRESETS))
    ap.add_argument("--mesh", default="tensor=8", help="axis=size pairs, e.g. data=2,expert=4")
    ap.add_argument("--layout", default="tp_ep", choices=sorted(S.LAYOUTS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--hbm-gib", type=float, default=141.0, help="memory per device (H200: 141; TPU v5p: 95)")
    ap.add_argument("--devices-per-host", type=int, default=8)
    a = ap.parse_args(argv)
    p = plan(a.preset, a.mesh, a.layout, a.batch, a.context)
    gib = 2**30
    hosts = max(1, p["devices"] // a.devices_per_host)
    need = (p["weights_per_device"] + p["cache_per_device"]) / gib
    print(f"{a.preset} on mesh {a.mesh} ({p['devices']} devices, layout {a.layout}), batch {a.batch} x context {a.context:,}")
    print(f"  weights (FP8 dense + FP4 experts)  total {p['weights_total'] / gib:9.1f} GiB   per device {p['weights_per_device'] / gib:8.1f} GiB")
    print(f"  KV cache (FP4 global + FP8 window) total {p['cache_total'] / gib:9.1f} GiB   per device {p['cache_per_device'] / gib:8.1f} GiB")
    print(f"  Engram tables (host memory)        total {p['engram_host_total'] / gib:9.1f} GiB   per host   {p['engram_host_total'] / hosts / gib:8.1f} GiB ({hosts} host(s))")
    verdict = "fits" if need <= a.hbm_gib else "does NOT fit"
    print(f"  per device: {need:.1f} GiB of {a.hbm_gib:.0f} GiB -> {verdict} (activations and workspace not counted)")
    return p


if __name__ == "__main__":
    main()
