"""Per-kernel GPU time of kq's W4A8 MoE and SGLang's FP8 MoE (as w4a8_bench.py builds them), torch.profiler:

    python benchmarks/w4a8_profile.py [--tokens 16384] [--shape glm52]

Five calls of each after three warm-up calls; prints each kernel's µs per call (and launches per call), the
largest first. One routing, no CUDA graph: a breakdown of where a step's time goes, not a table of record.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import w4a8_bench as wb  # noqa: E402

from kq.kernels import w4a8  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shape", default="glm52", choices=sorted(wb.SHAPES))
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = wb.SHAPES[a.shape]
    t, k = a.tokens, 8
    pp = wb.lane_moe(e, h, i, gen)
    sc = w4a8.block_scales(pp)
    ti = wb.bk.routings(e, t, k, 1)[0]
    tw = torch.rand(t, k, device="cuda", generator=gen)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    sgl, _ = wb.sgl_fp8_fns(e, h, i, x, [ti], [tw], gen, False)
    print(f"commit {os.environ.get('KQ_COMMIT', '?')}, {torch.cuda.get_device_name()}, {a.shape} {t} tokens x {k}, "
          f"kq configs {w4a8.configs(t * k, e)}")
    for name, fn in (("kq", lambda: w4a8.fused_moe_w4a8(x, pp, tw, ti, scales=sc)), ("sgl", sgl[0])):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = sorted(((ev.device_time_total / 5, ev.count // 5, ev.key[:90]) for ev in prof.key_averages()
                       if ev.device_time_total > 0), reverse=True)
        print(f"== {name}: {sum(r[0] for r in rows):.0f} us a call")
        for us, n, key in rows[:12]:
            print(f"  {us:9.1f} us  x{n}  {key}")


if __name__ == "__main__":
    main()
