"""Fingerprints of the issue-21 kernels' Mosaic GPU modules as lowered for CUDA, on any machine (no GPU needed).

    PYTHONPATH=. python -m experiments.mosaic_modules              # a line per kernel form: sha256, form

A kernel change meant to leave a form's code alone (a new keyword argument whose default is the measured kernel)
prints the same line for that form before and after it: run this at both commits and compare (a form the older
commit does not take is reported as such). The hash is of the module's assembly without debug locations (the
source lines move with every edit) and without the per-process dump name, parsed from the `module` attribute of
the `mosaic_gpu` custom call in `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`.
"""

from __future__ import annotations

import hashlib
import re

# (kernel, keyword arguments): the forms the GPU measured (2 ranges merged, with a timeline, 3 as partials; the
# scan with q_parts 1 and 2); a candidate form is added here while it is compared
ATTENTION = ({"splits": 2, "merged": True}, {"splits": 2, "merged": True, "timeline": True}, {"splits": 3})
SCAN = ({"q_parts": 1}, {"q_parts": 2})


def module_bytes(hlo_text: str) -> list[bytes]:
    """The bytecode of every Mosaic GPU module in lowered StableHLO text (its escaped `module = "..."` string)."""
    out = []
    for m in re.finditer(r'module = "((?:[^"\\]|\\.)*)"', hlo_text):
        s, b, i = m.group(1), bytearray(), 0
        while i < len(s):
            if s[i] == "\\" and re.fullmatch(r"[0-9A-Fa-f]{2}", s[i + 1:i + 3]):
                b.append(int(s[i + 1:i + 3], 16))
                i += 3
            elif s[i] == "\\":
                b += s[i + 1].encode()
                i += 2
            else:
                b += s[i].encode("latin-1")
                i += 1
        out.append(bytes(b))
    return out


def assembly(hlo_text: str) -> list[str]:
    """The Mosaic GPU modules' assembly without debug locations, the per-process dump name (a counter) blanked."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    out = []
    for code in module_bytes(hlo_text):
        ctx = jax_mlir.make_ir_context()
        ctx.allow_unregistered_dialects = True
        mosaic_gpu_dialect.register_dialect(ctx)
        with ctx:
            asm = ir.Module.parse(code).operation.get_asm(enable_debug_info=False)
        out.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', 'mosaic_gpu.dump_basename = ""', asm))
    return out


def fingerprint(hlo_text: str) -> str:
    """sha256 of `assembly` (the first 16 hex digits)."""
    return hashlib.sha256("\n".join(assembly(hlo_text)).encode()).hexdigest()[:16]


def lowered(kernel: str, form: dict) -> str:
    """StableHLO text of `kernel` ("attention" at batch 2, 128 window + 512 entries; "scan" at 8 x 128K, 64
    heads) with keyword arguments `form`, lowered for CUDA."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import gpu_attention_wgmma as att, gpu_indexer_wgmma as scan

    s = jax.ShapeDtypeStruct
    if kernel == "attention":
        b, w, n, k = 2, 128, 300, 512
        args = (s((b, att.H, att.D), jnp.float32), s((b, w, att.D), jnp.uint8), s((b, w, att.D // 32), jnp.uint8),
                s((b, w), jnp.bool_), s((b, n, att.D // 2), jnp.uint8), s((b, n, att.D // 16), jnp.uint8),
                s((b, k), jnp.int32), s((att.H,), jnp.float32))
        fn = lambda *a: att.sparse_attention_wgmma(*a, scale=0.05, **form)  # noqa: E731
    else:
        b, n = 8, 131072
        args = (s((b, 64, scan.D), jnp.float32), s((b, 64), jnp.float32), s((b, n, scan.D // 2), jnp.uint8),
                s((b, n, scan.D // scan.GROUP), jnp.uint8), s((b,), jnp.int32))
        fn = lambda *a: scan.indexer_scores_wgmma(*a, **form)  # noqa: E731
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def main() -> None:
    for kernel, forms in (("attention", ATTENTION), ("scan", SCAN)):
        for form in forms:
            try:
                line = fingerprint(lowered(kernel, form))
            except (TypeError, ValueError) as e:  # an older tree without the form's argument
                line = f"{'-':16} ({type(e).__name__}: {str(e)[:60]})"
            print(line, kernel, form, flush=True)


if __name__ == "__main__":
    main()
