"""`experiments.mosaic_modules`: the fingerprint of a kernel form's Mosaic GPU module, what a change meant to leave a
form's code alone is checked with (CPU only: it lowers for CUDA)."""

import jax
import pytest

from experiments import mosaic_modules as mm

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowering for CUDA is checked on the CPU")


def test_a_form_has_one_fingerprint_and_different_code_another():
    default = mm.lowered("attention", {"splits": 2, "merged": True})
    assert len(mm.module_bytes(default)) == 1
    assert mm.fingerprint(default) == mm.fingerprint(mm.lowered("attention", {"splits": 2, "merged": True}))
    assert mm.fingerprint(default) != mm.fingerprint(mm.lowered("attention", {"splits": 2, "merged": True,
                                                                          "timeline": True}))


def test_the_fingerprint_leaves_out_source_locations():
    """The lowered module carries the kernel's source lines (they move with every edit); what is hashed does not."""
    text = mm.lowered("scan", {"q_parts": 1})
    assert b"gpu_indexer_wgmma.py" in mm.module_bytes(text)[0]
    (asm,) = mm.assembly(text)
    assert "gpu_indexer_wgmma.py" not in asm and "wgmma" in asm
