"""Markdown tables of record from a bench_kernels.py --lanes run (JSON lines) and its Marlin rows.

    python benchmarks/kernel_table.py benchmarks/results/h200/kernels_s5_0242e99.jsonl \
        benchmarks/results/h200/kernels_s5_marlin_0242e99.json

kq's decode gate+up is the CUDA lane kernel's instance that cuda_lanes.pick chooses (the row marked
"picked"), the whole MoE the public kq.kernels.fused_moe_w4a16 on the lane layout; every ratio is
peer time / kq time, peers from the same call (Marlin on the machine's other GPU, same call).
"""
from __future__ import annotations

import json
import sys


def load(paths: list[str]) -> tuple[dict, dict]:
    rows, env = [], {}
    for path in paths:
        text = open(path).read()
        if path.endswith(".json"):
            doc = json.loads(text)
            rows += doc["rows"]
            env = env or doc["env"]
            continue
        for line in text.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                if "case" in r:
                    rows.append(r)
                else:
                    env = env or r
    return {(r["case"], r["M"], r["kind"]): r for r in rows if "us" in r and "_sweep" not in r["kind"]}, env


def picked(by: dict, case: str, m: int, prefix: str):
    for (c, mm, kind), r in by.items():
        if c == case and mm == m and kind.startswith(prefix) and r.get("picked"):
            return r
    return None


def main(paths: list[str]) -> None:
    by, env = load(paths)
    print(f"{env.get('gpu')}, driver {env.get('driver', '?').split()[0]}, torch {env.get('torch')}, "
          f"triton {env.get('triton')}, {env.get('date')}; read bandwidth probe {env.get('read_TBps')} TB/s\n")
    print("| case | tokens x8 | group | kq gate+up us (TB/s) [instance] | vs SGLang FP8 | vs Marlin | "
          "vs SGLang BF16 | vs SGLang INT4 | vs kq Triton | kq whole MoE us | vs kq Triton whole |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in ("glm52", "kimi_tp8"):
        for m in (1, 16, 64):
            for g in (128, 32):
                k = picked(by, case, m, f"lanes_g{g}_")
                if k is None:
                    continue

                def ratio(kind, base=k):
                    p = by.get((case, m, kind))
                    return f"{p['us'] / base['us']:.2f}x ({p['us']:.1f})" if p else "n/a"
                full = by.get((case, m, f"kq_lane_full_g{g}"))
                inst = k["kind"].split("_")[-1]
                print(f"| {case} | {m} | {g} | {k['us']:.1f} ({k['GBps'] / 1000:.2f}) [{inst}] | {ratio('sgl_fp8')} | "
                      f"{ratio(f'marlin_g{g}')} | {ratio('sgl_bf16')} | {ratio(f'sgl_int4_g{g}')} | "
                      f"{ratio(f'kq_g{g}')} | {full['us']:.1f} | {ratio(f'kq_full_g{g}', full)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
