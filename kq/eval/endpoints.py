"""Two running OpenAI-compatible servers compared token by token through /v1/completions.

What the API lets us measure. A server returns, for each token it generates, the token's
string and (if it supports `logprobs`) the top-k log-probabilities at that position; nothing
about the rest of the vocabulary. So:

- Both servers generate greedily (temperature 0) from the same prompt. Until their first
  differing token, both saw the same context, so each of those positions is a teacher-forced
  comparison on A's greedy path: KL and agreement there are exact comparisons of the two
  models on one context. The first differing token is a flip; after it the contexts differ
  and nothing more is compared. Flip rate = flips / positions compared (the per-token flip
  probability's maximum-likelihood estimate if flips are independent across positions).
- KL(A||B) per position from the two top-k lists (`topk_kl`): the vocabulary is coarse-grained
  into the tokens in both top-k lists plus one bucket for everything else, whose mass both
  sides know exactly (1 minus the listed mass). The KL of the coarse-grained distributions is
  exact and, by the log-sum inequality, never above the true KL: a lower bound whose gap is
  the divergence hidden inside the "everything else" bucket (small when the top-k lists cover
  nearly all the mass; zero at k = vocabulary size).
- Servers without `logprobs` (transformers serve ignores the field): `text_only` compares the
  returned texts, re-encoded with a local tokenizer; flips and positions as above, no KL.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from kq.errors import KqError


@dataclass
class Completion:
    text: str
    tokens: list[str] | None = None            # generated token strings (with logprobs only)
    top: list[dict[str, float]] | None = None  # per generated token: {token string: logprob}
    finish_reason: str | None = None


class Endpoint:
    """One server: POSTs with a timeout and bounded retries on connection errors and 5xx answers."""

    def __init__(self, url: str, *, model: str | None = None, timeout: float = 120.0, retries: int = 2):
        if not url.startswith(("http://", "https://")):
            raise KqError(f"{url}: not a server URL (expected http://HOST:PORT, optionally ending in /v1)")
        base = url.rstrip("/")
        self.url = url
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.timeout = timeout
        self.retries = retries
        self.model = model
        self._client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, body: dict | None = None, retries: int | None = None) -> dict:
        last = ""
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
            try:
                r = self._client.request(method, self.base + path, json=body)
            except httpx.TimeoutException:
                last = f"no answer within {self.timeout:g} s (--timeout)"
                continue
            except httpx.TransportError as e:
                last = f"cannot connect ({e.__class__.__name__}: {e})"
                continue
            if r.status_code >= 500:
                last = f"HTTP {r.status_code} from {path}: {r.text[:200]}"
                continue
            if r.status_code >= 400:
                raise KqError(f"{self.url}: HTTP {r.status_code} from {path}: {r.text[:300]}")
            try:
                return r.json()
            except ValueError:
                raise KqError(f"{self.url}: {path} did not answer JSON (is this an OpenAI-compatible server?)")
        raise KqError(f"{self.url}: {last} (after {retries + 1} tries)")

    def served_model(self) -> str | None:
        """The model name to send: --model-a/--model-b, else the first id /v1/models lists, else none
        (servers that serve one model accept requests without it)."""
        if self.model is None:
            try:
                # Optional endpoint (transformers serve answers it with HTTP 500): no retries.
                data = self._request("GET", "/models", retries=0).get("data") or []
                self.model = data[0].get("id") if data else None
            except KqError:
                pass  # an unreachable server is reported, with retries, by the first completion request
        return self.model

    def complete(self, prompt: str, *, max_tokens: int, top_k: int | None) -> Completion:
        body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if self.model:
            body["model"] = self.model
        if top_k:
            body["logprobs"] = top_k
        rec = self._request("POST", "/completions", body)
        try:
            choice = rec["choices"][0]
            text = choice["text"]
        except (KeyError, IndexError, TypeError):
            raise KqError(f"{self.url}: /v1/completions answered without choices[0].text: {str(rec)[:200]}")
        out = Completion(text=text, finish_reason=choice.get("finish_reason"))
        if top_k:
            lp = choice.get("logprobs") or {}
            tokens, top = lp.get("tokens"), lp.get("top_logprobs")
            if not tokens or not top or any(not t for t in top):
                raise KqError(f"{self.url}: the server returned no top-k logprobs (it ignores `logprobs` on "
                              "/v1/completions; transformers serve does); compare texts with --text-only "
                              "--tokenizer TOK")
            out.tokens, out.top = list(tokens), [dict(t) for t in top]
        return out


def topk_kl(p: dict[str, float], q: dict[str, float], *, floor: float = 1e-6) -> float:
    """KL(P||Q) in nats from two top-k logprob maps, over the tokens both list plus one bucket for the
    rest of the vocabulary (see the module docstring: a lower bound on the full-vocabulary KL).
    `floor` keeps a bucket's mass positive where rounding in the servers' logprobs drives it to 0."""
    both = p.keys() & q.keys()
    kl, p_in, q_in = 0.0, 0.0, 0.0
    for t in both:
        pt = math.exp(p[t])
        kl += pt * (p[t] - q[t])
        p_in += pt
        q_in += math.exp(q[t])
    p_rest, q_rest = max(1.0 - p_in, floor), max(1.0 - q_in, floor)
    kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


@dataclass
class PromptResult:
    positions: int          # positions compared (common greedy prefix, plus the flip if there is one)
    flipped: bool
    kl: list[float] = field(default_factory=list)  # per compared position (empty in text-only mode)
    shared_topk: int = 0    # positions whose two top-k lists share at least one token


def compare_greedy(a: Completion, b: Completion) -> PromptResult:
    """Positions of A's greedy path that both servers saw with the same context (see module docstring)."""
    n = min(len(a.tokens), len(b.tokens))
    res = PromptResult(positions=0, flipped=False)
    for i in range(n):
        res.positions += 1
        res.kl.append(topk_kl(a.top[i], b.top[i]))
        res.shared_topk += bool(a.top[i].keys() & b.top[i].keys())
        if a.tokens[i] != b.tokens[i]:
            res.flipped = True
            break
    if not res.flipped and len(a.tokens) != len(b.tokens):
        res.positions += 1  # one stopped (end of sequence) where the other went on: a flip at that position
        res.flipped = True
    return res


def compare_text(prompt: str, a: Completion, b: Completion, encode: Callable[[str], list[int]]) -> PromptResult:
    """Text-only servers: the continuations re-encoded in context with the local tokenizer."""
    n0 = len(encode(prompt))
    ia, ib = encode(prompt + a.text)[n0:], encode(prompt + b.text)[n0:]
    common = 0
    while common < min(len(ia), len(ib)) and ia[common] == ib[common]:
        common += 1
    flipped = ia != ib
    return PromptResult(positions=common + flipped, flipped=flipped)


@dataclass
class Report:
    prompts: int
    positions: int
    flips: int
    identical: int          # prompts whose whole continuations agree
    kl: list[float]
    text_only: bool
    model_a: str | None
    model_b: str | None
    seconds: float

    def as_dict(self) -> dict:
        d = {"prompts": self.prompts, "positions": self.positions, "flips": self.flips,
             "flip_rate": self.flips / self.positions if self.positions else None,
             "identical_continuations": self.identical / self.prompts if self.prompts else None,
             "text_only": self.text_only, "model_a": self.model_a, "model_b": self.model_b,
             "seconds": round(self.seconds, 2)}
        if not self.text_only:
            d["kl_topk_mean"] = sum(self.kl) / len(self.kl) if self.kl else None
            d["kl_topk_max"] = max(self.kl) if self.kl else None
        return d


def compare_endpoints(a: Endpoint, b: Endpoint, prompts: list[str], *, max_tokens: int = 32, top_k: int = 20,
                      encode: Callable[[str], list[int]] | None = None,
                      on_prompt: Callable[[int], None] | None = None) -> Report:
    """Greedy continuations of every prompt from both servers; `encode` (a tokenizer) switches to
    text-only mode for servers without logprobs."""
    if not prompts:
        raise KqError("no prompts to compare")
    text_only = encode is not None
    t0 = time.time()
    ma, mb = a.served_model(), b.served_model()
    positions = flips = identical = shared = 0
    kls: list[float] = []
    for i, prompt in enumerate(prompts):
        ca = a.complete(prompt, max_tokens=max_tokens, top_k=None if text_only else top_k)
        cb = b.complete(prompt, max_tokens=max_tokens, top_k=None if text_only else top_k)
        r = compare_text(prompt, ca, cb, encode) if text_only else compare_greedy(ca, cb)
        positions += r.positions
        flips += r.flipped
        identical += not r.flipped
        kls += r.kl
        shared += r.shared_topk
        if not text_only and i == 0 and r.positions and not r.shared_topk:
            raise KqError(f"{a.url} and {b.url}: on the same context their top-{top_k} tokens share no token "
                          "string: not the same tokenizer (compare two builds of one model)")
        if on_prompt:
            on_prompt(r.positions)
    return Report(prompts=len(prompts), positions=positions, flips=flips, identical=identical, kl=kls,
                  text_only=text_only, model_a=ma, model_b=mb, seconds=time.time() - t0)


def read_prompts(path, limit: int | None = None) -> list[str]:
    """Prompts: a .txt (one per non-empty line) or .jsonl ("prompt" or "text" field per line)."""
    import json
    from pathlib import Path
    p = Path(path)
    if not p.is_file():
        raise KqError(f"--prompts {p}: no such file")
    out: list[str] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                rec = json.loads(line)
                out.append(rec["prompt"] if "prompt" in rec else rec["text"])
            except (ValueError, KeyError, TypeError):
                raise KqError(f"--prompts {p}: line {n} is not a JSON object with a \"prompt\" or \"text\" field")
        else:
            out.append(line)
    if not out:
        raise KqError(f"--prompts {p}: no prompts in the file")
    return out[:limit] if limit else out
