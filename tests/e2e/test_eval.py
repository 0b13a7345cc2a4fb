"""`kq eval`: the metrics against hand-written formulas, and the command end to end."""
from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from kq.eval.metrics import Totals
from kq_testutil import run_kq


def test_metrics_against_written_out_formulas():
    g = torch.Generator().manual_seed(0)
    ls = torch.randn(2, 5, 7, generator=g) * 3
    lq = ls + torch.randn(2, 5, 7, generator=g) * 0.5
    nxt = torch.randint(0, 7, (2, 5), generator=g)
    t = Totals()
    t.add(ls[:1], lq[:1], nxt[:1])      # two batches: totals must add up
    t.add(ls[1:], lq[1:], nxt[1:])
    kl = top1 = nll_s = nll_q = 0.0
    for b in range(2):
        for s in range(5):
            zs = [math.exp(v) for v in ls[b, s].tolist()]
            zq = [math.exp(v) for v in lq[b, s].tolist()]
            p = [v / sum(zs) for v in zs]
            q = [v / sum(zq) for v in zq]
            kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
            top1 += p.index(max(p)) == q.index(max(q))
            nll_s -= math.log(p[int(nxt[b, s])])
            nll_q -= math.log(q[int(nxt[b, s])])
    r = t.summary()
    assert r["positions"] == 10
    assert r["kl"] == pytest.approx(kl / 10, rel=1e-5)
    assert r["top1"] == top1 / 10
    assert r["ppl_source"] == pytest.approx(math.exp(nll_s / 10), rel=1e-5)
    assert r["ppl_quantized"] == pytest.approx(math.exp(nll_q / 10), rel=1e-5)


def test_windows_and_their_targets():
    from kq.model.text import windows
    x, y = windows(list(range(100)), 3, 8)
    assert x.tolist()[1] == list(range(8, 16)) and y.tolist()[1] == list(range(9, 17))
    assert y[-1, -1] == 24   # the last position's target is the first token after the windows


def _text(tmp_path):
    words = "the quick brown fox jumps over a lazy dog and then runs far away from home".split()
    g = torch.Generator().manual_seed(1)
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (3000,), generator=g))
    p = tmp_path / "eval.txt.gz"
    with gzip.open(p, "wt") as f:
        f.write(text)
    return p


def test_eval_command_end_to_end(tmp_path, small_glm5, small_glm5_out):
    import shutil
    text = _text(tmp_path)
    out = shutil.copytree(small_glm5_out, tmp_path / "out")   # the fixture is shared: write into a copy
    r = run_kq("eval", out, "--against", small_glm5, "--text", text, "--seqs", "4", "--seqlen", "64",
               "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["seqs"] == 4 and rec["seqlen"] == 64 and rec["layers"] == 3
    assert rec["kl"] > 0 and 0 < rec["top1"] <= 1
    assert rec["totals"]["positions"] == 4 * 64
    on_disk = json.loads((out / "kq-eval.json").read_text())
    assert on_disk["kl"] == rec["kl"] and on_disk["ppl_source"] == rec["ppl_source"]


def test_eval_of_a_checkpoint_against_itself_is_exactly_zero(tmp_path, small_glm5):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(small_glm5, copy)
    r = run_kq("eval", copy, "--against", small_glm5, "--text", _text(tmp_path), "--seqs", "2", "--seqlen", "32",
               "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["kl"] == 0.0 and rec["top1"] == 1.0 and rec["ppl_source"] == rec["ppl_quantized"]


@pytest.mark.parametrize("case", ["no_text", "missing_text", "too_short", "other_model"])
def test_bad_input_is_one_line(tmp_path, small_glm5, small_glm5_out, case):
    import shutil
    out = shutil.copytree(small_glm5_out, tmp_path / "out")
    args = ["eval", out, "--against", small_glm5]
    if case == "missing_text":
        args += ["--text", tmp_path / "nope.txt"]
    elif case == "too_short":
        short = tmp_path / "short.txt"
        short.write_text("just a few words")
        args += ["--text", short]
    elif case == "other_model":
        from kq.synth import generate
        other = generate("glm5", tmp_path / "other", seed=2, hidden=128, n_experts=4, moe_intermediate=128,
                         num_layers=2, vocab=512, intermediate=256)
        args = ["eval", out, "--against", other, "--text", _text(tmp_path)]
    r = run_kq(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kq: error:"), r.stderr
    assert not (out / "kq-eval.json").exists()
