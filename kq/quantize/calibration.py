"""Calibration tokens for GPTQ: local text or pre-tokenized ids, the checkpoint's tokenizer.

Accepted files (gzip ok): .txt (one document), .jsonl with a "text" field (one
document per line), or .jsonl with an "input_ids" list of ints per line (already
tokenized). `--calib` is a local file, or, when no such path exists, a Hub dataset
`org/name[@revision][:path/in/repo]`: that one file is downloaded (huggingface_hub,
into the user's HF cache); without `:path`, every .txt/.jsonl(.gz) file of the
dataset repo is used, in sorted order, one after another (Parquet is refused). Documents are joined into one token stream with the model's EOS token
between them; `samples` windows of `seqlen` tokens are taken at evenly spaced
offsets over the whole stream, so a file that is several corpora one after another
(e.g. the Bible, then fortunes) is sampled across all of them, deterministically.
"""
from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

import torch

from kq.errors import KqError
from kq.model.text import join_ids, read_documents, tokenize

_TEXT_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
_HUB_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^:@]+))?(?::(?P<path>.+))?$")


def _hub_files(spec: str, repo_id: str, revision: str | None, path: str | None) -> tuple[Path, ...]:
    from huggingface_hub import HfApi, hf_hub_download

    from kq.checkpoint.hub import _hub_error, check_filename

    def fail(err: BaseException, filename: str | None = None) -> KqError:
        e = _hub_error(err, repo_id, revision, filename)
        return KqError(f"--calib {spec}: no such local file; as a Hub dataset: {e}")

    if path is None:
        try:
            names = HfApi().list_repo_files(repo_id, repo_type="dataset", revision=revision)
        except Exception as err:
            raise fail(err) from None
        path_list = sorted(n for n in names if n.endswith(_TEXT_SUFFIXES))
        if not path_list:
            parquet = any(n.endswith(".parquet") for n in names)
            raise KqError(f"--calib {spec}: the dataset has no .txt/.jsonl(.gz) file"
                          + (" (Parquet is not supported: convert it to .jsonl with a \"text\" field)" if parquet else "")
                          + (f"; files: {', '.join(sorted(names)[:10])}" if names else ""))
    else:
        if path.endswith(".parquet"):
            raise KqError(f"--calib {spec}: Parquet is not supported: use a .txt/.jsonl(.gz) file "
                          "(convert it to .jsonl with a \"text\" field)")
        if not path.endswith(_TEXT_SUFFIXES):
            raise KqError(f"--calib {spec}: {path} is not a .txt/.jsonl(.gz) file")
        path_list = [path]
    out = []
    for name in path_list:
        check_filename(name)
        try:
            out.append(Path(hf_hub_download(repo_id, name, repo_type="dataset", revision=revision)))
        except Exception as err:
            raise fail(err, name) from None
    return tuple(out)


@lru_cache(maxsize=8)
def resolve_calib(spec: str | Path) -> tuple[Path, ...]:
    """The local file(s) behind --calib: the path itself, or a Hub dataset's text file(s)."""
    p = Path(spec)
    if p.is_file():
        return (p,)
    if p.exists():
        raise KqError(f"--calib {spec}: not a file")
    m = _HUB_SPEC.match(str(spec))
    if m is None:
        raise KqError(f"--calib {spec}: no such file (or Hub dataset org/name[@revision][:path/in/repo])")
    return _hub_files(str(spec), m["repo"], m["rev"], m["path"])


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


def _file_stream(folder: str | Path, config: dict, path: Path, eos: int | None) -> list[int]:
    try:
        pre = _pretokenized(path)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise KqError(f"--calib {path}: cannot read it ({e})") from None
    if pre is not None:
        stream = join_ids(pre, eos)
        vocab = config.get("vocab_size")
        if vocab and stream and max(stream) >= vocab:
            raise KqError(f"--calib {path}: token id {max(stream)} is outside the model's vocabulary of {vocab}")
        return stream
    return tokenize(folder, read_documents(path), eos_between=eos)


def token_stream(folder: str | Path, config: dict, path: str | Path) -> list[int]:
    """The calibration file(s) as one token stream, EOS between documents (and files)."""
    eos = _eos(config)
    return join_ids((_file_stream(folder, config, f, eos) for f in resolve_calib(str(path))), eos)


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
