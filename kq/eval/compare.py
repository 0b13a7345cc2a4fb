"""Compare a quantized checkpoint with its source, both run one decoder layer at a time.

For each layer index: load the source's layer, push every eval sequence through it,
drop it; then the same for the quantized model's layer. Memory: one decoder layer
(of one model) plus the hidden states of all eval sequences for both models,
2 x N x S x H x 4 bytes in float32 (48 x 256 tokens: 25 MB at H=256, 604 MB at
GLM-5.2's H=6144). Logits are made batch by batch at the end, never all at once.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kq.errors import KqError
from kq.eval.metrics import Totals
from kq.model import LayerwiseModel


@dataclass
class EvalResult:
    summary: dict
    totals: dict
    seqs: int
    seqlen: int
    seconds: float
    layers: int
    notes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**self.summary, "seqs": self.seqs, "seqlen": self.seqlen, "layers": self.layers,
                "seconds": round(self.seconds, 2), "totals": self.totals, **self.notes}


def _check_same_model(a: LayerwiseModel, b: LayerwiseModel) -> None:
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        va, vb = getattr(a.config, key), getattr(b.config, key)
        if va != vb:
            raise KqError(f"the two checkpoints are not the same model: {key} is {vb} in the source, {va} in the "
                          "quantized one")


def _run_layers(model: LayerwiseModel, i: int, hidden: list, carry: list) -> None:
    layer = model.load_layer(i)
    for b in range(len(hidden)):
        hidden[b], carry[b] = model.forward_layer(layer, hidden[b], carry[b])
    del layer
    gc.collect()


@torch.no_grad()
def compare(source: LayerwiseModel, quantized: LayerwiseModel, ids: torch.Tensor, targets: torch.Tensor, *,
            batch: int = 8, on_layer: Callable[[int, int], None] | None = None) -> EvalResult:
    """ids, targets [N, S] int64 (targets: each token's successor) -> KL / top-1 /
    perplexities of `quantized` against `source`."""
    return compare_many(source, {"q": quantized}, ids, targets, batch=batch, on_layer=on_layer)["q"]


@torch.no_grad()
def compare_many(source: LayerwiseModel, quantized: dict[str, LayerwiseModel], ids: torch.Tensor,
                 targets: torch.Tensor, *, batch: int = 8,
                 on_layer: Callable[[int, int], None] | None = None) -> dict[str, EvalResult]:
    """compare() for several quantized models at once (e.g. one checkpoint with exact and with
    FP8 activations): the source runs once. Memory: one more set of hidden states per model."""
    for q in quantized.values():
        _check_same_model(q, source)
    t0 = time.time()
    chunks = list(ids.split(batch))
    hs = [source.embed(c) for c in chunks]
    cs: list = [None] * len(chunks)
    hq = {k: [q.embed(c) for c in chunks] for k, q in quantized.items()}
    cq = {k: [None] * len(chunks) for k in quantized}
    n = source.num_layers
    for i in range(n):
        _run_layers(source, i, hs, cs)
        for k, q in quantized.items():
            _run_layers(q, i, hq[k], cq[k])
        if on_layer:
            on_layer(i + 1, n)
    tots = {k: Totals() for k in quantized}
    for j, (t, a) in enumerate(zip(targets.split(batch), hs)):
        la = source.logits(a)
        for k, q in quantized.items():
            tots[k].add(la, q.logits(hq[k][j]), t)
    seconds = time.time() - t0
    return {k: EvalResult(tot.summary(), tot.as_dict(), ids.shape[0], ids.shape[1], seconds, n)
            for k, tot in tots.items()}
