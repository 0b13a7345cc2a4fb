"""Text in, token windows out: the checkpoint's own tokenizer, no remote code.

Files: .txt (the whole file is one document) or .jsonl (one document per line, its
"text" field), either optionally gzip-compressed. A folder's `tokenizer.json` is
loaded with the `tokenizers` library; a folder with only Kimi's `tiktoken.model` is
loaded with the `tiktoken` package (`pip install 'kq[kimi]'`), its split regex taken
from the family recipe (`tiktoken_pattern`), no special tokens added. Nothing from the
checkpoint is executed.
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


# As Moonshot's (and Llama 3's) tiktoken tokenizers do before encoding: at most 400k
# characters per call, and no run of more than 25k whitespace / non-whitespace characters.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000


def _tiktoken_pieces(s: str):
    for i in range(0, len(s), _TIKTOKEN_MAX_CHARS):
        chunk = s[i:i + _TIKTOKEN_MAX_CHARS]
        start, run, space = 0, 0, chunk[:1].isspace()
        for j, ch in enumerate(chunk):
            if ch.isspace() != space:
                space, run = not space, 1
            else:
                run += 1
                if run > _TIKTOKEN_MAX_RUN:
                    yield chunk[start:j]
                    start, run = j, 1
        yield chunk[start:]


class _TiktokenTokenizer:
    """Kimi's tiktoken.model through the `tiktoken` package, ids only (no special tokens)."""

    def __init__(self, path: Path, pattern: str):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise KqError(f"{path.parent}: its tokenizer is tiktoken.model, which needs the tiktoken package: "
                          "pip install 'kq[kimi]'") from None
        try:
            ranks = load_tiktoken_bpe(str(path))
            self.enc = tiktoken.Encoding(name=f"kq-{path.parent.name}", pat_str=pattern,
                                         mergeable_ranks=ranks, special_tokens={})
        except Exception as e:  # bad base64 / rank lines, or a pattern fancy-regex refuses
            raise KqError(f"{path}: not a usable tiktoken ranks file ({type(e).__name__}: {e})") from None
        self.n_vocab = len(ranks)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _tiktoken_pieces(text):
            ids.extend(self.enc.encode_ordinary(piece))
        return ids


def _tiktoken_pattern(folder: Path) -> str:
    from kq.recipes import recipe_for_config
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KqError(f"{folder}: has tiktoken.model but no readable config.json to pick the split pattern ({e})") from None
    recipe = recipe_for_config(config)
    if not recipe.tiktoken_pattern:
        raise KqError(f"{folder}: has tiktoken.model but the {recipe.family} recipe has no tiktoken_pattern; "
                      "pass pre-tokenized ids instead")
    return recipe.tiktoken_pattern


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer: tokenizer.json (tokenizers), else tiktoken.model (tiktoken)."""
    folder = Path(folder)
    f = folder / "tokenizer.json"
    if f.is_file():
        from tokenizers import Tokenizer
        try:
            return Tokenizer.from_file(str(f))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise KqError(f"{f}: not a valid tokenizer.json ({e})") from None
    t = folder / "tiktoken.model"
    if t.is_file():
        return _TiktokenTokenizer(t, _tiktoken_pattern(folder))
    raise KqError(f"{folder}: no tokenizer.json or tiktoken.model (kq tokenizes with the checkpoint's own "
                  "tokenizer; pass pre-tokenized ids instead)")


def join_ids(seqs, sep: int | None) -> list[int]:
    """Token id sequences as one stream, `sep` (the model's EOS; None: nothing) between them."""
    out: list[int] = []
    for i, ids in enumerate(seqs):
        if i and sep is not None:
            out.append(sep)
        out.extend(ids)
    return out


def tokenize(folder: str | Path, docs: list[str], eos_between: int | None = None) -> list[int]:
    """All documents as one token stream (no special tokens added: the tokenizer's own
    post-processor decides, as when the model was trained; tiktoken.model adds none);
    `eos_between` separates them."""
    tok = load_tokenizer(folder)
    if isinstance(tok, _TiktokenTokenizer):
        encoded = [tok.encode(d) for d in docs]
    else:
        encoded = [enc.ids for enc in tok.encode_batch(docs, add_special_tokens=True)]
    return join_ids(encoded, eos_between)


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
