"""Quality of INT4 expert quantizers on the trained tiny GLM-5.2 model: KL, top-1, perplexity,
wall time, peak memory; kq against llm-compressor, measured in one run.

    python benchmarks/quality.py                      # groups 32 and 128, writes benchmarks/results/quality.md
    python benchmarks/quality.py --groups 32 --skip-llmc
    python benchmarks/quality.py --prepare            # copy model + texts into .carry-quality/ (for the GPU machine)
    KQ_SHARED=.carry-quality python3 benchmarks/quality.py --device cuda --eval-jobs 3 --deadline-s 330
                                                      # on the lent H200: benchmarks/gpu_quality.sh

Rows (routed experts only are INT4; everything else as the tool leaves it), run in priority
order (--only picks keys; --deadline-s: no quantization starts after it):
  naive absmax (reference)  [naive] in memory, scale amax/7.5 in float32: the figures of
                            shared/models/README.md (a check that the harness computes them)
  kq RTN absmax             [absmax] `kq quantize --clip absmax` (bf16 scales, as stored)
  kq RTN mse                [mse] `kq quantize` (default: per-group MSE clipping search)
  kq GPTQ                   [gptq] `kq quantize --method gptq --calib calibration_text.txt.gz`
                            (defaults: --calib-policy all, --gptq-damp 0.01 at g32, 0.001 at g128), and its variants:
                            [gptq_routed] / [gptq_weighted] --calib-policy routed / weighted,
                            [gptq_damp01] --gptq-damp 0.1, [gptq_refit] --gptq-refit-scales,
                            [gptq_search] --gptq-clip search
  kq AWQ                    [awq] `kq quantize --method awq` (down_proj input scales folded into up_proj,
                            activation-weighted clip search), [awq_gptq] `--method awq+gptq` (the same scales,
                            then GPTQ with its defaults); same calibration as kq GPTQ
  llmc oneshot AWQ          [llmc_awq] llm-compressor 0.14 AWQModifier with its own mappings for this
                            architecture (GlmMoeDsaForCausalLM: input_layernorm -> q_a/kv_a, q_a/kv_a norms ->
                            q_b/kv_b, post_attention_layernorm -> every gate/up, up -> down; it smooths BF16
                            non-expert weights too, so only "as written" is a valid evaluation), then
                            QuantizationModifier W4A16 on the experts; the same BF16 copy and windows as llmc GPTQ;
                            [llmc_awq_ud] the same with the one mapping kq's AWQ uses (routed experts' up_proj ->
                            down_proj), so "experts only" is valid and like for like
  llmc model_free_ptq       [llmc_free] llm-compressor 0.14 RTN from the FP8 source (FP8BlockDequantizer:
                            its non-expert FP8 linears leave as BF16)
  llmc oneshot GPTQ         [llmc_gptq] llm-compressor 0.14 `oneshot` + GPTQModifier W4A16 on a BF16 copy
                            of the model, the same calibration windows as kq, its defaults otherwise (it
                            calibrates on the GPU when torch sees one)
  BF16 copy                 [bf16] llm-compressor's input, no INT4 (how much BF16 alone moves the logits)
  "experts only" rows put that tool's INT4 experts into the FP8 source (everything else exact), so
  they compare the expert quantization alone: a BF16 copy of the other weights by itself moves
  the logits (its own row shows how much).
Evaluation: 48 x 256 tokens of eval_text, CPU float32, against the FP8 source: the arithmetic of
`kq eval` (kq.eval.compare), with the source's logits computed once per evaluating process
(--eval-jobs N: N processes, the CPU's cores split between them, overlapping the quantize runs).
Time and peak memory (max RSS) are those of the quantize process. llm-compressor runs with
KQ_LLMC_PYTHON (default .venv-llmc/bin/python): it pins compressed-tensors 0.19.
Model and texts: DIR/models/tiny-glm-5.2-fp8, DIR/data/{eval,calibration}_text.txt.gz with DIR
from --shared, else KQ_SHARED, else ../shared.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # also in the spawned evaluation processes
CARRY = REPO / ".carry-quality"
SHARED = Path(os.environ.get("KQ_SHARED", REPO.parent / "shared"))
TINY = SHARED / "models" / "tiny-glm-5.2-fp8"
EVAL = SHARED / "data" / "eval_text.txt.gz"
CALIB = SHARED / "data" / "calibration_text.txt.gz"


def set_shared(d: Path) -> None:
    global SHARED, TINY, EVAL, CALIB
    SHARED = Path(d).resolve()
    TINY = SHARED / "models" / "tiny-glm-5.2-fp8"
    EVAL = SHARED / "data" / "eval_text.txt.gz"
    CALIB = SHARED / "data" / "calibration_text.txt.gz"


def prepare(dst: Path = CARRY) -> None:
    """Copy the model and both texts into DST (git-ignored) so the GPU machine gets them by `carry`."""
    excl = REPO / ".git" / "info" / "exclude"
    line = "/" + dst.relative_to(REPO).as_posix() + "/"
    if excl.parent.is_dir() and line not in excl.read_text().split():
        with open(excl, "a") as f:
            f.write(line + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(TINY, dst / "models" / TINY.name)
    (dst / "data").mkdir(parents=True)
    for f in (EVAL, CALIB):
        shutil.copy(f, dst / "data" / f.name)
    rev = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    (dst / "COMMIT").write_text(rev.stdout.strip() or "?")
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"{dst}: {size / 1e6:.1f} MB (model {TINY.name}, {EVAL.name}, {CALIB.name}); commit {rev.stdout.strip()}")


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
    # VmHWM (this process's own peak, fresh at exec); ru_maxrss would carry the parent's RSS at fork.
    hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    kb = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    json.dump({"seconds": time.time() - t, "peak_rss_mb": kb / 1024}, open(out, "w"))
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
print(f"llm-compressor oneshot: accelerator {torch.accelerator.current_accelerator() if torch.accelerator.is_available() else 'none (CPU)'}",
      file=sys.stderr, flush=True)
oneshot(model=model, dataset=dl, recipe=recipe, num_calibration_samples=len(ids), output_dir=out)
"""

LLMC_AWQ = """
import json, sys, torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
if not torch.accelerator.is_available():
    # 0.14.0.1's AWQ pins its CPU activation cache for faster host-to-device copies, which raises
    # "Cannot access accelerator device when none is available" on a CPU-only torch; no copy happens
    # without an accelerator, so the pinning is skipped (no effect on the numbers).
    IntermediatesCache._pin_intermediate = classmethod(lambda cls, intermediate: None)
src, out, calib, group, mappings = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
ids = torch.tensor(json.load(open(calib)))
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
# "own": the registry's mappings for the architecture; "updown": only the routed experts' up -> down
maps = None if mappings == "own" else [AWQMapping(r"re:.*mlp\.experts\.\d+\.up_proj$",
                                                  [r"re:.*mlp\.experts\.\d+\.down_proj$"])]
recipe = [AWQModifier(mappings=maps), QuantizationModifier(config_groups={"int4_experts": {
    "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
    ignore=["lm_head"])]
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


def kq_quantize(out: Path, group: int, work: Path, device: str, *extra: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return timed(["kq", "quantize", str(TINY), "--out", str(out), "-g", str(group), "--device", device, *extra], work)


# -- evaluation (runs in worker processes when --eval-jobs > 0) --------------------------------

_SOURCE: dict = {}


def _init_worker(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)


def _run_model(model, ids):
    """Every eval window through every layer: the hidden states per batch of 8 (as kq.eval.compare)."""
    from kq.eval.compare import _run_layers
    chunks = list(ids.split(8))
    hs = [model.embed(c) for c in chunks]
    cs: list = [None] * len(chunks)
    for i in range(model.num_layers):
        _run_layers(model, i, hs, cs)
    return hs


def eval_job(kind: str, folder: str | None, group: int, tiny: str, evalf: str) -> dict:
    """kind: 'as_written' (the checkpoint as a whole, like `kq eval`), 'experts_only' (its INT4
    experts in the FP8 source), 'naive' (README's float32-scale absmax RTN, in memory).
    -> KL / top-1 / perplexities against the FP8 source, the arithmetic of kq.eval.compare."""
    import torch

    from kq.checkpoint.reader import CheckpointReader
    from kq.eval.metrics import Totals
    from kq.eval.run import eval_ids
    from kq.model import LayerwiseModel
    t0 = time.time()
    with torch.no_grad():
        src = CheckpointReader(tiny)
        key = (tiny, evalf)
        if key not in _SOURCE:
            ids, targets = eval_ids(Path(tiny), Path(evalf), 48, 256)
            m = LayerwiseModel(src)
            _SOURCE[key] = (ids, targets, [m.logits(h) for h in _run_model(m, ids)])
        ids, targets, src_logits = _SOURCE[key]
        if kind == "as_written":
            q = LayerwiseModel(CheckpointReader(folder))
        elif kind == "experts_only":
            qr = CheckpointReader(folder)
            q = LayerwiseModel(src, override=lambda n, w: qr.weight(n))
        elif kind == "naive":
            def fq(name, w):
                o, n = w.shape
                wg = w.view(o, n // group, group)
                s = wg.abs().amax(-1, keepdim=True) / 7.5
                return ((wg / s).round().clamp(-8, 7) * s).view(o, n)
            q = LayerwiseModel(src, override=fq)
        else:
            raise ValueError(kind)
        tot = Totals()
        for t, a, h in zip(targets.split(8), src_logits, _run_model(q, ids)):
            tot.add(a, q.logits(h), t)
    return {**tot.summary(), "eval_s": round(time.time() - t0, 1)}


class Evaluator:
    """Evaluations inline (jobs 0) or in `jobs` spawned processes; results come back as rows."""

    def __init__(self, jobs: int, rows: "_Rows"):
        self.rows, self.pending = rows, []
        self.pool = None
        if jobs > 0:
            threads = max(1, (os.cpu_count() or 2) // (jobs + 1))   # a share is left for the quantize runs
            self.pool = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                               initargs=(threads,))

    def submit(self, name: str, group: int, kind: str, folder: Path | None, run: dict | None, note: str = "",
               key: str = "") -> None:
        args = (kind, str(folder) if folder else None, group, str(TINY), str(EVAL))
        meta = dict(name=name, group=group, run=run, note=note, key=key)
        if self.pool is None:
            self._add(meta, eval_job(*args))
        else:
            self.pending.append((meta, self.pool.submit(eval_job, *args)))
        self.collect()

    def _add(self, meta, ev: dict | None, err: str = "") -> None:
        self.rows.append(row(meta["name"], meta["group"], ev, meta["run"], meta["note"] or err, key=meta["key"]))

    def collect(self, wait: bool = False, timeout: float | None = None) -> None:
        if wait and self.pending:
            cf.wait([f for _, f in self.pending], timeout=timeout)
        left = []
        for meta, f in self.pending:
            if f.done():
                try:
                    self._add(meta, f.result())
                except Exception as e:  # noqa: BLE001 - one failed row must not lose the table
                    self._add(meta, None, f"eval failed: {e!r}"[:300])
            else:
                left.append((meta, f))
        self.pending = left

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


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


def row(name: str, group: int, ev: dict | None, run: dict | None, note: str = "", key: str = "") -> dict:
    return {"method": name, "key": key, "group": group,
            **({k: ev[k] for k in ("kl", "top1", "ppl_quantized", "ppl_source") if k in ev} if ev else {}),
            **({"eval_s": ev["eval_s"]} if ev and "eval_s" in ev else {}),
            **({"seconds": run["seconds"], "peak_rss_mb": run["peak_rss_mb"]} if run else {}), "note": note}


GPTQ_VARIANTS = {  # key: (row name, extra `kq quantize` options)
    "gptq": ("kq GPTQ (default: policy all, damp 0.01 at g32 / 0.001 at g128)", []),
    "gptq_refit": ("kq GPTQ --gptq-refit-scales", ["--gptq-refit-scales"]),
    "gptq_weighted": ("kq GPTQ --calib-policy weighted", ["--calib-policy", "weighted"]),
    "gptq_routed": ("kq GPTQ --calib-policy routed", ["--calib-policy", "routed"]),
    "gptq_damp01": ("kq GPTQ --gptq-damp 0.1", ["--gptq-damp", "0.1"]),
    "gptq_search": ("kq GPTQ --gptq-clip search", ["--gptq-clip", "search"]),
    "gptq_asym": ("kq GPTQ --gptq-asym", ["--gptq-asym"]),
    "gptq_damp001": ("kq GPTQ --gptq-damp 0.01", ["--gptq-damp", "0.01"]),
    "gptq_damp0001": ("kq GPTQ --gptq-damp 0.001", ["--gptq-damp", "0.001"]),
    "gptq_clip_absmax": ("kq GPTQ --gptq-clip absmax", ["--gptq-clip", "absmax"]),
}
AWQ_VARIANTS = {  # key: (row name, extra `kq quantize` options)
    "awq": ("kq AWQ (--method awq)", ["--method", "awq"]),
    "awq_gptq": ("kq AWQ+GPTQ (--method awq+gptq)", ["--method", "awq+gptq"]),
}
# Priority order: what the acceptance needs first (the table on disk is complete up to the last row).
ORDER = ["gptq", "awq", "awq_gptq", "llmc_awq_ud", "llmc_awq", "absmax", "llmc_gptq", "naive", "gptq_search", "gptq_asym", "gptq_damp001", "gptq_damp0001",
         "gptq_clip_absmax", "gptq_refit", "gptq_weighted", "gptq_routed", "mse", "gptq_damp01", "llmc_free", "bf16"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="32,128")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kq-quality"))
    ap.add_argument("--shared", type=Path, default=None, help="folder with models/ and data/ (default: $KQ_SHARED "
                    "or ../shared)")
    ap.add_argument("--prepare", action="store_true", help=f"only copy model + texts into {CARRY.name}/ and exit")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="kq GPTQ's device (RTN rows: --rtn-device)")
    ap.add_argument("--rtn-device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--eval-jobs", type=int, default=0, help="evaluating processes (0: inline, in order)")
    ap.add_argument("--deadline-s", type=float, default=0, help="no quantization starts after this many seconds "
                    "(0: none); evaluations already started get --grace-s more")
    ap.add_argument("--grace-s", type=float, default=60)
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument("--only", default="", help="comma list of row keys: " + ",".join(ORDER))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quality.md")
    ap.add_argument("--memory-scaling", action="store_true",
                    help="only: peak RSS of `kq quantize --method gptq` on generated models of L and 4L layers")
    a = ap.parse_args()
    if a.shared:
        set_shared(a.shared)
    if a.prepare:
        return prepare()
    for f in (TINY / "config.json", EVAL, CALIB):
        if not f.exists():
            sys.exit(f"{f}: missing (--shared DIR / KQ_SHARED, or `python benchmarks/quality.py --prepare` then carry "
                     f"{CARRY.name})")
    if a.memory_scaling:
        return memory_scaling(a)
    t_start = time.time()
    only = set(filter(None, a.only.split(",")))
    unknown = only - set(ORDER)
    if unknown:
        sys.exit(f"--only: unknown rows {sorted(unknown)}; use {','.join(ORDER)}")
    keys = [k for k in ORDER if (not only or k in only) and not (a.skip_llmc and k.startswith(("llmc", "bf16")))]
    llmc_py = os.environ.get("KQ_LLMC_PYTHON", str(REPO / ".venv-llmc" / "bin" / "python"))
    a.work.mkdir(parents=True, exist_ok=True)
    a.header = header(a, llmc_py if any(k.startswith(("llmc", "bf16")) for k in keys) else None)
    rows = _Rows(lambda rs: write_table(rs, a))   # the table is rewritten after every row
    ev = Evaluator(a.eval_jobs, rows)
    calib_json = a.work / "calib_ids.json"
    groups = [int(g) for g in a.groups.split(",")]
    if not all(g in (32, 64, 128) for g in groups):
        sys.exit(f"--groups {a.groups}: use 32, 64 and/or 128")
    calib = ["--calib", str(CALIB), "--calib-samples", str(a.samples), "--calib-seqlen", str(a.seqlen)]
    skipped = []
    try:
        if any(k in ("llmc_gptq", "llmc_awq", "llmc_awq_ud", "bf16") for k in keys):
            bf16_copy(a.work / "bf16", calib_json, a.samples, a.seqlen)
        for k in keys:
            for g in ([0] if k == "bf16" else groups):
                if a.deadline_s and time.time() - t_start > a.deadline_s:
                    skipped.append(f"{k} g{g}" if g else k)
                    continue
                try:
                    one_row(k, g, a, ev, calib, calib_json, llmc_py)
                except Exception as e:  # noqa: BLE001 - a failed row is recorded, the others still run
                    print(f"row {k} g{g} failed: {e}", file=sys.stderr, flush=True)
                    rows.append(row(f"{k} (failed)", g, None, None, f"{e!r}"[:300], key=k))
                ev.collect()
        grace = a.grace_s if a.deadline_s else None
        ev.collect(wait=True, timeout=grace)
        for meta, _ in ev.pending:
            skipped.append(f"eval of {meta['name']} g{meta['group']} (not finished)")
    finally:
        ev.close()
    a.skipped = skipped
    write_table(rows, a)
    print(f"total {time.time() - t_start:.0f} s; table {a.out}; json {a.work / 'quality.json'}", flush=True)


def one_row(k: str, g: int, a, ev: Evaluator, calib: list, calib_json: Path, llmc_py: str) -> None:
    w = a.work
    if k in GPTQ_VARIANTS:
        name, extra = GPTQ_VARIANTS[k]
        out = w / f"{k}-g{g}"
        run = kq_quantize(out, g, w, a.device, "--method", "gptq", *calib, *extra)
        ev.submit(name, g, "as_written", out, run, f"on {a.device}", key=k)
    elif k in AWQ_VARIANTS:
        name, extra = AWQ_VARIANTS[k]
        out = w / f"{k}-g{g}"
        run = kq_quantize(out, g, w, a.device, *calib, *extra)
        ev.submit(name, g, "as_written", out, run, f"on {a.device}", key=k)
    elif k in ("llmc_awq", "llmc_awq_ud"):
        out = w / f"{k}-g{g}"
        shutil.rmtree(out, ignore_errors=True)
        run = timed_script(LLMC_AWQ, [str(w / "bf16"), str(out), str(calib_json), str(g),
                                      "own" if k == "llmc_awq" else "updown"], w, llmc_py)
        if k == "llmc_awq_ud":
            ev.submit("llmc oneshot AWQ, up->down mapping only (experts only)", g, "experts_only", out, run, key=k)
            ev.submit("llmc oneshot AWQ, up->down mapping only (as written, BF16 rest)", g, "as_written", out, None,
                      key=k + "_written")
        else:   # its norms and attention weights are smoothed: its experts do not fit the FP8 source's norms
            ev.submit("llmc oneshot AWQ, its GlmMoeDsa mappings (as written, BF16 rest)", g, "as_written", out, run,
                      key=k + "_written")
    elif k in ("absmax", "mse"):
        out = w / f"{k}-g{g}"
        run = kq_quantize(out, g, w, a.rtn_device, *(["--clip", "absmax"] if k == "absmax" else []))
        ev.submit("kq RTN absmax" if k == "absmax" else "kq RTN mse (default)", g, "as_written", out, run, key=k)
    elif k == "naive":
        ev.submit("naive absmax RTN (README reference, in memory)", g, "naive", None, None, key=k)
    elif k == "llmc_gptq":
        out = w / f"llmc-gptq-g{g}"
        shutil.rmtree(out, ignore_errors=True)
        run = timed_script(LLMC_ONESHOT, [str(w / "bf16"), str(out), str(calib_json), str(g)], w, llmc_py)
        ev.submit("llmc oneshot GPTQ (experts only)", g, "experts_only", out, run, key=k)
        ev.submit("llmc oneshot GPTQ (as written, BF16 rest)", g, "as_written", out, None, key=k + "_written")
    elif k == "llmc_free":
        out = w / f"llmc-free-g{g}"
        shutil.rmtree(out, ignore_errors=True)
        run = timed_script(LLMC_MODEL_FREE, [str(TINY), str(out), str(g)], w, llmc_py)
        ev.submit("llmc model_free_ptq (experts only)", g, "experts_only", out, run, key=k)
        ev.submit("llmc model_free_ptq (as written, BF16 rest)", g, "as_written", out, None, key=k + "_written")
    elif k == "bf16":
        ev.submit("BF16 copy of the source (llm-compressor's input), no INT4", 0, "as_written", w / "bf16", None, key=k)


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


def header(a, llmc_py: str | None) -> list[str]:
    import torch
    import transformers
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    commit = (SHARED / "COMMIT").read_text().strip() if (SHARED / "COMMIT").exists() else subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    peer = ""
    if llmc_py:
        r = subprocess.run([llmc_py, "-c", "import importlib.metadata as m, torch; print(m.version('llmcompressor'), "
                            "m.version('compressed-tensors'), torch.__version__)"], capture_output=True, text=True)
        peer = (f"; llm-compressor {r.stdout.split()[0]}, compressed-tensors {r.stdout.split()[1]}, its torch "
                f"{r.stdout.split()[2]}" if r.returncode == 0 and len(r.stdout.split()) == 3
                else f"; llm-compressor: not importable ({(r.stderr.strip().splitlines() or ['?'])[-1][:120]})")
    cmd = " ".join(["python", "benchmarks/quality.py", *sys.argv[1:]])
    return [f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by `{cmd}`; kq {commit or '?'}; "
            f"{gpu}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}{peer}.",
            f"Model {TINY.name}; eval 48 x 256 tokens of eval_text (CPU float32) against the FP8 source; "
            f"calibration {a.samples} x {a.seqlen} tokens of calibration_text; kq GPTQ on {a.device}, kq RTN on "
            f"{a.rtn_device}" + (", llm-compressor oneshot on the GPU" if a.device == "cuda" else "") + "."]


def acceptance(rows: list[dict]) -> list[str]:
    """Issue #4's ratios per group: each kq GPTQ row against kq RTN absmax, the naive absmax and
    llm-compressor's oneshot GPTQ (experts only: the like-for-like row)."""
    out = []
    by = {(r.get("key"), r["group"]): r for r in rows if "kl" in r}
    for g in sorted({r["group"] for r in rows if r["group"]}):
        ab, nv, lc = by.get(("absmax", g)), by.get(("naive", g)), by.get(("llmc_gptq", g))
        for k in GPTQ_VARIANTS:
            r = by.get((k, g))
            if not r:
                continue
            parts = [f"g{g} {k}: KL {r['kl']:.5f}"]
            if ab:
                ok = r["kl"] <= 0.75 * ab["kl"] and r["top1"] > ab["top1"]
                parts.append(f"{r['kl'] / ab['kl']:.3f}x kq absmax (top-1 {r['top1'] * 100:.2f}% vs "
                             f"{ab['top1'] * 100:.2f}%) {'PASS' if ok else 'FAIL'} (<= 0.75x, top-1 above)")
            if nv:
                parts.append(f"{r['kl'] / nv['kl']:.3f}x naive absmax")
            if lc:
                parts.append(f"{r['kl'] / lc['kl']:.3f}x llmc oneshot {'PASS' if r['kl'] <= 1.02 * lc['kl'] else 'FAIL'}"
                             f" (<= 1.02x)")
            out.append("- " + "; ".join(parts))
    # Issue #22: kq AWQ against llm-compressor's AWQ (like for like: the up->down row, experts only), and
    # the best of awq / awq+gptq / gptq against 0.95x kq GPTQ's KL of record (0.00807 at g32, 0.00948 at g128).
    record = {32: 0.00807, 128: 0.00948}
    for g in sorted({r["group"] for r in rows if r["group"]}):
        aw, lc = by.get(("awq", g)), by.get(("llmc_awq_ud", g))
        if aw and lc:
            out.append(f"- g{g} awq: KL {aw['kl']:.5f} vs llmc AWQ (up->down, experts only) {lc['kl']:.5f}: "
                       f"{aw['kl'] / lc['kl']:.3f}x {'PASS' if aw['kl'] <= lc['kl'] else 'FAIL'} (<= 1x)")
        cands = [(by[(k, g)]["kl"], k) for k in ("awq", "awq_gptq", "gptq") if (k, g) in by]
        if cands and g in record:
            kl, k = min(cands)
            line = (f"- g{g} best of awq/awq+gptq/gptq: {k} {kl:.5f} = {kl / record[g]:.3f}x the record "
                    f"{record[g]} {'PASS' if kl <= 0.95 * record[g] else 'FAIL'} (<= 0.95x)")
            # the record does not reproduce (kq 70df999's own code gives 0.00849 at g32 today, the same
            # bytes as later commits; docs/eval-awq.md): the same run's GPTQ is the like-for-like reference
            if ("gptq", g) in by:
                line += f"; {kl / by[('gptq', g)]['kl']:.3f}x this run's GPTQ"
            out.append(line)
    return out


def write_table(rows: list[dict], a) -> None:
    lines = [*a.header, "",
             "| method | group | KL (nats/token) | top-1 | ppl | quantize s | peak RSS MB | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl = f"{r['kl']:.5f}" if "kl" in r else ""
        t1 = f"{r['top1'] * 100:.2f}%" if "top1" in r else ""
        ppl = f"{r['ppl_quantized']:.3f}" if "ppl_quantized" in r else ""
        s = f"{r['seconds']:.1f}" if "seconds" in r else ""
        m = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else ""
        lines.append(f"| {r['method']} | {r['group'] or ''} | {kl} | {t1} | {ppl} | {s} | {m} | {r.get('note', '')} |")
    src = next((r["ppl_source"] for r in rows if "ppl_source" in r), None)
    if src:
        lines += ["", f"Perplexity of the FP8 source on the same tokens: {src:.3f}."]
    acc = acceptance(rows)
    if acc:
        lines += ["", "Issue #4 acceptance (KL ratios; same run, same tokens):", *acc]
    if getattr(a, "skipped", None):
        lines += ["", "Not run (deadline) or not finished: " + ", ".join(a.skipped) + "."]
    text = "\n".join(lines) + "\n"
    if rows:
        print(lines[4 + len(rows)], flush=True)
    (a.work / "quality.json").write_text(json.dumps(rows, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)


if __name__ == "__main__":
    main()
