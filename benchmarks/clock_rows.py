"""The GPU's clocks and power beside each benchmark row: joins bench_kernels.py's rows (JSON lines with
"t", the Unix time each was logged) with an `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,
power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 100` log taken meanwhile
(gpu_record.sh writes both; nvidia-smi's timestamps are the machine's clock, UTC there).

    python benchmarks/clock_rows.py DECODE_LOG CLOCKS_CSV [--all]

First a line over all samples (SM clock minimum, median and maximum, the highest power draw, the
count of each throttle-reason mask). A row's window runs from the previous row's "t" to its own, so it
holds that row's timing (and its set-up). Then one line per MoE row that a table cites (SGLang's FP8 MoE, kq's picked lane instances, the
whole MoE) or, with --all, per row: SM clock median and minimum over the window, the highest power
draw, and the share of samples whose throttle reasons include the software power cap (bit 0x4)."""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics


def clocks(path: str) -> list[tuple[float, int, float, int]]:
    """(Unix time, SM MHz, watts, throttle reasons) per sample."""
    out = []
    for line in open(path).read().splitlines()[1:]:
        f = line.split(", ")
        if len(f) != 6 or not f[1][0].isdigit():
            continue
        ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
        power = float(f[3].split()[0]) if f[3][0].isdigit() else float("nan")
        out.append((ts.timestamp(), int(f[1].split()[0]), power, int(f[5], 16)))
    return out


def cited(row: dict) -> bool:
    kind = row.get("kind", "")
    return (kind == "sgl_fp8" or kind.startswith(("kq_lane_full", "marlin_"))
            or (kind.startswith("lanes_") and row.get("picked")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("clocks")
    ap.add_argument("--all", action="store_true", help="every row, not only those the tables cite")
    args = ap.parse_args()
    samples = clocks(args.clocks)
    if samples:
        sm = sorted(s[1] for s in samples)
        reasons = collections.Counter(f"{s[3]:#x}" for s in samples)
        print(f"clocks: {len(samples)} samples, SM MHz min/median/max {sm[0]}/{sm[len(sm) // 2]}/{sm[-1]}, "
              f"power W max {max(s[2] for s in samples):.1f}, throttle reasons {dict(reasons)}")
    rows = [json.loads(ln) for ln in open(args.rows) if ln.startswith("{") and '"t":' in ln]
    print("state | case | tokens | kind | us | SM MHz median (min) | W max | power-capped samples")
    prev = None
    for r in rows:
        window = [s for s in samples if prev is not None and prev < s[0] <= r["t"]]
        prev = r["t"]
        if not (args.all or cited(r)) or "us" not in r:
            continue
        if not window:
            print(f"{r.get('state', '-')} | {r.get('case')} | {r.get('M')} | {r['kind']} | {r['us']} | no samples")
            continue
        sm = [s[1] for s in window]
        capped = sum(1 for s in window if s[3] & 0x4) / len(window)
        print(f"{r.get('state', '-')} | {r.get('case')} | {r.get('M')} | {r['kind']} | {r['us']} | "
              f"{statistics.median(sm):.0f} ({min(sm)}) | "
              f"{max(s[2] for s in window):.0f} | {100 * capped:.0f} % of {len(window)}")


if __name__ == "__main__":
    main()
