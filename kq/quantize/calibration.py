"""Calibration tokens for GPTQ: local text or pre-tokenized ids, the checkpoint's tokenizer.

Accepted files (gzip ok): .txt (one document), .jsonl with a "text" field (one
document per line), or .jsonl with an "input_ids" list of ints per line (already
tokenized). Documents are joined into one token stream with the model's EOS token
between them; `samples` windows of `seqlen` tokens are taken at evenly spaced
offsets over the whole stream, so a file that is several corpora one after another
(e.g. the Bible, then fortunes) is sampled across all of them, deterministically.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from kq.errors import KqError
from kq.model.text import read_documents, tokenize


def _eos(config: dict) -> int | None:
    e = config.get("eos_token_id")
    if isinstance(e, list):
        e = e[0] if e else None
    return e if isinstance(e, int) else None


def _pretokenized(path: Path) -> list[list[int]] | None:
    """The id lists of a .jsonl(.gz) of {"input_ids": [...]} records, else None."""
    name = path.name.removesuffix(".gz")
    if not name.endswith(".jsonl"):
        return None
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        first = next((ln for ln in f if ln.strip()), None)
    if first is None or "input_ids" not in json.loads(first):
        return None
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                ids = json.loads(line).get("input_ids")
                if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise KqError(f"{path}:{n}: \"input_ids\" must be a list of non-negative ints")
                out.append(ids)
    return out


def token_stream(folder: str | Path, config: dict, path: str | Path) -> list[int]:
    path = Path(path)
    if not path.is_file():
        raise KqError(f"--calib {path}: no such file")
    eos = _eos(config)
    try:
        pre = _pretokenized(path)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise KqError(f"--calib {path}: cannot read it ({e})") from None
    if pre is not None:
        stream: list[int] = []
        for i, ids in enumerate(pre):
            if i and eos is not None:
                stream.append(eos)
            stream.extend(ids)
        vocab = config.get("vocab_size")
        if vocab and stream and max(stream) >= vocab:
            raise KqError(f"--calib {path}: token id {max(stream)} is outside the model's vocabulary of {vocab}")
        return stream
    return tokenize(folder, read_documents(path), eos_between=eos)


def calibration_ids(folder: str | Path, config: dict, path: str | Path, samples: int, seqlen: int) -> torch.Tensor:
    """[samples, seqlen] int64 windows spread evenly over the calibration token stream."""
    if samples < 1 or seqlen < 2:
        raise KqError(f"--calib-samples/--calib-seqlen: need at least 1 x 2 tokens (got {samples} x {seqlen})")
    maxpos = config.get("max_position_embeddings")
    if maxpos and seqlen > maxpos:
        raise KqError(f"--calib-seqlen {seqlen} is longer than the model's max_position_embeddings {maxpos}")
    ids = token_stream(folder, config, path)
    if len(ids) < samples * seqlen:
        raise KqError(f"--calib {path}: {len(ids)} tokens, fewer than --calib-samples {samples} x --calib-seqlen "
                      f"{seqlen} = {samples * seqlen}; give more text or ask for fewer tokens")
    t = torch.tensor(ids, dtype=torch.int64)
    # Offsets k * (len - seqlen) / (samples - 1), k = 0..samples-1: first and last window included.
    span = len(ids) - seqlen
    starts = [0] if samples == 1 else [(k * span) // (samples - 1) for k in range(samples)]
    return torch.stack([t[s:s + seqlen] for s in starts])
