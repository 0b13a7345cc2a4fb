"""The table of benchmarks/w4a8_bench.py rows (JSON lines): checks, the best tile config of each W4A8
stage per size, then per case and mode the time of each variant (best of the rounds) and kq_w4a8's
speed-up over the others.

    python benchmarks/w4a8_table.py [--paired] benchmarks/results/h200/w4a8_*.jsonl

--paired: one row per case and size, each cell its burst and sustained values ("burst / sustained").
"""
import collections
import json
import sys


def main(args):
    paired = "--paired" in args
    paths = [a for a in args if a != "--paired"]
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    for r in rows:
        if "env" in r or "floor" in r or "check" in r or "error" in r:
            print(json.dumps(r))
    best = {}
    for r in rows:
        if "sweep" in r and "us" in r:
            key = (r["case"], r["tokens"], r["sweep"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    if best:
        print("\nbest W4A8 stage configs [BLOCK_M, BLOCK_N, warps, stages, cvt, fused_silu] (stage 1 with its output quantisation; call-3 rows: a sixth field 0 = SiLU*mul in the quantisation kernel, since removed)")
        for (c, t, s), r in sorted(best.items()):
            same = [x for x in rows if x.get("sweep") == s and x.get("case") == c and x.get("tokens") == t and "us" in x]
            print(f"  {c} T={t} {s}: {r['cfg']} {r['us']:.0f} us {r['tflops']} TFLOP/s (of {len(same)})")
    t = collections.defaultdict(dict)
    for r in rows:
        if "kind" in r and "us" in r:
            k = (r["case"], r["tokens"], r["mode"])
            t[k][r["kind"]] = min(r["us"], t[k].get(r["kind"], 1e30))
    kinds = list(dict.fromkeys(r["kind"] for r in rows if "kind" in r and "us" in r))
    if not t:
        return
    head = " | ".join(f"{k} us" for k in kinds) + " | kq_w4a8 speed-up over " + " | over ".join(
        k for k in kinds if k != "kq_w4a8") + " |"
    if paired:    # one row per case and size, each cell "burst / sustained" (or burst alone)
        print("\neach cell: burst / sustained\n| case | tokens | " + head)
        for c, n in dict.fromkeys((c, n) for c, n, _ in t):
            modes = [t[(c, n, m)] for m in ("burst", "sustained") if (c, n, m) in t]
            cells = [_pair([f"{v[k]:.0f}" if k in v else "-" for v in modes]) for k in kinds]
            ratios = [_pair([_ratio(v, k) for v in modes]) for k in kinds if k != "kq_w4a8"]
            print(f"| {c} | {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        return
    print("\n| case | tokens | mode | " + head)
    for (c, n, m), v in t.items():
        cells = [f"{v[k]:.0f}" if k in v else "-" for k in kinds]
        ratios = [_ratio(v, k) for k in kinds if k != "kq_w4a8"]
        print(f"| {c} | {n} | {m} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")

def _pair(cells):
    """'burst / sustained', or '-' where neither was measured."""
    return "-" if all(c == "-" for c in cells) else " / ".join(cells)


def _ratio(v, k):
    """kq_w4a8's speed-up over variant k in one mode's times, or '-' where either is missing."""
    w = v.get("kq_w4a8")
    return f"{v[k] / w:.2f}x" if (w and k in v) else "-"


if __name__ == "__main__":
    main(sys.argv[1:])
