"""`kq eval` as a function: open both checkpoints, tokenize the text, compare, record.

The result is also written to OUT/kq-eval.json (the publish helper puts it on the
model card), atomically, so a folder never holds half a result.
"""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Callable

import torch

from kq import __version__
from kq.checkpoint.manifest import write_json_atomic
from kq.checkpoint.reader import CheckpointReader
from kq.errors import KqError
from kq.eval.compare import compare, compare_many
from kq.model import LayerwiseModel
from kq.model.text import read_documents, tokenize, windows

from kq.format import EVAL_NAME  # noqa: E402
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ACTIVATIONS = ("none", "fp8")
# The FP8-activation variants `--activations fp8` adds beside W4A16 (kq.eval.fp8_act).
FP8_VARIANTS = {"fp8_token": "token", "fp8_tensor": "tensor"}


def eval_ids(folder: Path, text: Path, seqs: int, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seqs*seqlen tokens of the text (one token stream, no BOS added) as seqs
    windows, and the token following each position."""
    return windows(tokenize(folder, read_documents(text)), seqs, seqlen, what=str(text))


def check_inputs(out: Path, dtype: str, activations: str = "none") -> CheckpointReader:
    """What can be refused before the source is opened (a Hub source is downloaded first); returns
    the quantized checkpoint's reader."""
    if dtype not in DTYPES:
        raise KqError(f"--dtype {dtype}: use float32 or bfloat16")
    if activations not in ACTIVATIONS:
        raise KqError(f"--activations {activations}: use none or fp8")
    reader = CheckpointReader(out)  # a folder with config.json and its shards' index, or one clear line
    if activations == "fp8" and not any(n.endswith("mlp.experts.0.gate_proj.weight_packed") for n in reader.names()):
        raise KqError(f"--activations fp8: {out} has no INT4 (packed) routed experts to run with FP8 activations")
    return reader


def kv_cache_figures(out_reader: CheckpointReader, src: LayerwiseModel, ids, targets, *, dtype, device, batch,
                     on_layer=None) -> dict:
    """KL/top-1 of the quantized model against the source with an emulated FP8 KV cache, per scale mode."""
    from kq.eval.kvcache import MODES, emulate_fp8_kv
    from kq.quantize.kv_scales import read_scales
    scales = read_scales(out_reader, src.num_layers)
    out = {"scales": scales}
    for mode in MODES:
        if mode == "calibrated" and scales is None:
            continue
        q = emulate_fp8_kv(LayerwiseModel(out_reader, dtype=dtype, device=device), mode, scales)
        r = compare(src, q, ids, targets, batch=batch, on_layer=on_layer).summary
        out[mode] = {k: r[k] for k in ("kl", "top1", "ppl_quantized")}
    return out


def evaluate(out: Path, against: Path, text: Path, *, seqs: int = 48, seqlen: int = 256, batch: int = 8,
             dtype: str = "float32", device: str = "cpu", write: bool = True, source_name: str | None = None,
             on_layer: Callable[[int, int], None] | None = None, activations: str = "none",
             pair_prompt: int | None = None, mtp: bool = False, kv_cache: str | None = None) -> dict:
    """activations "fp8": also the routed experts with FP8 input activations (per-token and
    per-tensor scales, kq.eval.fp8_act), under record["activations"], beside the W4A16 figures;
    pair_prompt: also run the disaggregated pair (kq.eval.pair) with this many prompt tokens per window;
    mtp: also the MTP draft's acceptance of both checkpoints (kq.eval.mtp, one more pass of each);
    kv_cache "fp8": also the quantized model on an emulated FP8 KV cache (kq.eval.kvcache), one run per scale."""
    out, against = Path(out), Path(against)
    out_reader = check_inputs(out, dtype, activations)
    if out.resolve() == against.resolve():
        raise KqError("--against names the same folder as the checkpoint to evaluate")
    src = LayerwiseModel(CheckpointReader(against), dtype=DTYPES[dtype], device=device)
    models = {"none": LayerwiseModel(out_reader, dtype=DTYPES[dtype], device=device)}
    if activations == "fp8":
        from kq.eval.fp8_act import fp8_act_hook
        for key, mode in FP8_VARIANTS.items():
            models[key] = LayerwiseModel(out_reader, dtype=DTYPES[dtype], device=device, on_load=fp8_act_hook(mode))
    ids, targets = eval_ids(against, text, seqs, seqlen)
    q = models["none"]
    if pair_prompt is not None:
        from kq.eval.pair import compare_pair
        res = compare_pair(src, q, ids, targets, prompt=pair_prompt, batch=batch, on_layer=on_layer)
        fp8 = {k: m for k, m in models.items() if k != "none"}
        results = compare_many(src, fp8, ids, targets, batch=batch, on_layer=on_layer) if fp8 else {}
        results["none"] = res
    else:
        results = compare_many(src, models, ids, targets, batch=batch, on_layer=on_layer)
        res = results["none"]
    if mtp:
        from kq.eval.mtp import mtp_report
        res.notes["mtp"] = mtp_report(src, q, ids, targets, batch=batch, on_layer=on_layer)
    if kv_cache:
        res.notes["kv_cache"] = kv_cache_figures(out_reader, src, ids, targets, dtype=DTYPES[dtype], device=device,
                                                 batch=batch, on_layer=on_layer)
    record = {
        "kq_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": str(out), "source": source_name or str(against), "text": str(text), "dtype": dtype, "device": device,
        "metric": "KL(source||quantized) nats/token, top-1 agreement and perplexity of the next token, "
                  "over all seqs x seqlen positions",
        **res.as_dict(),
    }
    if activations == "fp8":
        record["activations"] = {
            "none": "W4A16: the top-level figures (activations in --dtype)",
            **{k: {**results[k].summary, "scale": FP8_VARIANTS[k], "kl_vs_w4a16": results[k].summary["kl"] / res.summary["kl"]
                   if res.summary["kl"] > 0 else None}
               for k in FP8_VARIANTS},
            "emulation": "routed experts' inputs quantized to e4m3 with scale amax/448 (per token, or one amax "
                         f"per tensor per forward call of {batch} windows), exact INT4 codes, group scales on "
                         "fp32 partial sums per K group",
        }
    if write:
        write_json_atomic(out / EVAL_NAME, record)
    return record
