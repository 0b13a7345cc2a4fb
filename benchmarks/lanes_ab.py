"""A/B of compile-time variants of the CUDA lane kernel (macros in kq/kernels/cuda/moe_lanes.cuh) on
the decode cases that miss #3's targets, in one process on the lent H200.

    python3 benchmarks/lanes_ab.py --variants base [--rounds 2]

Each variant is the extension built under its own name with its -D flags (the builds run in parallel
subprocesses first); the same picked instance (cuda_lanes.pick / pick_dense) is timed for every
variant on the same weights and routings (CUDA graph over 12 routings, median of 15, bench_kernels'
graph_us), in rounds whose variant order rotates, so drift shows. Every variant's outputs are compared
bit for bit with the base build's first (the macros change where bytes are fetched, not the maths).
One JSON row per timing on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_kernels import DEV, MOE_SHAPES, graph_us, random_lane_linear, random_lane_moe, routings  # noqa: E402

from kq.kernels import cuda_lanes  # noqa: E402
from kq.kernels import triton_ops as kops  # noqa: E402

# -D flags per variant (the seventh session A/B'd scale and activation prefetches, evict-first weights and
# the activations through the ring here, the eighth group 32 at 4 CTAs, the eleventh CTAs of 1 and 2 warps:
# benchmarks/results/kernels.md; the activations through the ring became the XSM instances)
DEFINES = {
    "base": [],
    # leave-one-out probes (moe_lanes.cuh KQ_LANES_PROBE; their outputs differ from base by design): no scale
    # loads, no weight copies, neither
    "noscale": ["-DKQ_LANES_PROBE=1"],
    "noweight": ["-DKQ_LANES_PROBE=2"],
    "nomem": ["-DKQ_LANES_PROBE=3"],
}
MOE_CASES = [("glm52", 1, 128), ("glm52", 16, 128), ("glm52", 16, 32), ("glm52", 64, 32),
             ("kimi_tp8", 16, 128), ("kimi_tp8", 16, 32), ("kimi_tp8", 64, 128), ("kimi_tp8", 64, 32),
             ("glm52", 64, 128), ("glm52", 1, 32), ("kimi_tp8", 1, 32), ("kimi_tp8", 1, 128),
             ("glm47", 1, 128), ("glm47", 1, 32),
             ("kimi", 16, 128), ("kimi", 16, 32), ("kimi", 64, 128), ("kimi", 64, 32),
             ("glm47", 16, 128), ("glm47", 16, 32), ("glm47", 64, 128), ("glm47", 64, 32)]
DENSE_MS = (1, 2, 8)
DENSE_SHAPES = ((12288, 6144), (4096, 7168))     # #3's dense shape; Kimi K2's gate+up as a linear


def build(variant: str):
    return cuda_lanes.build(f"kq_moe_lanes_ab_{variant}", tuple(DEFINES[variant]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--all-instances", action="store_true",
                    help="time every instance of each stage, not only the picked one (pick's rows)")
    ap.add_argument("--cases", default="", help="only the cases whose name contains one of these (comma list)")
    ap.add_argument("--dense-m", default=",".join(map(str, DENSE_MS)), help="rows of the dense cases")
    ap.add_argument("--stages", default="gate_up,down", help="the MoE stages to time (comma list)")
    ap.add_argument("--build-one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_one:
        build(args.build_one)
        return
    names = args.variants.split(",")
    for v in names:
        if v not in DEFINES:
            ap.error(f"unknown variant {v!r}; known: {', '.join(DEFINES)}")
    procs = [subprocess.Popen([sys.executable, __file__, "--build-one", v]) for v in names]
    if any(p.wait() for p in procs):
        sys.exit("a variant's build failed")
    mods = {v: build(v) for v in names}
    torch.manual_seed(0)
    cases = []
    wanted = [f for f in args.cases.split(",") if f]

    def keep(case: str) -> bool:     # asked before a case's weights are made: a full Kimi K2 case takes 8-9 GB
        return not wanted or any(f in case for f in wanted)
    for name, m, group in MOE_CASES:
        if not keep(f"{name}:{m}:g{group}"):
            continue
        e, h, i = MOE_SHAPES[name]
        lm = random_lane_moe(e, h, i, group)
        rts = [kops.moe_align(ids, e, 8) for ids in routings(e, m, 8, 12)]
        xs = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        acts = [torch.empty(m * 8, i, device=DEV, dtype=torch.bfloat16) for _ in rts]
        ys = [torch.empty(m * 8, h, device=DEV, dtype=torch.bfloat16) for _ in rts]
        for stage, insts in (("gate_up", cuda_lanes.stage_variants(True, group)),
                             ("down", cuda_lanes.stage_variants(False, group))):
            if stage not in args.stages.split(","):
                continue
            for inst in insts if args.all_instances else [None]:
                if stage == "gate_up":
                    fns = [lambda rt=rt, o=o, lm=lm, xs=xs, inst=inst: cuda_lanes.moe_gate_up(xs, lm, rt, 8, inst, out=o)
                           for rt, o in zip(rts, acts)]
                else:
                    fns = [lambda rt=rt, a=a, o=o, lm=lm, inst=inst: cuda_lanes.moe_down(a, lm, rt, inst, out=o)
                           for rt, a, o in zip(rts, acts, ys)]
                # the instance timed, by name (what pick chose at this commit when none is given)
                gated = stage == "gate_up"
                which = inst or cuda_lanes.pick_stage(m * 8, e, h, i, gated, group)
                cases.append((f"{name}:{m}:g{group}", stage + (f":{cuda_lanes.variant_name(inst)}" if inst else ""),
                              fns, acts if gated else ys, cuda_lanes.variant_name(which)))
    for n, k in DENSE_SHAPES:
        ms = [m for m in (int(v) for v in args.dense_m.split(",")) if keep(f"dense_{n}x{k}:{m}")]
        w = random_lane_linear(n, k, 128) if ms else None
        for m in ms:
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            for inst in cuda_lanes.DENSE_VARIANTS if args.all_instances else [None]:
                which = inst or cuda_lanes.pick_dense(m, n // 8, -(-k // 128))
                cases.append((f"dense_{n}x{k}:{m}", "linear" + (f":{cuda_lanes.dense_variant_name(inst)}" if inst else ""),
                              [lambda a=a, y=y, w=w, inst=inst: cuda_lanes.linear(a, w, inst, out=y)], [y],
                              cuda_lanes.dense_variant_name(which)))
    ref = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for case, stage, fns, outs, inst in cases:
            for v in order:
                cuda_lanes._ext = lambda v=v: mods[v]       # the variant serves cuda_lanes' calls
                for o in outs:
                    o.fill_(float("nan"))
                for fn in fns:
                    fn()
                torch.cuda.synchronize()
                got = [o.clone() for o in outs]
                same = None
                if (case, stage) not in ref and v == "base":
                    ref[(case, stage)] = got
                elif (case, stage) in ref:
                    same = all(torch.equal(g, h) for g, h in zip(got, ref[(case, stage)]))
                us = graph_us(fns)
                print(json.dumps({"round": r, "case": case, "stage": stage, "variant": v, "instance": inst,
                                  "us": round(us, 2), "same_as_base": same}), flush=True)


if __name__ == "__main__":
    main()
