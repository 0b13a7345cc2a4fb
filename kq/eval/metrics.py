"""KL(source || quantized), top-1 agreement and perplexity, accumulated batch by batch.

Per position t of a window, with p = softmax(source logits), q = softmax(quantized):
  KL_t   = sum_v p_v (log p_v - log q_v)          (nats)
  top1_t = [argmax p == argmax q]
  NLL_t  = -log p(y_t) resp. -log q(y_t), y_t the token that follows position t in the
           text (for the last position of a window: the first token after the window)
Every position counts for all three, so 48 windows of 256 give 48 x 256 scored tokens:
this is how the reference figures of shared/models/README.md were computed.
Totals are summed in float64 so the order of batches does not change the result.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass
class Totals:
    positions: int = 0       # scored positions (each has a next token, see above)
    kl: float = 0.0
    top1: int = 0
    nll_src: float = 0.0
    nll_q: float = 0.0

    def add(self, logits_src: torch.Tensor, logits_q: torch.Tensor, targets: torch.Tensor) -> None:
        """logits [B, S, V] float32, targets [B, S]: the next token of each position."""
        ls = logits_src.float().log_softmax(-1)                                 # [B, S, V]
        lq = logits_q.float().log_softmax(-1)
        self.kl += float((ls.exp() * (ls - lq)).sum(-1).double().sum())
        self.top1 += int((ls.argmax(-1) == lq.argmax(-1)).sum())
        self.positions += targets.numel()
        nxt = targets[..., None]                                                  # [B, S, 1]
        self.nll_src -= float(ls.gather(-1, nxt).double().sum())
        self.nll_q -= float(lq.gather(-1, nxt).double().sum())

    def summary(self) -> dict:
        return {
            "kl": self.kl / self.positions,
            "top1": self.top1 / self.positions,
            "ppl_source": math.exp(self.nll_src / self.positions),
            "ppl_quantized": math.exp(self.nll_q / self.positions),
            "positions": self.positions,
        }

    def as_dict(self) -> dict:
        return asdict(self)
