"""`kq eval --pair`: source prefill + quantized decode, layer by layer.

The reference is transformers' own model with its own KV cache: the source model prefills the
prompt into a DynamicCache (MLA keys/values and the DSA indexer's key cache), the quantized
model decodes the continuation on it. kq's layer-by-layer splice must give the same logits.
"""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from kq.checkpoint.reader import CheckpointReader
from kq.errors import KqError
from kq.eval.compare import compare
from kq.eval.metrics import Totals
from kq.eval.pair import check_same_attention, compare_pair
from kq.eval.run import eval_ids
from kq.model import LayerwiseModel
from kq_testutil import SHARED, TINY_MODEL, run_kq

EVAL_TEXT = SHARED / "data" / "eval_text.txt.gz"


def rtn(group):
    """In-memory absmax RTN of the routed experts (what a kq output holds, without writing one)."""
    def fake_quant(name, w):
        o, n = w.shape
        wg = w.view(o, n // group, group)
        s = wg.abs().amax(-1, keepdim=True) / 7.5
        return ((wg / s).round().clamp(-8, 7) * s).view(o, n)
    return fake_quant


def full_model(lm: LayerwiseModel):
    """transformers' whole <Family>ForCausalLM with lm's weights (the tiny model fits in memory)."""
    cls = getattr(importlib.import_module(lm.arch.module), lm.arch.prefix + "ForCausalLM")
    with torch.device("meta"):
        model = cls(lm.config)
    model.model.layers = torch.nn.ModuleList([lm.load_layer(i) for i in range(lm.num_layers)])
    model.model.embed_tokens.weight = torch.nn.Parameter(lm.reader.raw("model.embed_tokens.weight").float(),
                                                         requires_grad=False)
    lm.logits(torch.zeros(1, lm.config.hidden_size))
    norm, head = lm._head
    model.model.norm = norm
    model.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    model.model.rotary_emb = lm.rotary
    return model.eval()


@pytest.fixture(scope="module")
def tiny():
    ids, targets = eval_ids(TINY_MODEL, EVAL_TEXT, 2, 64)
    return CheckpointReader(TINY_MODEL), ids, targets


def test_pair_matches_transformers_prefill_then_decode_on_its_cache(tiny):
    reader, ids, targets = tiny
    P = 40
    src, q = LayerwiseModel(reader), LayerwiseModel(reader, override=rtn(32))
    ms, mq = full_model(src), full_model(q)
    with torch.no_grad():
        cache = ms(ids[:, :P], use_cache=True).past_key_values       # the prefill rank
        assert cache.get_seq_length() == P
        dec = mq(ids[:, P:], past_key_values=cache, use_cache=True).logits   # the decode rank
        ref_src = ms(ids).logits
    want = Totals()
    want.add(ref_src[:, P:], dec, targets[:, P:])
    res = compare_pair(src, q, ids, targets, prompt=P)
    got = res.notes["pair"]["pair"]
    assert got["positions"] == 2 * (64 - P)
    assert got["kl"] == pytest.approx(want.summary()["kl"], rel=1e-4, abs=1e-7)
    assert got["top1"] == want.summary()["top1"]
    assert got["ppl_quantized"] == pytest.approx(want.summary()["ppl_quantized"], rel=1e-5)
    # The pair differs from the quantized model alone (the prompt's cache is the source's) ...
    alone = res.notes["pair"]["alone"]
    assert got["kl"] != alone["kl"] and got["kl"] > 0
    # ... and the plain figures are compare()'s.
    assert res.summary == compare(src, q, ids, targets).summary


def test_identities_are_exact(tiny):
    reader, ids, targets = tiny
    src = LayerwiseModel(reader)
    same = compare_pair(src, LayerwiseModel(reader), ids, targets, prompt=24)
    assert same.notes["pair"]["pair"]["kl"] == 0.0 and same.notes["pair"]["pair"]["top1"] == 1.0
    assert same.summary["kl"] == 0.0
    q = LayerwiseModel(reader, override=rtn(128))
    zero = compare_pair(src, q, ids, targets, prompt=0)
    assert zero.notes["pair"]["pair"] == zero.notes["pair"]["alone"]
    assert zero.notes["pair"]["alone"]["kl"] == zero.summary["kl"] > 0   # prompt 0: alone over every position


def test_attention_that_differs_is_refused(tiny):
    reader = tiny[0]
    a, b = LayerwiseModel(reader).load_layer(1), LayerwiseModel(reader).load_layer(1)
    check_same_attention(a, b, 1)
    with torch.no_grad():
        b.self_attn.kv_a_proj_with_mqa.weight[0, 0] += 1
    with pytest.raises(KqError, match="layer 1 self_attn.kv_a_proj_with_mqa.weight differs"):
        check_same_attention(a, b, 1)


def test_pair_from_the_command_line(tmp_path, small_glm5, small_glm5_out):
    import shutil
    out = shutil.copytree(small_glm5_out, tmp_path / "out")
    r = run_kq("eval", out, "--against", small_glm5, "--text", EVAL_TEXT, "--seqs", "2", "--seqlen", "32",
               "--pair", "--prompt", "20", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    p = rec["pair"]
    assert p["prompt"] == 20 and p["continuation"] == 12
    assert p["pair"]["positions"] == p["alone"]["positions"] == 2 * 12
    assert p["pair"]["kl"] > 0 and json.loads((out / "kq-eval.json").read_text())["pair"] == p
    r = run_kq("eval", out, "--against", small_glm5, "--text", EVAL_TEXT, "--seqs", "2", "--seqlen", "32", "--pair",
               env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "source prefill + quantized decode" in r.stdout and "continuation tokens 16.." in r.stdout


@pytest.mark.parametrize("args, msg", [(["--prompt", "4"], "--prompt is the prompt length of --pair"),
                                       (["--pair", "--prompt", "32"], "--prompt 32: must be at least 0 and below")])
def test_bad_prompt_is_one_line(tmp_path, small_glm5, small_glm5_out, args, msg):
    r = run_kq("eval", small_glm5_out, "--against", small_glm5, "--text", EVAL_TEXT, "--seqlen", "32", *args)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], r.stderr
