"""The instruction mix of a Hopper kernel's SASS, by opcode class: what the decode-speed docs count.

    python -m experiments.sass_mix KERNEL.ptx [...]          # PTX that Mosaic GPU dumped (MOSAIC_GPU_DUMP_PTX=1
                                                             # MOSAIC_GPU_DUMP_TO=DIR on the GPU machine)
    python -m experiments.sass_mix --decode fp4 fp4-sm90 fp4-previous fp8 fp8-previous   # one decode call alone
    python -m experiments.sass_mix KERNEL.ptx --swap-decode fp4-sm90   # also with its decode blocks swapped

ptxas (-arch=sm_90a -O3, as the machine's JAX does) builds the cubin and nvdisasm lists it; both come with
CUDA (nvdisasm also as PyPI's `nvidia-cuda-nvdisasm`: pass --nvdisasm or put it on PATH). `--decode` wraps one
decode PTX (`gpu_wgmma.DECODE_PTX` / `FP8_DECODE_PTX`, `gpu_indexer_wgmma.SM90_DECODE_PTX`, or the eighteenth session's forms kept for A/B in
`experiments.device_runs.issue21_alu_decode`) in a kernel that loads a word and stores its outputs. Classes:
ALU = the half-rate integer / logic / compare / select / min-max opcodes (PIPES), IMAD = integer multiplies,
FP = float and packed-half arithmetic, MIO = shared / global memory, shuffles, barriers; the rest "other".
The counts are static (a loop body unrolled n times counts n times), not issued instructions.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

PIPES = {
    "ALU": {"LOP3", "LOP", "SHF", "PRMT", "IMNMX", "VIMNMX", "FMNMX", "ISETP", "FSETP", "SEL", "FSEL", "LEA", "IADD3",
            "MOV", "PLOP3", "SGXT", "BMSK", "P2R", "R2P", "CS2R"},
    "IMAD": {"IMAD", "IMUL"},
    "FP": {"FFMA", "FADD", "FMUL", "HFMA2", "HMUL2", "HADD2"},
    "MIO": {"LDS", "STS", "LDSM", "LDG", "STG", "LD", "ST", "SHFL", "BAR", "SYNCS", "UTMALDG"},
}
_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def classify(listing: str) -> tuple[collections.Counter, collections.Counter]:
    """(count per opcode, count per class) of an `nvdisasm -c` listing."""
    ops = collections.Counter(m.group(1) for line in listing.splitlines() if (m := _OPCODE.match(line)))
    classes = collections.Counter()
    for op, n in ops.items():
        classes[next((c for c, names in PIPES.items() if op in names), "other")] += n
    return ops, classes


def decode_kernel(name: str, ptx: str, n_out: int) -> str:
    """A PTX entry `name` that applies one decode call (operands: $0 .. n_out - 1 its outputs, then the packed
    word, then the scale word, as the kernels pass them) to a loaded word and stores its outputs. The wrapper
    adds 2 IMAD.WIDE (addresses), LDG, STG and a few LDC / S2R to the count."""
    body = ptx
    for i in range(n_out + 1, -1, -1):  # $i -> %r{i}: outputs, word, scale
        body = body.replace(f"${i}", f"%r{i}")
    outs = ", ".join(f"%r{i}" for i in range(n_out))
    return f""".visible .entry {name}(.param .u64 inp, .param .u64 out, .param .u32 mult)
{{
  .reg .b32 %r<{n_out + 4}>; .reg .b64 %rd<6>;
  ld.param.u64 %rd1, [inp]; ld.param.u64 %rd2, [out]; ld.param.u32 %r{n_out + 1}, [mult];
  mov.u32 %r{n_out + 2}, %tid.x; mul.wide.u32 %rd3, %r{n_out + 2}, 4; add.s64 %rd4, %rd1, %rd3;
  ld.global.u32 %r{n_out}, [%rd4];
  {body}
  mul.wide.u32 %rd3, %r{n_out + 2}, {4 * n_out}; add.s64 %rd5, %rd2, %rd3;
  st.global.v{n_out}.u32 [%rd5], {{{outs}}};
  ret;
}}
"""


def decodes() -> dict[str, tuple[str, int]]:
    """name -> (decode PTX, outputs per word)."""
    from experiments.device_runs.issue21_alu_decode import PREVIOUS_FP8_PTX, PREVIOUS_PTX
    from kernels_pallas.gpu_indexer_wgmma import SM90_DECODE_PTX
    from kernels_pallas.gpu_wgmma import DECODE_PTX, FP8_DECODE_PTX
    return {"fp4": (DECODE_PTX, 4), "fp4-sm90": (SM90_DECODE_PTX, 4), "fp4-previous": (PREVIOUS_PTX, 4),
            "fp8": (FP8_DECODE_PTX, 2), "fp8-previous": (PREVIOUS_FP8_PTX, 2)}


_DECODE_BLOCK = re.compile(r"\{ \.reg \.b32 v, l, t, z;[^}]*\}")  # DECODE_PTX inlined in a dumped kernel


def swap_decode(kernel_ptx: str, ptx: str) -> tuple[str, int]:
    """(a dumped kernel's PTX with each inlined DECODE_PTX block replaced by `ptx` on the same registers, the
    number of blocks replaced): the kernel as a decode of the same operands would compile it."""
    from kernels_pallas.gpu_wgmma import DECODE_PTX
    n_out = DECODE_PTX.count("fma.rn.bf16x2")

    def swap(m):
        block = m.group(0)
        word = re.search(r"shr\.b32 v, (%r\d+), 8;", block).group(1)
        fmas = re.findall(r"fma\.rn\.bf16x2 (%r\d+), t, (%r\d+), z;", block)
        regs = [out for out, _ in fmas] + [word, fmas[0][1]]
        assert len(fmas) == n_out, block
        return re.sub(r"\$(\d)", lambda r: regs[int(r.group(1))], ptx)

    return _DECODE_BLOCK.subn(swap, kernel_ptx)


def sass(ptx_path: str, nvdisasm: str, tmp: str) -> tuple[str, str]:
    """(ptxas -v report, nvdisasm -c listing) of a PTX file for sm_90a."""
    cubin = os.path.join(tmp, os.path.basename(ptx_path) + ".cubin")
    rep = subprocess.run(["ptxas", "-arch=sm_90a", "-O3", "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
    if rep.returncode:
        raise SystemExit(f"ptxas failed on {ptx_path}:\n{rep.stderr[-3000:]}")
    return rep.stderr, subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ptx", nargs="*", help="PTX files (a dumped kernel)")
    parser.add_argument("--decode", nargs="*", default=[], choices=["fp4", "fp4-sm90", "fp4-previous", "fp8", "fp8-previous"],
                        help="decode PTX strings, each alone in a small kernel")
    parser.add_argument("--swap-decode", choices=["fp4-sm90"], help="also count each PTX file with its inlined "
                        "DECODE_PTX blocks replaced by this decode (same registers)")
    parser.add_argument("--nvdisasm", default=os.environ.get("NVDISASM") or shutil.which("nvdisasm"),
                        help="path of nvdisasm (default: $NVDISASM, then PATH)")
    args = parser.parse_args(argv)
    if not args.ptx and not args.decode:
        parser.error("give PTX files or --decode names")
    if not shutil.which("ptxas"):
        raise SystemExit("ptxas not found: install the CUDA toolkit (or put its bin/ on PATH)")
    if not args.nvdisasm:
        raise SystemExit("nvdisasm not found: `pip download --no-deps nvidia-cuda-nvdisasm`, unzip the wheel, and "
                         "pass --nvdisasm .../nvidia/cu13/bin/nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        paths = list(args.ptx)
        for path in args.ptx if args.swap_decode else ():
            with open(path) as f:
                swapped, n = swap_decode(f.read(), decodes()[args.swap_decode][0])
            if not n:
                raise SystemExit(f"{path} holds no inlined DECODE_PTX block to swap")
            paths.append(os.path.join(tmp, f"{os.path.basename(path)}.{args.swap_decode}.ptx"))
            with open(paths[-1], "w") as f:
                f.write(swapped)
            print(f"{os.path.basename(paths[-1])}: {n} decode blocks swapped")
        for name in args.decode:
            ptx, n_out = decodes()[name]
            path = os.path.join(tmp, f"decode_{name}.ptx")
            with open(path, "w") as f:
                f.write(".version 8.0\n.target sm_90a\n.address_size 64\n" + decode_kernel(name.replace("-", "_"), ptx,
                                                                                          n_out))
            paths.append(path)
        for path in paths:
            report, listing = sass(path, args.nvdisasm, tmp)
            ops, classes = classify(listing)
            regs = re.findall(r"Used (\d+) registers", report)
            print(f"{os.path.basename(path)}: {regs[-1] if regs else '?'} registers, "
                  f"{'spills' if re.search(r'[1-9]\d* bytes spill', report) else 'no spills'}; "
                  + ", ".join(f"{c} {classes[c]}" for c in (*PIPES, "other")) + f"; total {sum(ops.values())}")
            print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(24)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
