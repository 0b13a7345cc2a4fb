"""Instructions per iteration of the W4A16 kernel's main loop in its sm_90 SASS, without a GPU.

    python benchmarks/sass_count.py [--variant NAME ...]

Triton compiles the kernel for sm_90 on this machine (its bundled ptxas and cuobjdump), with the
integer arguments given `tt.divisibility` 16 the way the JIT specialises them on a real launch
(the GLM-5.2 shapes are all multiples of 16). The main loop is the largest backward branch of the
SASS; the table gives its instruction count (one 128-input block per iteration), the registers and
the instruction mix. Variants: the decode gate+up tile (BLOCK_M 16, BLOCK_N 64, 4 warps, 3 stages)
before FOLD ("old": masks kept), with FOLD and the unmasked loads ("fold"), at group 32, and the
down projection's tile.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kq.kernels.gemm_kernel import w4a16_gemm_kernel  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SIG = ["a_ptr:*bf16", "stride_am:i32", "q_ptr:*i32", "stride_qe:i32", "stride_qk:i32", "s_ptr:*bf16",
       "stride_se:i32", "stride_sg:i32", "out_ptr:*bf16", "stride_os:i32", "stride_om:i32", "pairs_ptr:*i32",
       "blk_expert_ptr:*i32", "blk_start_ptr:*i32", "blk_count_ptr:*i32", "M:i32", "N:i32", "K:i32",
       "up_offset:i32", "kblocks_per_split:i32"]
BASE = dict(A_ROW_DIV=8, GROUP=128, DENSE=False, GATED=True, SPLIT_K=1, BLOCK_M=16, BLOCK_N=64, DEQ=2)
VARIANTS = {
    "old": {},
    "fold": dict(FOLD=True, EVEN_K=True, EVEN_N=True),
    "old_g32": dict(GROUP=32),
    "fold_g32": dict(GROUP=32, FOLD=True, EVEN_K=True, EVEN_N=True),
    "down_old": dict(GATED=False, BLOCK_N=128, A_ROW_DIV=1),
    "down_fold": dict(GATED=False, BLOCK_N=128, A_ROW_DIV=1, FOLD=True, EVEN_K=True, EVEN_N=True),
}


def compile_sass(const: dict, warps: int = 4, stages: int = 3) -> tuple[str, int]:
    sig = dict(s.split(":") for s in SIG)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    sig.update({k: "constexpr" for k in const})
    k = triton.compile(ASTSource(fn=w4a16_gemm_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    path = "/tmp/kq_sass_count.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                         check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", res).group(1))


def main_loop(sass: str) -> list[str]:
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA.*0x([0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if lo <= a <= hi]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, decode tile BLOCK_M 16, 4 warps, 3 stages")
    print("| variant | instructions per 128-input block | registers | top opcodes |")
    print("|---|---|---|---|")
    for name in args.variant or list(VARIANTS):
        sass, regs = compile_sass({**BASE, **VARIANTS[name]})
        body = main_loop(sass)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(body).most_common(6))
        print(f"| {name} | {len(body)} | {regs} | {top} |", flush=True)


if __name__ == "__main__":
    main()
