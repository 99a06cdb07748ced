#!/usr/bin/env bash
# Forty-sixth session: does ptxas (sm_90a) fold `abs.f32` into the FFMA that uses it? Three PTX kernels of 64
# loads, each load followed by `abs + fma`, `fma` alone, or `abs + add + fma`; the instruction count of each
# cubin is its .text size / 16 bytes. Needs ptxas (CUDA 12+) and binutils' readelf; no GPU.
#   bash docs/bench_decode/session46_ptxas_abs_fma.sh   ->  absfma 144 / fma 144 / addabs 208 (ptxas 13.0)
set -euo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
declare -A body=([absfma]='abs.f32 %f4, %f1; fma.rn.f32 %f3, %f4, %f2, %f3;'
                 [fma]='fma.rn.f32 %f3, %f1, %f2, %f3;'
                 [addabs]='abs.f32 %f4, %f1; add.f32 %f5, %f1, %f4; fma.rn.f32 %f3, %f5, %f2, %f3;')
for v in absfma fma addabs; do
    {
        printf '.version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k(.param .u64 p){\n'
        printf ' .reg .f32 %%f<8>; .reg .u64 %%rd<4>;\n ld.param.u64 %%rd1, [p];\n'
        printf ' ld.global.f32 %%f2, [%%rd1+4]; ld.global.f32 %%f3, [%%rd1+8];\n'
        for i in $(seq 1 64); do printf ' ld.global.f32 %%f1, [%%rd1+%d]; %s\n' $((i * 4 + 12)) "${body[$v]}"; done
        printf ' st.global.f32 [%%rd1+24], %%f3; ret; }\n'
    } > "$dir/$v.ptx"
    ptxas -arch=sm_90a -O3 "$dir/$v.ptx" -o "$dir/$v.cubin"
    size=$(readelf -S -W "$dir/$v.cubin" 2>/dev/null | awk '$2 == ".text.k" {print $6}')
    echo "$v $((16#$size / 16)) instructions"
done
