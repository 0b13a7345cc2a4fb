"""Text in, token windows out: the checkpoint's own tokenizer, no remote code.

Files: .txt (the whole file is one document) or .jsonl (one document per line, its
"text" field), either optionally gzip-compressed. A folder's `tokenizer.json` is
loaded with the `tokenizers` library; nothing from the checkpoint is executed.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from kq.errors import KqError


def read_documents(path: str | Path) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise KqError(f"{p}: no such text file")
    name = p.name[:-3] if p.name.endswith(".gz") else p.name
    opener = gzip.open if p.name.endswith(".gz") else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            if name.endswith(".jsonl"):
                docs = []
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise KqError(f"{p}:{n}: not a JSON line ({e.msg})") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise KqError(f"{p}:{n}: a .jsonl line needs a string \"text\" field")
                    docs.append(rec["text"])
                return docs
            return [f.read()]
    except (OSError, EOFError, UnicodeDecodeError) as e:
        if isinstance(e, KqError):
            raise
        raise KqError(f"{p}: cannot read it as {'gzip-compressed ' if opener is gzip.open else ''}UTF-8 text ({e})") from None


def load_tokenizer(folder: str | Path):
    from tokenizers import Tokenizer
    f = Path(folder) / "tokenizer.json"
    if not f.is_file():
        raise KqError(f"{folder}: no tokenizer.json (kq tokenizes with the checkpoint's own tokenizer.json; "
                      "pass pre-tokenized ids instead)")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        raise KqError(f"{f}: not a valid tokenizer.json ({e})") from None


def tokenize(folder: str | Path, docs: list[str], eos_between: int | None = None) -> list[int]:
    """All documents as one token stream (no special tokens added: the tokenizer's own
    post-processor decides, as when the model was trained); `eos_between` separates them."""
    tok = load_tokenizer(folder)
    ids: list[int] = []
    for i, enc in enumerate(tok.encode_batch(docs, add_special_tokens=True)):
        if i and eos_between is not None:
            ids.append(eos_between)
        ids.extend(enc.ids)
    return ids


def windows(ids: list[int], seqs: int, seqlen: int, what: str = "text") -> tuple[torch.Tensor, torch.Tensor]:
    """The first seqs*seqlen tokens cut into seqs consecutive windows, and each token's
    successor: (inputs [seqs, seqlen], targets [seqs, seqlen]); needs seqs*seqlen+1 tokens."""
    if seqs < 1 or seqlen < 1:
        raise KqError(f"need at least 1 sequence of at least 1 token (got {seqs} x {seqlen})")
    need = seqs * seqlen + 1
    if len(ids) < need:
        raise KqError(f"the {what} has {len(ids)} tokens, fewer than the {seqs} x {seqlen} + 1 = {need} needed; "
                      f"use fewer or shorter sequences")
    t = torch.tensor(ids[:need], dtype=torch.int64)
    return t[:-1].view(seqs, seqlen), t[1:].view(seqs, seqlen)
