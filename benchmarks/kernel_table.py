r"""Markdown tables of record from bench_kernels.py --lanes rows (JSON lines, or its kernels_bench*.json).

    python benchmarks/kernel_table.py [--repick] DECODE_LOG [MORE_ROWS ...]

One table per GPU state the rows were timed in (burst, sustained; rows without a state, from runs
before states were recorded, print as "state not recorded"). kq's gate+up is the CUDA lane kernel's
instance that cuda_lanes.pick chooses (the row marked "picked"), the whole MoE the public
kq.kernels.fused_moe_w4a16 on the lane layout; every ratio is peer time / kq time in the same state,
"n/a" where the run did not time that peer. Then the dense rows, if the run has them.
"""
from __future__ import annotations

import json
import sys


UNSTATED = "state not recorded"


def read_rows(paths: list[str]) -> tuple[list[dict], dict]:
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
    return rows, env


def states(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r.get("state", UNSTATED) for r in rows if "us" in r))


def load(paths: list[str], state: str | None = None) -> tuple[dict, dict]:
    """(case, M, kind) -> row of one state (default: the first the rows hold), and the run's env row."""
    rows, env = read_rows(paths)
    state = state or (states(rows) or [UNSTATED])[0]
    return {(r["case"], r["M"], r["kind"]): r for r in rows
            if "us" in r and "_sweep" not in r["kind"] and r.get("state", UNSTATED) == state}, env


def moe_cases(by: dict) -> list[str]:
    """The MoE cases with lane-kernel rows, in the order the run timed them."""
    return list(dict.fromkeys(c for (c, _, kind) in by if kind.startswith("lanes_g")))


REPICK = False     # --repick: the instance today's cuda_lanes.pick chooses, not the one the run marked


def picked(by: dict, case: str, m: int, prefix: str):
    if REPICK:
        return repicked(by, case, m, prefix)
    for (c, mm, kind), r in by.items():
        if c == case and mm == m and kind.startswith(prefix) and r.get("picked"):
            return r
    return None


def repicked(by: dict, case: str, m: int, prefix: str):
    """The same run's row of the instance kq.kernels.cuda_lanes.pick chooses now (gate+up, top-8; the
    dense rows likewise take pick_dense's instance up to 64 rows)."""
    from bench_kernels import MOE_SHAPES
    from kq.kernels.cuda_lanes import pick_stage, variant_name
    e, h, i = MOE_SHAPES[case]
    group = int(prefix.rstrip("_").rsplit("_g", 1)[1])
    return by.get((case, m, prefix + variant_name(pick_stage(m * 8, e, h, i, True, group))))


def main(paths: list[str]) -> None:
    rows, env = read_rows(paths)
    print(f"{env.get('gpu')}, driver {env.get('driver', '?').split()[0]}, torch {env.get('torch')}, "
          f"triton {env.get('triton')}, {env.get('date')}; read bandwidth probe {env.get('read_TBps')} TB/s")
    for state in states(rows):
        by, _ = load(paths, state)
        print(f"\n{state}" + (f" (idle {env['states']['idle_s']} s before each timing)" if state == "burst" and "states" in env
                               else f" (after {env['states']['heat_s']} s of back-to-back replay)" if state == "sustained"
                               and "states" in env else "") + "\n")
        table(by, env.get("read_TBps"))
    whole_moe(paths)


def whole_moe(paths: list[str]) -> None:
    """One token's whole MoE per case and group, us burst / sustained: kq (kq_lane_full), kq's four-launch
    path (kq_lane_full4) and SGLang's whole fused_marlin_moe (marlin_full), printed where a run has them."""
    by = {s: load(paths, s)[0] for s in states(read_rows(paths)[0])}
    first = next(iter(by.values()), {})
    out = []
    for case in dict.fromkeys(c for (c, m, k) in first if m == 1 and k.startswith("kq_lane_full4_g")):
        for group in dict.fromkeys(k.rsplit("_g", 1)[1] for (c, m, k) in first if c == case and k.startswith("kq_lane_full4_g")):
            kq, four, marlin = ([by[st].get((case, 1, f"{kind}_g{group}"), {}).get("us") for st in by]
                                for kind in ("kq_lane_full", "kq_lane_full4", "marlin_full"))
            if None in kq + four + marlin:
                continue
            out.append([case, group, " / ".join(f"{v:.2f}" for v in kq), " / ".join(f"{v:.2f}" for v in four),
                        " / ".join(f"{v:.2f}" for v in marlin),
                        " / ".join(f"{m / k:.2f}x" for m, k in zip(marlin, kq))])
    if out:
        print(f"\none token, whole MoE, us {' / '.join(by)}\n")
        emit(["case", "group", "kq", "kq 4 launches", "Marlin whole", "Marlin / kq"], out)


def emit(head: list[str], rows: list[list[str]]) -> None:
    """A markdown table without the columns that are n/a in every row (peers the run did not time)."""
    keep = [j for j in range(len(head)) if any(r[j] != "n/a" for r in rows)]
    print("| " + " | ".join(head[j] for j in keep) + " |")
    print("|" + "---|" * len(keep))
    for r in rows:
        print("| " + " | ".join(r[j] for j in keep) + " |")


def table(by: dict, floor_tbps: float | None = None) -> None:
    """MoE rows; "of floor": kq's gate+up bytes/s over the run's own read-bandwidth probe (the byte
    floor: a row at 95 % or more is done)."""
    head = ["case", "tokens x8", "group", "kq gate+up us (TB/s) [instance]", "of floor", "vs SGLang FP8", "vs Marlin",
            "vs SGLang BF16", "vs SGLang INT4", "vs kq Triton", "kq whole MoE us", "vs Marlin whole",
            "vs kq Triton whole"]
    rows = []
    for case in moe_cases(by):
        for m in sorted({mm for (c, mm, _) in by if c == case}):
            for g in (128, 32):
                k = picked(by, case, m, f"lanes_g{g}_")
                if k is None:
                    continue

                def ratio(kind, base=k):
                    p = by.get((case, m, kind))
                    return f"{p['us'] / base['us']:.2f}x ({p['us']:.1f})" if p else "n/a"
                full = by.get((case, m, f"kq_lane_full_g{g}"))
                inst = k["kind"].split("_")[-1]
                rows.append([case, str(m), str(g), f"{k['us']:.1f} ({k['GBps'] / 1000:.2f}) [{inst}]",
                             f"{k['GBps'] / 1000 / floor_tbps:.0%}" if floor_tbps else "n/a",
                             ratio("sgl_fp8"), ratio(f"marlin_g{g}"), ratio("sgl_bf16"), ratio(f"sgl_int4_g{g}"),
                             ratio(f"kq_g{g}"), "%.1f" % full["us"] if full else "n/a",
                             ratio(f"marlin_full_g{g}", full) if full else "n/a",
                             ratio(f"kq_full_g{g}", full) if full else "n/a"])
    emit(head, rows)
    dense(by)


def dense(by: dict) -> None:
    """Dense rows (group 128): kq's public w4a16_linear on the lane layout (the CUDA kernel up to 64
    rows, then dequantise + cuBLAS) and on the tiles layout (Triton, dequantise + cuBLAS from 256), against
    cuBLAS BF16 / FP8 and torch's int4 tinygemm (_weight_int4pack_mm, group 128; not run past 512 rows)."""
    cases = sorted({(c, m) for (c, m, kind) in by if kind == "kq_lane_g128"})
    if not cases:
        return
    head = ["dense N x K", "M", "kq lane us (TB/s)", "kq tiles us", "vs cuBLAS BF16", "vs cuBLAS FP8", "vs torch int4",
            "tiles vs BF16"]
    rows = []
    for c, m in cases:
        lane, tiles = by[(c, m, "kq_lane_g128")], by.get((c, m, "kq_g128"))
        if REPICK:        # the instance cuda_lanes.pick_dense chooses now, where the CUDA kernel serves
            from kq.kernels.cuda_lanes import dense_variant_name, pick_dense
            n, k = lane["N"], lane["K"]
            lane = by.get((c, m, "lanes_dense_g128_" + dense_variant_name(pick_dense(m, n // 8, -(-k // 128))))) or lane
        bf16, fp8, int4 = (by.get((c, m, k)) for k in ("cublas_bf16", "cublas_fp8", "tinygemm_g128"))
        r = lambda p, b: f"{p['us'] / b['us']:.2f}x ({p['us']:.1f})" if p and b else "n/a"   # noqa: E731
        rows.append([c.removeprefix("dense_"), str(m), f"{lane['us']:.1f} ({lane['GBps'] / 1000:.2f})",
                     str(tiles["us"]) if tiles else "n/a", r(bf16, lane), r(fp8, lane), r(int4, lane), r(bf16, tiles)])
    print()
    emit(head, rows)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)        # no files: a usage error
    if "--repick" in args:
        args.remove("--repick")
        REPICK = True
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main(args)
