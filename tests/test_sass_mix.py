"""experiments.sass_mix: the opcode classes it counts from an nvdisasm listing, and the decode wrapper it
hands ptxas (ptxas and nvdisasm themselves are not needed here)."""

from __future__ import annotations

import re

from experiments import sass_mix

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R7, R4, 0xf000f0, RZ, 0xc0, !PT ;
        /*0020*/                   IMAD R7, R7, 0x104, RZ ;
        /*0030*/               @P1 SHF.R.U32.HI R0, RZ, 0x8, R4 ;
        /*0040*/              @!P2 LOP3.LUT R0, R0, 0x81c081c0, RZ, 0xc0, !PT ;
        /*0050*/                   HMUL2.BF16_V2 R5, R0, R5 ;
        /*0060*/                   SHFL.BFLY PT, R25, R34, 0x1, 0x1f ;
        /*0070*/                   HGMMA.64x32x16.F32.BF16 R24, R68, gdesc[UR40], RZ, !UPT ;
"""


def test_classify_counts_opcodes_and_their_classes_predicated_or_not():
    ops, classes = sass_mix.classify(LISTING)
    assert ops == {"LDC": 1, "LOP3": 2, "IMAD": 1, "SHF": 1, "HMUL2": 1, "SHFL": 1, "HGMMA": 1}
    assert classes == {"ALU": 3, "IMAD": 1, "FP": 1, "MIO": 1, "other": 2}


def test_decode_wrapper_binds_every_operand_of_each_decode():
    for name, (ptx, n_out) in sass_mix.decodes().items():
        entry = sass_mix.decode_kernel(name.replace("-", "_"), ptx, n_out)
        assert "$" not in entry  # every operand bound to a register
        assert f"st.global.v{n_out}.u32" in entry and f"ld.global.u32 %r{n_out}," in entry  # outputs, then the word
        assert f"ld.param.u32 %r{n_out + 1}, [mult]" in entry  # then the scale
        assert set(re.findall(r"%r(\d+)", entry)) <= {str(i) for i in range(n_out + 3)}


def test_swap_decode_puts_the_other_decode_on_the_same_registers():
    """A dumped kernel's inlined DECODE_PTX (as LLVM writes it: registers for $0 .. $5) becomes SM90_DECODE_PTX
    on those registers; the rest of the kernel is untouched."""
    from kernels_pallas.gpu_indexer_wgmma import SM90_DECODE_PTX
    from kernels_pallas.gpu_wgmma import DECODE_PTX
    regs = ["%r105", "%r107", "%r109", "%r111", "%r95", "%r96"]
    inline = re.sub(r"\$(\d)", lambda m: regs[int(m.group(1))], DECODE_PTX)
    kernel = f"ld.shared.u32 %r95, [%rd1];\n{inline}\nst.global.u32 [%rd2], %r105;\n{inline}\n"
    swapped, n = sass_mix.swap_decode(kernel, SM90_DECODE_PTX)
    want = re.sub(r"\$(\d)", lambda m: regs[int(m.group(1))], SM90_DECODE_PTX)
    assert n == 2 and swapped == f"ld.shared.u32 %r95, [%rd1];\n{want}\nst.global.u32 [%rd2], %r105;\n{want}\n"
