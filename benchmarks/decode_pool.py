"""What a decode pool serves, on the trained tiny model: pair eval vs alone, MTP acceptance three ways,
the FP8 KV cache with and without calibrated scales (issue #24's figures for BENCHMARKS.md).

    python benchmarks/decode_pool.py [--groups 32 128] [--seqs 16] [--seqlen 256] [--prompt 128] [--out F.json]
    python benchmarks/decode_pool.py --table benchmarks/results/decode_pool_tiny_cpu.json

For each group: `kq quantize` (RTN, default MSE clip) with `--kv-cache fp8` (scales calibrated on
shared/data/calibration_text.txt.gz, --calib-samples x 256 tokens), and again with `--keep-mtp`; then, over the
first seqs x seqlen tokens of the held-out eval text, CPU float32:
- pair: KL/top-1 of the continuation (positions prompt..seqlen-1), INT4 alone vs source prefill +
  INT4 decode (kq.eval.pair);
- MTP: first-draft-token acceptance (greedy) of the source, of the INT4 output (INT4 MTP experts)
  and of the --keep-mtp output (FP8 MTP experts), each against its own target (kq.eval.mtp);
- KV: KL/top-1 of the INT4 output with an emulated e4m3 latent cache at scale 1.0, at the calibrated
  scales and with SGLang's per-128 dynamic scales (kq.eval.kvcache).
The tiny model's MTP layer is untrained (a copy of layer 3, shared/models/README.md): its acceptance
shows the wiring and the relative cost of quantizing the draft, not a real draft's rate.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY = SHARED / "models" / "tiny-glm-5.2-fp8"
CALIB = SHARED / "data" / "calibration_text.txt.gz"
EVAL = SHARED / "data" / "eval_text.txt.gz"


def quantize(out: Path, group: int, *extra: str) -> Path:
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(TINY), "--out", str(out), "--group-size",
                        str(group), "--device", "cpu", "--json", *extra], capture_output=True, text=True, cwd=REPO)
    if r.returncode:
        sys.exit(r.stderr)
    return out


def table(res: dict) -> None:
    """The table BENCHMARKS.md shows, from a run's results (also `--table F.json` on saved ones)."""
    print(f"\n{res['tokens']} tokens of the eval text, prompt {res['prompt']}; KL nats/token, top-1 %")
    print("| group | plain KL | continuation KL alone | pair | top-1 alone | pair | MTP accept src | INT4 | keep-mtp "
          "| KV none KL | fp8 s=1 | fp8 calibrated | fp8 per-128 |")
    for g, r in res["groups"].items():
        p, m, kv = r["pair"], r["mtp"], r["kv_cache"]
        print(f"| {g} | {r['plain']['kl']:.4f} | {p['alone']['kl']:.4f} | {p['pair']['kl']:.4f} | "
              f"{p['alone']['top1'] * 100:.1f} | {p['pair']['top1'] * 100:.1f} | "
              f"{m['source']['acceptance'] * 100:.1f} | {m['quantized']['acceptance'] * 100:.1f} | "
              f"{r['mtp_keep']['acceptance'] * 100:.1f} | {r['plain']['kl']:.4f} | {kv['scale-1']['kl']:.4f} | "
              f"{kv['calibrated']['kl']:.4f} | {kv['block-128']['kl']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--calib-samples", type=int, default=64, help="KV-scale calibration windows of 256 tokens")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, help="only print the table of saved results (an --out file)")
    a = ap.parse_args()
    if a.table:
        table(json.loads(a.table.read_text()))
        return
    sys.path.insert(0, str(REPO))
    import torch

    from kq.checkpoint.reader import CheckpointReader
    from kq.eval.mtp import mtp_acceptance, mtp_report
    from kq.eval.pair import compare_pair
    from kq.eval.run import eval_ids, kv_cache_figures
    from kq.model import LayerwiseModel

    torch.manual_seed(0)
    ids, targets = eval_ids(TINY, EVAL, a.seqs, a.seqlen)
    src = LayerwiseModel(CheckpointReader(TINY))
    res = {"tokens": f"{a.seqs} x {a.seqlen}", "prompt": a.prompt, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "groups": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for g in a.groups:
            t0 = time.time()
            out = quantize(Path(tmp) / f"g{g}", g, "--kv-cache", "fp8", "--calib", str(CALIB),
                           "--calib-samples", str(a.calib_samples), "--calib-seqlen", "256")
            keep = quantize(Path(tmp) / f"g{g}-keep", g, "--keep-mtp")
            qr = CheckpointReader(out)
            pair = compare_pair(src, LayerwiseModel(qr), ids, targets, prompt=a.prompt)
            mtp = mtp_report(src, LayerwiseModel(qr), ids, targets)
            kept = mtp_acceptance(LayerwiseModel(CheckpointReader(keep)), ids, targets)
            kv = kv_cache_figures(qr, src, ids, targets, dtype=torch.float32, device="cpu", batch=8)
            res["groups"][g] = {"plain": pair.summary, "pair": pair.notes["pair"], "mtp": mtp, "mtp_keep": kept,
                                "kv_cache": kv, "seconds": round(time.time() - t0, 1)}
            print(json.dumps({g: res["groups"][g]}), flush=True)
    table(res)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
