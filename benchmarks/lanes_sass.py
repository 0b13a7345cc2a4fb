"""Registers, spills and SASS instruction counts of CUDA lane-kernel instances (moe_lanes.cuh), without a
GPU: nvcc compiles the named instances for sm_90a, Triton's bundled cuobjdump disassembles them.

    python benchmarks/lanes_sass.py [--group 32,128] [--nt 1] [--gated 1] [--fold 1] [--ksplit 1] [--xsm 0]
    python benchmarks/lanes_sass.py --dense --xpre --ksplit 4 --nt 2

One row per instance: the whole function's instruction count without NOPs (its main loop is unrolled
STAGES times), the instructions of each block of the unrolled loop (from one cp.async wait to the next),
registers and spilled bytes as ptxas reports them, and the most frequent opcodes. Needs nvcc on PATH.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "kq", "kernels", "cuda")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", default="32,128")
    ap.add_argument("--nt", type=int, default=1)
    ap.add_argument("--gated", type=int, default=1)
    ap.add_argument("--fold", type=int, default=1, help="0, 1 or 2 (SCALE_A: the scales in the weight operand)")
    ap.add_argument("--ksplit", type=int, default=1)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--xsm", type=int, default=0, help="the activations through the ring (XSM instances)")
    ap.add_argument("--dense", action="store_true", help="a DENSE instance (one matrix; not gated, FOLD on)")
    ap.add_argument("--xpre", action="store_true", help="with --dense: the activations preloaded (XPRE)")
    args = ap.parse_args()
    b = lambda v: "true" if v else "false"   # noqa: E731
    gated, fold = (False, True) if args.dense else (args.gated, args.fold)
    insts = [f"{args.nt}, {b(gated)}, {g}, 4, {args.ksplit}, {args.stages}, {2 if fold == 2 else b(fold)}, {b(args.xsm)}, true, "
             f"{b(args.dense)}, {b(args.dense and args.xpre)}" for g in args.group.split(",")]
    with tempfile.TemporaryDirectory() as d:
        cu = os.path.join(d, "inst.cu")
        with open(cu, "w") as f:
            f.write('#include "moe_lanes.cuh"\n')
            f.writelines(f"template __global__ void kq_lanes::moe_lanes_kernel<{i}>(kq_lanes::Params);\n" for i in insts)
        cubin = os.path.join(d, "inst.cubin")
        r = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-cubin", "-Xptxas", "-v",
                            f"-I{SRC}", cu, "-o", cubin], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-2000:])
        info = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers",
                          r.stderr, re.S)
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    funcs, blocks = {}, {}
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split()[0]
        ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", chunk, re.M)
        funcs[name] = collections.Counter(o for o in ops if o != "NOP")      # NOPs: alignment padding
        # the unrolled main loop: one cp.async wait (DEPBAR.LE) per 128-input block, so the instructions
        # from one wait to the next are one block's (the last block's run on to the loop's end)
        waits = [i for i, o in enumerate(ops) if o == "DEPBAR"]
        blocks[name] = [sum(o != "NOP" for o in ops[a:b]) for a, b in zip(waits, waits[1:])]
    for name, spill, regs in info:
        ops = funcs.get(name, collections.Counter())
        top = ", ".join(f"{o} {n}" for o, n in ops.most_common(6))
        per = f", per block {'/'.join(map(str, blocks.get(name, [])))}" if blocks.get(name) else ""
        print(f"{name}: {sum(ops.values())} instructions{per}, {regs} registers, {spill} bytes spilled; {top}")


if __name__ == "__main__":
    main()
