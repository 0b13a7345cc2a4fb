"""The model card (README.md) of a kq checkpoint, written from the run's own records only.

Every number on the card comes from a file the run wrote: `kq-manifest.json` (source,
options, sizes, tensor classes), `config.json` (the expert intermediate size behind the TP
rules) and, when present, `kq-eval.json` (`kq eval`'s results).  Nothing is estimated here.

A card kq wrote ends with a marker holding the sha256 of the text above it.  A README.md
without a matching marker (no marker, or edited since) is the user's, and is only replaced
with `overwrite=True`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml

from kq.errors import KqError
from kq.format import EVAL_NAME, MANIFEST_NAME, MARLIN_TILE, TP_DEGREES, split_failures, write_text_atomic

CARD_NAME = "README.md"
_MARKER = re.compile(r"\n<!-- kq-card sha256:([0-9a-f]{64}) -->\n?$")


def _load_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KqError(f"{path.parent}: no {path.name}: not a finished kq checkpoint ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KqError(f"{path}: not valid JSON ({e})") from None


def _gb(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= 1e8:
        return f"{n / 1e9:,.2f} GB"
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n:,} B"


def _calib_text(calib) -> str:
    # The run records it as a name or as a dict (file, sha256, samples, tokens, ...): show it as recorded.
    if isinstance(calib, dict):
        return ", ".join(f"{k}: {v}" for k, v in calib.items())
    return str(calib)


def _exact(n: int | None) -> str:
    return "n/a" if n is None else f"{_gb(n)} ({n:,} bytes)"


def _tp_rows(intermediate: int | None, group: int) -> list[str]:
    if not intermediate:
        return ["| – | config.json has no `moe_intermediate_size` | – |"]
    rows = []
    for tp in TP_DEGREES:
        bad = split_failures(intermediate, tp, group)
        if bad is None:
            rows.append(f"| {tp} | – | no: {intermediate} does not split {tp} ways |")
            continue
        per = intermediate // tp
        rows.append(f"| {tp} | {per} | {'no: ' + '; '.join(bad) if bad else 'yes'} |")
    return rows


# The summary keys `kq eval` records (kq/eval/run.py), in the order a reader wants them.
_EVAL_KEYS = (
    ("kl", "KL(source ‖ quantized), nats/token"),
    ("top1", "top-1 agreement with the source"),
    ("ppl_source", "perplexity, source"),
    ("ppl_quantized", "perplexity, this checkpoint"),
)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _eval_section(ev: dict) -> list[str]:
    """`kq eval`'s numbers exactly as recorded in kq-eval.json."""
    rows = [(label, ev[k]) for k, label in _EVAL_KEYS if isinstance(ev.get(k), (int, float))]
    if not rows:  # another layout: every numeric leaf, as recorded
        def walk(prefix: str, v) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), x)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                rows.append((prefix, v))

        walk("", ev)
    if not rows:
        return []
    out = ["## Evaluation", "", f"From `{EVAL_NAME}`, written by `kq eval` for this checkpoint.", "",
           "| metric | value |", "|---|---|", *[f"| {k} | {_fmt(v)} |" for k, v in rows], ""]
    how = [f"{ev['seqs']} windows of {ev['seqlen']} tokens" if "seqs" in ev and "seqlen" in ev else None,
           f"text `{Path(str(ev['text'])).name}`" if ev.get("text") else None,
           f"compared against `{ev['source']}`" if ev.get("source") else None,
           f"{ev['dtype']} on {ev.get('device', '?')}" if ev.get("dtype") else None,
           f"kq {ev['kq_version']}" if ev.get("kq_version") else None,
           ev.get("created")]
    how = [h for h in how if h]
    if how:
        out += ["Measured on " + ", ".join(how) + ".", ""]
    return out


def render_card(out_dir: Path, repo_id: str | None = None, revision: str | None = None) -> str:
    """The card text for the checkpoint in out_dir (published as repo_id, on branch revision, when known)."""
    out_dir = Path(out_dir)
    m = _load_json(out_dir / MANIFEST_NAME, "run `kq quantize` first")
    cfg = _load_json(out_dir / "config.json", "config.json is missing")
    ev_path = out_dir / EVAL_NAME
    ev = _load_json(ev_path, "") if ev_path.exists() else None

    src, opts, sizes = m.get("source", {}), m.get("options", {}), m.get("sizes", {})
    base = src.get("repo_id")
    family = src.get("family")
    model_type = src.get("model_type") or cfg.get("model_type")
    group = opts.get("group_size")
    method = opts.get("method", "rtn")
    name = repo_id or out_dir.resolve().name
    model_ref = (repo_id or str(out_dir)) + (f" --revision {revision}" if repo_id and revision else "")

    meta: dict = {}
    if base:
        meta["base_model"] = base
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = "text-generation"
    fp8_act = opts.get("activations") == "fp8"
    meta["tags"] = [t for t in dict.fromkeys(
        ["compressed-tensors", "int4", "w4afp8" if fp8_act else "w4a16", family, model_type, "sglang", "kq"]) if t]

    calib = opts.get("calibration") or opts.get("calib")
    mtp = opts.get("mtp_experts")
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
        f"# {name}", "",
        ("INT4 weights with dynamic FP8 input activations (W4AFP8) for the routed experts of " if fp8_act
         else "INT4 weight-only (W4A16) quantization of the routed experts of ")
        + (f"[{base}](https://huggingface.co/{base})" if base else f"`{src.get('name', 'a local checkpoint')}`")
        + f"; every other tensor is kept exactly as in the source. Made with kq {m.get('kq_version', '?')}"
        + (f" on {m['created']}" if m.get("created") else "") + ".", "",
        "## What was quantized and what was kept", "",
        "| tensors | count | source bytes | output bytes |", "|---|---|---|---|",
    ]
    for cls, c in (m.get("classes") or {}).items():
        lines.append(f"| {cls} | {c.get('tensors', '')} | {_gb(c.get('source_bytes'))} | {_gb(c.get('output_bytes'))} |")
    lines += [
        "",
        "Routed experts (`mlp.experts.E.{gate,up,down}_proj`) are stored as compressed-tensors "
        "`pack-quantized` (`weight_packed` int32, `weight_scale` bf16, `weight_shape`). Attention, shared "
        "experts, dense MLPs, routers, norms, embeddings and `lm_head` keep their source bytes "
        "(FP8 block weights keep their F32 block scales, renamed `weight_scale`)."
        + (f" MTP-layer experts: {mtp}." if mtp else ""),
        "",
        "## Method", "",
        f"- method: {method}" + (f" (clipping: {opts['clip']})" if opts.get("clip") else ""),
        f"- symmetric INT4, group size {group}, BF16 scales",
        *(["- expert input activations: dynamic FP8 (e4m3), per token, in config.json only: the tensors are "
           "those of the W4A16 checkpoint"] if fp8_act else []),
        f"- calibration data: {_calib_text(calib) if calib else 'none (' + method.upper() + ' uses the weights only)'}",
        "",
        "## Size", "",
        "| | bytes |", "|---|---|",
        f"| source checkpoint | {_exact(sizes.get('source_bytes'))} |",
        f"| this checkpoint | {_exact(sizes.get('output_bytes'))} |",
        f"| weights per GPU at TP 8 | {_exact(sizes.get('per_gpu_bytes_tp8'))} |",
        "",
        "## Serving with SGLang", "",
        "```",
        f"python -m sglang.launch_server --model-path {model_ref} --tp 8 --disable-shared-experts-fusion",
        "```", "",
        "`--disable-shared-experts-fusion` keeps SGLang from fusing the FP8 shared expert into the INT4 "
        "routed-expert kernel (it would load FP8 tensors into INT4 slots).", "",
        "## Tensor parallelism and group size", "",
        "SGLang splits each expert's intermediate dimension I across TP ranks; each rank's slice must be a "
        f"multiple of the group size ({group}) and of {MARLIN_TILE} (Marlin MoE kernel), or loading fails at serve time.", "",
        f"| TP | I/TP (I = {cfg.get('moe_intermediate_size', '?')}) | valid |", "|---|---|---|",
        *_tp_rows(cfg.get("moe_intermediate_size"), group or 1),
        "",
    ]
    if ev:
        lines += _eval_section(ev)
    lines += [
        "## Files", "",
        f"`{MANIFEST_NAME}` lists every file with its sha256 and every tensor with its dtype and shape; "
        f"`kq verify` checks a download against it.", "",
    ]
    body = "\n".join(lines)
    return body + f"\n<!-- kq-card sha256:{hashlib.sha256(body.encode()).hexdigest()} -->\n"


def is_kq_card(text: str) -> bool:
    """True if text is a card kq wrote and nobody edited since."""
    m = _MARKER.search(text)
    return bool(m) and hashlib.sha256(text[: m.start()].encode()).hexdigest() == m[1]


def card_status(out_dir: Path) -> str:
    """'absent', 'kq' (ours, unedited: safe to regenerate) or 'user'."""
    p = Path(out_dir) / CARD_NAME
    if not p.exists():
        return "absent"
    try:
        return "kq" if is_kq_card(p.read_text()) else "user"
    except UnicodeDecodeError:
        return "user"


def write_card(out_dir: Path, repo_id: str | None = None, *, revision: str | None = None,
               overwrite: bool = False) -> tuple[Path, bool]:
    """Write README.md unless it is the user's own; returns (path, written)."""
    out_dir = Path(out_dir)
    path = out_dir / CARD_NAME
    text = render_card(out_dir, repo_id, revision)
    status = card_status(out_dir)
    if status == "user" and not overwrite:
        return path, False
    if status != "absent" and path.read_text() == text:
        return path, False
    write_text_atomic(path, text, tmp_name=f".{CARD_NAME}.tmp")
    return path, True
