"""swap_kernel's default config at 48 and 64 rows on 12288x6144 (group 128, tiles layout), for Nsight
Compute: what holds it at about 290 TFLOP/s and 1.2 TB/s. Run under ncu on the lent H200:

    ncu --clock-control none -k regex:w4a16_swap_kernel --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section LaunchStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python3 benchmarks/ncu_swap.py

Each M runs twice (the first launch compiles); the launches come in the order printed on stdout.
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_kernels import DEV, random_linears  # noqa: E402

from kq.kernels import triton_ops as kops  # noqa: E402

N, K, GROUP = 12288, 6144, 128


def main() -> None:
    torch.manual_seed(0)
    ws, _ = random_linears(N, K, GROUP)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (48, 64):
        x = torch.randn(m, K, device=DEV, dtype=torch.bfloat16)
        cfg = kops.dense_config(m, N, K, sms, swap=kops.swap_serves(x.device, ws[0]))
        for _ in range(2):
            kops.w4a16_linear(x, ws[0], config=cfg)
        torch.cuda.synchronize()
        print(f"M = {m}: 2 launches of {cfg}", flush=True)


if __name__ == "__main__":
    main()
