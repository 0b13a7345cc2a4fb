"""What bounds the decode MoE rows that miss #3's targets: counted bytes against the measured read ceiling,
the tensor work against the measured matrix rate, and the lane kernel's own time without its memory
traffic (the leave-one-out rows of benchmarks/lanes_ab.py's noscale / noweight / nomem variants).

    python benchmarks/bound_table.py benchmarks/results/h200/kernels_s12_decode_a1f86d7_call4.jsonl \
        benchmarks/results/h200/lanes_ab_s11_call5_probe_4cb0706.jsonl \
        benchmarks/results/h200/lanes_ab_s12_call6_probe_b19727f.jsonl

Per case and group (gate+up, top-8), from the decode table (bench_kernels.py --lanes rows, one call):
- bytes: the weights and scales of the experts routed to (the GBps column times the time);
- floor: bytes over the call's read-bandwidth probe (the fastest read of a large buffer, env row);
- kq: the instance cuda_lanes.pick chooses now, from the same call's rows; FP8: SGLang's FP8 MoE, same call;
- target: FP8's time over 1.7 (group 128) or 1.6 (group 32), and both over the floor;
- TFLOP/s: the mma work the kernel executes (8 rows per routed expert: an 8-row block per expert at these
  sizes, 2 * 8 * N * K each) over kq's time, against the same call's cuBLAS BF16 GEMM at 4096 rows;
- nomem / noweight / noscale: the picked instance's time without weight and scale traffic, without weight
  copies, without scale loads (the probe files after the decode table, best of their rounds, of the instance
  today's pick chooses), over the floor; "n/a" where no probe ran that case, "n/a (probed ...)" where one ran
  only another instance (each probe row names its "instance"; for older rows a <probe>.instances.json beside
  the file does). The nomem time is the
  kernel's instruction stream with its activation loads alone: where it comes close to the floor, the two
  overlap badly and the kernel lands well above the floor.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

from kernel_table import load, moe_cases, repicked

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

TARGET = {128: 1.7, 32: 1.6}


def main(paths: list[str]) -> None:
    from bench_kernels import MOE_SHAPES
    decode, *probe_files = paths
    rows, env = load([decode])
    probes = defaultdict(lambda: float("inf"))      # (case, instance, variant): best time
    probed = defaultdict(set)                      # case: the instances probed
    for probe in probe_files:
        side = os.path.splitext(probe)[0] + ".instances.json"
        named = json.load(open(side)) if os.path.exists(side) else {}
        for line in open(probe):
            r = json.loads(line)
            if r["stage"] == "gate_up":
                key = (r["case"], r.get("instance") or named[r["case"]], r["variant"])
                probes[key] = min(probes[key], r["us"])
                probed[r["case"]].add(key[1])
    read = env["read_TBps"]
    cublas = rows.get(("dense_12288x6144", 4096, "cublas_bf16"))
    peak = cublas["TFLOPs"] if cublas else float("nan")
    print(f"{env.get('gpu')}, {env.get('date')}: read probe {read} TB/s, cuBLAS BF16 12288x6144x4096 "
          f"{peak:.0f} TFLOP/s\n")
    print("| case | tokens x8 | group | bytes GB | floor us | kq us (x floor) [instance] | FP8 us | target us (x floor) | "
          "mma TFLOP/s | nomem x floor | noweight x floor | noscale x floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in moe_cases(rows):
        _, h, i = MOE_SHAPES[case]
        for m in (16, 64):
            for g in (128, 32):
                k = repicked(rows, case, m, f"lanes_g{g}_")
                fp8 = rows.get((case, m, "sgl_fp8"))
                if k is None or fp8 is None:
                    continue
                gb = k["GBps"] * k["us"] / 1e6
                floor = gb / read * 1e3
                target = fp8["us"] / TARGET[g]
                tflops = 2 * 8 * 2 * i * h * k["experts_touched"] / k["us"] / 1e6
                name = f"{case}:{m}:g{g}"
                inst = k["kind"].rsplit("_", 1)[1]

                def probe_x(v):
                    us = probes.get((name, inst, v))
                    if us is None and probed[name]:
                        return f"n/a (probed {', '.join(sorted(probed[name]))})"
                    return f"{us / floor:.2f} ({us:.1f})" if us else "n/a"
                print(f"| {case} | {m} | {g} | {gb:.3f} | {floor:.1f} | {k['us']:.1f} ({k['us'] / floor:.2f}) [{inst}] | "
                      f"{fp8['us']:.1f} | {target:.1f} ({target / floor:.2f}) | {tflops:.0f} | {probe_x('nomem')} | "
                      f"{probe_x('noweight')} | {probe_x('noscale')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
