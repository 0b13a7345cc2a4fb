"""Quality of INT4 expert quantizers on the trained tiny GLM-5.2 model: KL, top-1, perplexity,
wall time, peak memory; kq against llm-compressor, measured in one run.

    python benchmarks/quality.py                      # groups 32 and 128, writes benchmarks/results/quality.md
    python benchmarks/quality.py --groups 32 --skip-llmc

Rows (routed experts only are INT4; everything else as the tool leaves it):
  naive absmax (reference)  in memory, scale amax/7.5 in float32: the figures of
                            shared/models/README.md (a check that the harness computes them)
  kq RTN absmax             `kq quantize --clip absmax` (bf16 scales, as stored)
  kq RTN mse                `kq quantize` (default: per-group MSE clipping search)
  kq GPTQ                   `kq quantize --method gptq --calib calibration_text.txt.gz`
  llmc model_free_ptq       llm-compressor 0.14 RTN from the FP8 source (FP8BlockDequantizer: its
                            non-expert FP8 linears leave as BF16)
  llmc oneshot GPTQ         llm-compressor 0.14 `oneshot` + GPTQModifier W4A16 on a BF16 copy of the
                            model, the same calibration windows as kq, its defaults otherwise
  "experts only" rows put that tool's INT4 experts into the FP8 source (everything else exact), so
  they compare the expert quantization alone: a BF16 copy of the other weights by itself moves
  the logits (its own row shows how much).
Evaluation: `kq eval` (48 x 256 tokens of eval_text, CPU float32) against the FP8 source.
Time and peak memory (max RSS) are those of the quantize process. llm-compressor runs in its
own venv (KQ_LLMC_PYTHON, default .venv-llmc/bin/python): it pins compressed-tensors 0.19.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TINY = SHARED / "models" / "tiny-glm-5.2-fp8"
EVAL = SHARED / "data" / "eval_text.txt.gz"
CALIB = SHARED / "data" / "calibration_text.txt.gz"

# Runs a module's main in this process and reports wall time and peak RSS to a file.
CHILD = """
import json, resource, runpy, sys, time
out = sys.argv[1]; sys.argv = sys.argv[2:]
t = time.time()
try:
    runpy.run_path(sys.argv[0], run_name="__main__") if sys.argv[0].endswith(".py") else runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as e:
    if e.code not in (0, None): raise
finally:
    json.dump({"seconds": time.time() - t, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, open(out, "w"))
"""

LLMC_ONESHOT = """
import json, sys, torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
src, out, calib, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ids = torch.tensor(json.load(open(calib)))
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
recipe = GPTQModifier(config_groups={"int4_experts": {
    "targets": [r"re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
    ignore=["lm_head"])
dl = DataLoader([{"input_ids": r[None], "attention_mask": torch.ones_like(r)[None]} for r in ids], batch_size=None)
oneshot(model=model, dataset=dl, recipe=recipe, num_calibration_samples=len(ids), output_dir=out)
"""

LLMC_MODEL_FREE = """
import sys
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationScheme, QuantizationArgs
from llmcompressor import model_free_ptq
src, out, group = sys.argv[1], sys.argv[2], int(sys.argv[3])
experts = r"re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"
scheme = QuantizationScheme(targets=[experts], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                            strategy="group", group_size=group))
# Every FP8 linear of the GLM-5 layout (the BF16 ones: router, indexer weights_proj, MTP eh_proj, lm_head).
fp8 = FP8BlockDequantizer(targets=[r"re:.*(_proj|\.wq_b|\.wk)$"],
                          ignore=[r"re:.*weights_proj$", r"re:.*eh_proj$", "lm_head"])
model_free_ptq(src, out, scheme=scheme, converter=fp8)
"""


def timed(cmd: list[str], work: Path, python: str = sys.executable) -> dict:
    rep = work / f"child-{time.time_ns()}.json"
    r = subprocess.run([python, "-c", CHILD, str(rep), *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[:2]} failed:\n{r.stderr[-3000:]}")
    return json.loads(rep.read_text())


def kq_quantize(out: Path, group: int, work: Path, *extra: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return timed(["kq", "quantize", str(TINY), "--out", str(out), "-g", str(group), "--device", "cpu", *extra], work)


def evaluate(folder: Path) -> dict:
    from kq.eval.run import evaluate as ev
    return ev(folder, TINY, EVAL, write=False)


def experts_only(folder: Path) -> dict:
    """That checkpoint's INT4 experts in the FP8 source, everything else exact."""
    from kq.checkpoint.reader import CheckpointReader
    from kq.eval.compare import compare
    from kq.eval.run import eval_ids
    from kq.model import LayerwiseModel
    q, src = CheckpointReader(folder), CheckpointReader(TINY)
    ids, targets = eval_ids(TINY, EVAL, 48, 256)
    return compare(LayerwiseModel(src), LayerwiseModel(src, override=lambda n, w: q.weight(n)), ids, targets).summary


def naive_reference(group: int) -> dict:
    from kq.checkpoint.reader import CheckpointReader
    from kq.eval.compare import compare
    from kq.eval.run import eval_ids
    from kq.model import LayerwiseModel

    def fq(name, w):
        o, n = w.shape
        wg = w.view(o, n // group, group)
        s = wg.abs().amax(-1, keepdim=True) / 7.5
        return ((wg / s).round().clamp(-8, 7) * s).view(o, n)
    r = CheckpointReader(TINY)
    ids, targets = eval_ids(TINY, EVAL, 48, 256)
    return compare(LayerwiseModel(r), LayerwiseModel(r, override=fq), ids, targets).summary


def bf16_copy(dst: Path, calib_json: Path, samples: int, seqlen: int) -> None:
    """The FP8 source dequantized to one BF16 safetensors file (what llm-compressor's oneshot
    needs), and the calibration windows kq uses, for the same tokens on both sides."""
    import torch
    from safetensors.torch import save_file

    from kq.checkpoint.reader import CheckpointReader
    from kq.quantize.calibration import calibration_ids
    r = CheckpointReader(TINY)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    out = {}
    for n in r.names():
        if n.endswith(("_scale_inv", "_scale")):
            continue
        t = r.raw(n)
        if t.dtype == torch.float8_e4m3fn:
            t = r.weight(n[: -len(".weight")])
        out[n] = t if t.dtype == torch.float32 and t.dim() == 1 else t.to(torch.bfloat16)  # F32 router bias stays
    save_file(out, str(dst / "model.safetensors"))
    cfg = dict(r.config)
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / f, dst / f)
    calib_json.write_text(json.dumps(calibration_ids(TINY, r.config, CALIB, samples, seqlen).tolist()))


def row(name: str, group: int, ev: dict | None, run: dict | None, note: str = "") -> dict:
    return {"method": name, "group": group, **({k: ev[k] for k in ("kl", "top1", "ppl_quantized", "ppl_source")}
                                                if ev else {}),
            **({"seconds": run["seconds"], "peak_rss_mb": run["peak_rss_mb"]} if run else {}), "note": note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="32,128")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kq-quality"))
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument("--only", default="", help="comma list of rows to run: naive,absmax,mse,gptq,llmc_free,llmc_gptq")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quality.md")
    ap.add_argument("--memory-scaling", action="store_true",
                    help="only: peak RSS of `kq quantize --method gptq` on generated models of L and 4L layers")
    a = ap.parse_args()
    if a.memory_scaling:
        return memory_scaling(a)
    only = set(filter(None, a.only.split(",")))
    want = (lambda k: not only or k in only)
    llmc_py = os.environ.get("KQ_LLMC_PYTHON", str(REPO / ".venv-llmc" / "bin" / "python"))
    a.work.mkdir(parents=True, exist_ok=True)
    rows = _Rows(lambda rs: write_table(rs, a))   # the table is rewritten after every row
    calib_json = a.work / "calib_ids.json"
    if not a.skip_llmc and want("llmc_gptq"):
        bf16_copy(a.work / "bf16", calib_json, a.samples, a.seqlen)
    groups = [int(g) for g in a.groups.split(",")]
    for g in groups:
        # Most telling rows first: the table on disk is complete up to the last finished row.
        if want("gptq"):
            run = kq_quantize(a.work / f"gptq-g{g}", g, a.work, "--method", "gptq", "--calib", str(CALIB),
                              "--calib-samples", str(a.samples), "--calib-seqlen", str(a.seqlen))
            rows.append(row("kq GPTQ (policy all)", g, evaluate(a.work / f"gptq-g{g}"), run))
        if want("absmax"):
            run = kq_quantize(a.work / f"absmax-g{g}", g, a.work, "--clip", "absmax")
            rows.append(row("kq RTN absmax", g, evaluate(a.work / f"absmax-g{g}"), run))
        if want("llmc_gptq") and not a.skip_llmc:
            out = a.work / f"llmc-gptq-g{g}"
            shutil.rmtree(out, ignore_errors=True)
            run = timed_script(LLMC_ONESHOT, [str(a.work / "bf16"), str(out), str(calib_json), str(g)], a.work, llmc_py)
            rows.append(row("llmc oneshot GPTQ (experts only)", g, experts_only(out), run))
            rows.append(row("llmc oneshot GPTQ (as written, BF16 rest)", g, evaluate(out), None))
        if want("naive"):
            rows.append(row("naive absmax RTN (README reference, in memory)", g, naive_reference(g), None))
        if want("mse"):
            run = kq_quantize(a.work / f"mse-g{g}", g, a.work)
            rows.append(row("kq RTN mse (default)", g, evaluate(a.work / f"mse-g{g}"), run))
        if want("llmc_gptq") and not a.skip_llmc and g == groups[-1]:
            rows.append(row("BF16 copy of the source (llm-compressor's input), no INT4", 0, evaluate(a.work / "bf16"), None))
        if want("llmc_free") and not a.skip_llmc:
            out = a.work / f"llmc-free-g{g}"
            shutil.rmtree(out, ignore_errors=True)
            run = timed_script(LLMC_MODEL_FREE, [str(TINY), str(out), str(g)], a.work, llmc_py)
            rows.append(row("llmc model_free_ptq (experts only)", g, experts_only(out), run))
            rows.append(row("llmc model_free_ptq (as written, BF16 rest)", g, evaluate(out), None))
    write_table(rows, a)


def memory_scaling(a) -> None:
    """Peak memory must not grow with depth: one layer is in memory at a time."""
    from kq.synth import generate
    dims = dict(hidden=1024, n_experts=8, moe_intermediate=1024, intermediate=2048, vocab=4096, top_k=2)
    rows = []
    for layers in (2, 8):
        src = a.work / f"synth-{layers}L"
        if not (src / "model.safetensors.index.json").exists():
            generate("glm5", src, seed=0, num_layers=layers, first_k_dense=1, overwrite=True, **dims)
        out = a.work / f"synth-{layers}L-gptq"
        shutil.rmtree(out, ignore_errors=True)
        run = timed(["kq", "quantize", str(src), "--out", str(out), "-g", "128", "--device", "cpu", "--method", "gptq",
                     "--calib", str(CALIB), "--calib-samples", "4", "--calib-seqlen", "128"], a.work)
        rows.append((layers, run))
    lines = [f"GPTQ peak memory vs depth (generated GLM-5.2 layout, hidden 1024, 8 experts of 1024, 4 x 128 "
             f"calibration tokens, CPU; `python benchmarks/quality.py --memory-scaling`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC):", "",
             "| decoder layers | quantize s | peak RSS MB |", "|---|---|---|"]
    lines += [f"| {n} | {r['seconds']:.1f} | {r['peak_rss_mb']:.0f} |" for n, r in rows]
    lines += ["", f"Ratio of peak RSS, 4x the layers: {rows[1][1]['peak_rss_mb'] / rows[0][1]['peak_rss_mb']:.3f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    (a.work / "memory_scaling.md").write_text(text)


class _Rows(list):
    def __init__(self, on_change):
        super().__init__()
        self._on_change = on_change

    def append(self, r):
        super().append(r)
        self._on_change(self)


def timed_script(code: str, args: list[str], work: Path, python: str) -> dict:
    script = work / f"script-{time.time_ns()}.py"
    script.write_text(code)
    return timed([str(script), *args], work, python)


def write_table(rows: list[dict], a) -> None:
    import torch
    import transformers
    lines = [f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by `python benchmarks/quality.py"
             f" --groups {a.groups} --samples {a.samples} --seqlen {a.seqlen}`; {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, torch {torch.__version__}, transformers {transformers.__version__}.",
             f"Model {TINY.name}; eval 48 x 256 tokens of eval_text (CPU float32) against the FP8 source; "
             f"calibration {a.samples} x {a.seqlen} tokens of calibration_text.", "",
             "| method | group | KL (nats/token) | top-1 | ppl | quantize s | peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = f"{r['kl']:.5f}" if "kl" in r else ""
        t1 = f"{r['top1'] * 100:.2f}%" if "top1" in r else ""
        ppl = f"{r['ppl_quantized']:.3f}" if "ppl_quantized" in r else ""
        s = f"{r['seconds']:.1f}" if "seconds" in r else ""
        m = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else ""
        lines.append(f"| {r['method']} | {r['group'] or ''} | {kl} | {t1} | {ppl} | {s} | {m} |")
    src = next((r["ppl_source"] for r in rows if "ppl_source" in r), None)
    if src:
        lines += ["", f"Perplexity of the FP8 source on the same tokens: {src:.3f}."]
    text = "\n".join(lines) + "\n"
    print(lines[-1] if not src else lines[-3], flush=True)
    (a.work / "quality.json").write_text(json.dumps(rows, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
