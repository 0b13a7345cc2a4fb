"""kq's evaluation reproduces the figures of shared/models/README.md on the trained tiny model.

How those figures were computed (found by matching every figure, see docs/eval-gptq.md):
the eval text tokenized as one stream with tokenizer.json (no BOS), 48 consecutive
windows of 256 tokens, every position scored against the token that follows it;
KL(source||quantized) and top-1 over all 48 x 256 positions; "naive absmax RTN" of the
routed experts = per group of the input dimension, scale = amax / 7.5 in float32 (not
rounded to bf16), codes round-half-even clamped to [-8, 7]; everything CPU float32.
"""
from __future__ import annotations

import pytest
import torch

from kq.checkpoint.reader import CheckpointReader
from kq.eval.compare import compare
from kq.eval.run import eval_ids
from kq.model import LayerwiseModel
from kq_testutil import SHARED, TINY_MODEL

EVAL_TEXT = SHARED / "data" / "eval_text.txt.gz"


def naive_absmax(group):
    def fake_quant(name, w):
        o, n = w.shape
        wg = w.view(o, n // group, group)
        s = wg.abs().amax(-1, keepdim=True) / 7.5
        return ((wg / s).round().clamp(-8, 7) * s).view(o, n)
    return fake_quant


@pytest.mark.slow
def test_reproduces_the_tiny_models_reference_figures():
    reader = CheckpointReader(TINY_MODEL)
    ids, targets = eval_ids(TINY_MODEL, EVAL_TEXT, 48, 256)
    assert ids.shape == (48, 256)
    want = {32: (0.0120, 93.6, 51.08), 128: (0.0128, 92.9, 51.07)}
    for group, (kl, top1, ppl) in want.items():
        r = compare(LayerwiseModel(reader), LayerwiseModel(reader, override=naive_absmax(group)), ids, targets).summary
        got = (round(r["kl"], 4), round(r["top1"] * 100, 1), round(r["ppl_quantized"], 2), round(r["ppl_source"], 1))
        assert got == (kl, top1, ppl, 50.8), (group, r)


def test_tiny_model_against_itself_is_exactly_zero():
    """Cheap guard for CI without the slow test: the tiny model against itself, 2 windows."""
    reader = CheckpointReader(TINY_MODEL)
    ids, targets = eval_ids(TINY_MODEL, EVAL_TEXT, 2, 64)
    r = compare(LayerwiseModel(reader), LayerwiseModel(reader), ids, targets).summary
    assert r["kl"] == 0.0 and r["top1"] == 1.0
    assert 10 < r["ppl_source"] < 500 and torch.isfinite(torch.tensor(r["ppl_source"]))
