"""Tiny but valid tokenizer files: a byte-level BPE `tokenizer.json` (GLM families) and a
tiktoken ranks file `tiktoken.model` (Kimi). Both come from the same few BPE merges
learned here from a fixed sentence, so they are deterministic and load in the real
libraries (tokenizers; tiktoken's `load_tiktoken_bpe` format: base64 token, space, rank).
"""

from __future__ import annotations

import base64
import json
from collections import Counter

MAX_MERGES = 48

SAMPLE = (
    "the quick brown fox jumps over the lazy dog and then the dog sleeps in the sun; "
    "in the beginning there was the word, and the word was quantized to four bits."
)


def byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def learn_merges(n: int = MAX_MERGES) -> list[tuple[bytes, bytes]]:
    """Plain BPE over SAMPLE's words (space glued to the following word). Ties break on
    the byte strings, so the result never depends on dict order."""
    words = Counter()
    for i, w in enumerate(SAMPLE.split(" ")):
        words[tuple(bytes([c]) for c in ((" " if i else "") + w).encode())] += 1
    merges = []
    for _ in range(n):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], [-x for x in kv[0][0] + kv[0][1]]))[0]
        merges.append(best)
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return merges


def merges_that_fit(room: int) -> int:
    """How many merges fit in `room` ids beyond the 256 byte tokens (and the specials)."""
    if room < 0:
        raise ValueError(f"vocab too small for a byte-level tokenizer: {-room} ids short")
    return min(MAX_MERGES, room)


def tokenizer_json(specials: list[str], vocab_size: int) -> str:
    """HF tokenizers byte-level BPE; special tokens take ids 0..len(specials)-1. Every id
    stays below the model's vocab_size."""
    bu = byte_unicode()
    enc = lambda bs: "".join(bu[b] for b in bs)  # noqa: E731
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[bu[b]] = len(vocab)
    merges = learn_merges(merges_that_fit(vocab_size - len(vocab)))
    for a, b in merges:
        vocab.setdefault(enc(a + b), len(vocab))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[enc(a), enc(b)] for a, b in merges],
        },
    }
    return json.dumps(doc, indent=2, ensure_ascii=False)


def tiktoken_model(n_merges: int = MAX_MERGES) -> tuple[str, int]:
    """-> (file text, number of ranks). Ranks 0..255 are the single bytes."""
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for a, b in learn_merges(n_merges):
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(tokens)]
    return "\n".join(lines) + "\n", len(tokens)
