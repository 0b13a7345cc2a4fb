"""Quality cost of FP8 expert activations (W4AFP8 prefill) on the trained tiny GLM-5.2 model,
beside W4A16: one kq checkpoint at group 128, `kq eval --activations fp8` (KL, top-1, perplexity
for exact activations, FP8 per-token and FP8 per-tensor scales; kq.eval.fp8_act emulates the
W4A8 kernel's arithmetic). Target of issue 21: KL(FP8) <= 1.1 x KL(W4A16).

    python benchmarks/w4afp8_quality.py                       # RTN (kq's default), group 128
    python benchmarks/w4afp8_quality.py --method gptq         # GPTQ on the shared calibration text
    python benchmarks/w4afp8_quality.py --keep /tmp/tiny128   # keep the checkpoint

Model and texts: DIR/models/tiny-glm-5.2-fp8 and DIR/data/*.txt.gz, DIR from --shared, else
KQ_SHARED, else ../shared. Evaluation: 48 x 256 tokens, CPU float32, --batch 8 windows per
forward call (the per-tensor scale is one amax per call, as a server's prefill batch).
Writes benchmarks/results/w4afp8_quality.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=Path(os.environ.get("KQ_SHARED", REPO.parent / "shared")))
    ap.add_argument("--method", default="rtn", choices=["rtn", "gptq"])
    ap.add_argument("--keep", type=Path, help="write the checkpoint here (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "w4afp8_quality.md")
    a = ap.parse_args()
    tiny, data = a.shared / "models" / "tiny-glm-5.2-fp8", a.shared / "data"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.keep or Path(tmp) / "tiny-g128"
        q = [sys.executable, "-m", "kq", "quantize", str(tiny), "--out", str(ckpt), "--group-size", "128",
             "--device", "cpu", "--method", a.method]
        if a.method == "gptq":
            q += ["--calib", str(data / "calibration_text.txt.gz")]
        subprocess.run(q, check=True, cwd=REPO)
        ev = [sys.executable, "-m", "kq", "eval", str(ckpt), "--against", str(tiny), "--text",
              str(data / "eval_text.txt.gz"), "--activations", "fp8", "--json"]
        rec = json.loads(subprocess.run(ev, check=True, cwd=REPO, capture_output=True, text=True).stdout)
    acts = rec["activations"]
    rows = [("W4A16 (exact activations)", rec, None)] + [
        (f"W4AFP8, FP8 per-{acts[k]['scale']} scales", acts[k], acts[k]["kl_vs_w4a16"]) for k in ("fp8_token", "fp8_tensor")]
    lines = [f"# FP8 expert activations on the tiny GLM-5.2 model ({a.method.upper()}, group 128)", "",
             f"{datetime.date.today()}, kq {rec['kq_version']}, {rec['seqs']} x {rec['seqlen']} tokens of eval_text, "
             f"CPU float32; command: `python benchmarks/w4afp8_quality.py{' --method gptq' if a.method == 'gptq' else ''}`", "",
             "| experts | KL (nats/token) | top-1 | ppl | KL / W4A16 | <= 1.1x |", "|---|---|---|---|---|---|"]
    for label, r, ratio in rows:
        ok = "" if ratio is None else ("yes" if ratio <= TARGET else "NO")
        lines.append(f"| {label} | {r['kl']:.5f} | {r['top1'] * 100:.1f}% | {r['ppl_quantized']:.2f} | "
                     f"{'' if ratio is None else f'{ratio:.3f}x'} | {ok} |")
    lines += ["", f"Source perplexity {rec['ppl_source']:.2f}. {acts['emulation']}."]
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.write_text(text)
    return 0 if all(r is None or r <= TARGET for *_, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
