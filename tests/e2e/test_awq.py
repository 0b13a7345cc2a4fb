"""AWQ of the routed experts: the fold keeps the function, the searches pick what they claim,
same bytes every run, resume after a kill, bad options refused."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kq.checkpoint.reader import CheckpointReader
from kq.model import LayerwiseModel
from kq.quantize.awq import AwqConfig, awq_quantize_experts, clip_quantize, fold, search_scale
from kq.quantize.calibration import calibration_ids
from kq.quantize.distributed import World, merge_stats, split
from kq.quantize.layerwise import _moe_inputs, chunk_experts, n_chunks
from kq.quantize.rtn import MSE_DIVISORS, quantize_rtn
from kq_testutil import calib_text, run_kq

AWQ_ARGS = ["--calib-samples", "8", "--calib-seqlen", "64", "--group-size", "32", "--device", "cpu"]


def _deq(q, s, g):
    o, n = q.shape
    return (q.float().view(o, n // g, g) * s.float()[..., None]).view(o, n)


@pytest.fixture(scope="module")
def small_layer1(small_glm5, tmp_path_factory):
    """The generated small GLM-5 model's first MoE layer (float32) and its MoE inputs from 8 x 64 tokens."""
    calib = calib_text(tmp_path_factory.mktemp("awq-calib"))
    r = CheckpointReader(small_glm5)
    m = LayerwiseModel(r)
    ids = calibration_ids(small_glm5, r.config, calib, 8, 64)
    h, c = [m.embed(ids)], [None]
    h[0], c[0] = m.forward_layer(m.load_layer(0), h[0], c[0])
    return m, h, c


@torch.no_grad()
def test_fold_keeps_every_experts_function(small_layer1):
    """Against a SiLU-GLU written here (not transformers' module): the folded weights give the same
    expert outputs, and the whole MoE block (transformers' own code) gives the same output."""
    m, h, c = small_layer1
    layer = m.load_layer(1)
    X = _moe_inputs(m, layer, h, c)
    ex = layer.mlp.experts
    g = torch.Generator().manual_seed(0)
    before = layer.mlp(X[None])[0]
    for e in range(ex.gate_up_proj.shape[0]):
        wgu, wd = ex.gate_up_proj.data[e].double(), ex.down_proj.data[e].double()
        inter = wgu.shape[0] // 2
        s = torch.rand(inter, generator=g, dtype=torch.float64) * 4 + 0.25
        fgu, fd = fold(wgu, wd, s)
        assert torch.equal(fgu[:inter], wgu[:inter])                        # gate rows untouched
        x = X[:50].double()
        want = (F.silu(x @ wgu[:inter].T) * (x @ wgu[inter:].T)) @ wd.T
        got = (F.silu(x @ fgu[:inter].T) * (x @ fgu[inter:].T)) @ fd.T
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(fd, wd)                                    # the weights did change
        ex.gate_up_proj.data[e], ex.down_proj.data[e] = fgu.float(), fd.float()
    torch.testing.assert_close(layer.mlp(X[None])[0], before, rtol=1e-4, atol=1e-5)


def _down_error(wd, G, s, group):
    q, sc = quantize_rtn(wd * s[None], group, "mse")
    D = (wd - _deq(q, sc, group) / s[None]).double()
    return float(torch.trace(D @ G.double() @ D.T))


def test_scale_search_never_loses_to_no_scaling_and_uses_salient_channels():
    g = torch.Generator().manual_seed(1)
    wd = torch.randn(64, 128, generator=g)
    h = torch.randn(4000, 128, generator=g) * 0.1
    h[:, :4] *= 60.0                                                         # four salient channels
    G, m = h.T @ h, h.abs().mean(0)
    s, alpha = search_scale(wd, m, G, 32, 20)
    assert alpha > 0 and s[:4].min() > s[4:].max()
    assert _down_error(wd, G, s, 32) < 0.9 * _down_error(wd, G, torch.ones(128), 32)
    # the chosen alpha is the grid's best (every candidate rescored here in float64)
    errs = []
    for k in range(20):
        c = m.clamp(min=1e-4).pow(k / 20)
        errs.append(_down_error(wd, G, c / (c.max() * c.min()).sqrt(), 32))
    assert errs.index(min(errs)) == round(alpha * 20)


def test_clip_search_picks_each_groups_best_weighted_scale():
    """Every (row, group) scale is the grid's least d^T H_gg d, rescored here group by group in float64."""
    g = torch.Generator().manual_seed(2)
    W = torch.randn(2, 6, 64, generator=g)
    x = torch.randn(300, 64, generator=g) * torch.linspace(0.1, 3, 64)
    H = torch.stack([x.T @ x, (x[:100] * 2).T @ x[:100]])
    q, s = clip_quantize(W, H, 32)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (2, 6, 2)
    for e in range(2):
        for r in range(6):
            for gi in range(2):
                w = W[e, r, gi * 32:(gi + 1) * 32]
                Hg = H[e, gi * 32:(gi + 1) * 32, gi * 32:(gi + 1) * 32].double()
                amax = w.abs().max()
                errs = []
                for d in MSE_DIVISORS:
                    sc = (amax / d).to(torch.bfloat16).float()
                    dd = (w - (w / sc).round().clamp(-8, 7) * sc).double()
                    errs.append(float(dd @ Hg @ dd))
                best = (amax / MSE_DIVISORS[errs.index(min(errs))]).to(torch.bfloat16)
                assert s[e, r, gi] == best
                assert torch.equal(q[e, r, gi * 32:(gi + 1) * 32], (w / best.float()).round().clamp(-8, 7).to(torch.int8))


@torch.no_grad()
def test_awq_lowers_the_layer_output_error_against_rtn(small_layer1):
    """The MoE block's output error over the calibration tokens, AWQ's experts against kq's RTN (MSE)."""
    m, h, c = small_layer1
    ref = m.load_layer(1)
    X = _moe_inputs(m, ref, h, c)
    want = ref.mlp(X[None])[0]
    errs = {}
    for name in ("rtn", "awq"):
        layer = m.load_layer(1)
        ex = layer.mlp.experts
        if name == "awq":
            res, stats = awq_quantize_experts(layer, X, AwqConfig(group=32))
            assert sorted(stats["alpha"]) == list(range(ex.gate_up_proj.shape[0]))
            assert all(a is not None for a in stats["alpha"].values()) and stats["rtn_fallback"] == []
        else:
            res = {e: (*quantize_rtn(ex.gate_up_proj.data[e], 32), *quantize_rtn(ex.down_proj.data[e], 32))
                   for e in range(ex.gate_up_proj.shape[0])}
        for e, (qg, sg, qd, sd) in res.items():
            ex.gate_up_proj.data[e], ex.down_proj.data[e] = _deq(qg, sg, 32), _deq(qd, sd, 32)
        errs[name] = float((layer.mlp(X[None])[0] - want).square().sum())
    assert errs["awq"] < 0.95 * errs["rtn"], errs


def test_awq_split_unit_is_one_expert_and_awq_gptq_keeps_gptqs_chunk():
    """The torchrun split of AWQ's experts (distributed.split over n_chunks chunks): awq by single experts,
    awq+gptq by GPTQ's batched chunks; every expert solved by exactly one rank."""
    awq, both = AwqConfig(), AwqConfig(method="awq+gptq", gptq={"expert_chunk": 3})
    assert (awq.expert_chunk, AwqConfig(method="awq+gptq").expert_chunk, both.expert_chunk) == (1, 16, 3)
    blocks = [chunk_experts(4, awq, split(n_chunks(4, awq), World(r, 3))) for r in range(3)]
    assert blocks == [[0, 1], [2], [3]]
    blocks = [chunk_experts(256, awq, split(n_chunks(256, awq), World(r, 8))) for r in range(8)]
    assert blocks == [list(range(32 * r, 32 * r + 32)) for r in range(8)]
    blocks = [chunk_experts(8, both, split(n_chunks(8, both), World(r, 2))) for r in range(2)]
    assert blocks == [[0, 1, 2, 3, 4, 5], [6, 7]]                           # chunks [0-2] [3-5] | [6-7]


@torch.no_grad()
@pytest.mark.parametrize("method", ["awq", "awq+gptq"])
def test_awq_of_a_block_of_chunks_solves_only_those_experts_with_the_whole_runs_bytes(small_layer1, method):
    """What one rank does under torchrun: its block of chunks gives exactly those experts, bit for bit the
    single solve's, folds only their weights (the other experts' weights keep every byte: no work was
    done on them), and the ranks' stats merge into the single solve's."""
    m, h, c = small_layer1
    cfg = AwqConfig(method=method, group=32, gptq={"expert_chunk": 1} if method == "awq+gptq" else {})
    whole = m.load_layer(1)
    X = _moe_inputs(m, whole, h, c)
    want, want_stats = awq_quantize_experts(whole, X, cfg)
    E = whole.mlp.experts.gate_up_proj.shape[0]
    assert sorted(want) == list(range(E)) and E == 4
    stats = []
    for r in range(3):
        layer = m.load_layer(1)
        ex = layer.mlp.experts
        before = ex.gate_up_proj.data.clone(), ex.down_proj.data.clone()
        chunks = split(n_chunks(E, cfg), World(r, 3))
        got, st = awq_quantize_experts(layer, X, cfg, chunks=chunks)
        mine = [[0, 1], [2], [3]][r]
        assert sorted(got) == mine and sorted(st["alpha"]) == mine
        for e in mine:
            assert all(torch.equal(a, b) for a, b in zip(got[e], want[e]))
            assert torch.equal(ex.gate_up_proj.data[e], whole.mlp.experts.gate_up_proj.data[e])   # folded alike
            assert not st["alpha"][e] or not torch.equal(ex.gate_up_proj.data[e], before[0][e])
        for e in set(range(E)) - set(mine):
            assert torch.equal(ex.gate_up_proj.data[e], before[0][e]) and torch.equal(ex.down_proj.data[e], before[1][e])
        stats.append(st)
    assert merge_stats(stats) == want_stats


def test_bad_awq_options_are_refused(tmp_path, small_glm5):
    calib = calib_text(tmp_path)
    for args, msg in ((["--method", "awq"], "--method awq needs --calib"),
                      (["--method", "awq+gptq"], "--method awq+gptq needs --calib"),
                      (["--method", "awq", "--calib", calib, "--gptq-damp", "0.1"],
                       "--gptq-damp: GPTQ options; use them with --method gptq or awq+gptq"),
                      (["--method", "awq", "--calib", calib, "--calib-policy", "some"],
                       "--calib-policy some: use one of all, routed, weighted"),
                      (["--method", "awq+gptq", "--calib", calib, "--gptq-damp", "2"], "GPTQ damp 2.0")):
        r = run_kq("quantize", small_glm5, "--out", tmp_path / "o", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "o").exists()


AWQ_KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    from pathlib import Path
    from kq.checkpoint.source import open_source
    from kq.quantize.awq import AwqConfig
    from kq.quantize.plan import make_plan
    from kq.quantize.run import Options, run_quantize
    from kq.quantize.layerwise import gptq_expert_codes
    src, out, calib, kill_after = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    source = open_source(src)
    plan = make_plan(source, group_size=32)
    def on_layer(done, total, stats):
        if done == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    codes = gptq_expert_codes(source, plan, out, calib=calib, samples=8, seqlen=64, device=torch.device("cpu"),
                              cfg=AwqConfig(group=32), on_layer=on_layer)
    run_quantize(source, plan, out, Options(method="awq", group_size=32, calib=str(calib)), device=torch.device("cpu"),
                 expert_codes=codes)
""")


def _files(folder):
    out = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    out.pop("kq-manifest.json")   # holds the creation time
    return out


def test_awq_is_deterministic_resumes_byte_identical_and_verifies(tmp_path, small_glm5, small_glm5_out):
    calib = calib_text(tmp_path)
    a, b, killed = tmp_path / "a", tmp_path / "b", tmp_path / "killed"
    for out in (a, b):
        r = run_kq("quantize", small_glm5, "--out", out, "--calib", calib, "--method", "awq", *AWQ_ARGS)
        assert r.returncode == 0, r.stderr
    assert _files(a) == _files(b)
    assert run_kq("verify", a).returncode == 0
    assert _files(a) != _files(small_glm5_out)                           # same layout, other codes than RTN
    assert json.loads((a / "kq-manifest.json").read_text())["options"]["method"] == "awq"
    r = subprocess.run([sys.executable, "-c", AWQ_KILLER, str(small_glm5), str(killed), str(calib), "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr
    assert json.loads((killed / ".kq-work" / "gptq" / "state.json").read_text())["next_layer"] == 1
    # awq+gptq is another run: it does not resume AWQ's work
    r = run_kq("quantize", small_glm5, "--out", killed, "--calib", calib, "--method", "awq+gptq", *AWQ_ARGS)
    assert r.returncode == 2 and "holds an unfinished kq run with other options" in r.stderr, r.stderr
    r = run_kq("quantize", small_glm5, "--out", killed, "--calib", calib, "--method", "awq", *AWQ_ARGS)
    assert r.returncode == 0, r.stderr
    assert _files(killed) == _files(a)


@pytest.mark.slow
def test_awq_gptq_differs_from_both_and_verifies(tmp_path, small_glm5):
    calib = calib_text(tmp_path)
    outs = {}
    for method in ("awq+gptq", "gptq", "awq"):
        outs[method] = tmp_path / method
        r = run_kq("quantize", small_glm5, "--out", outs[method], "--calib", calib, "--method", method, *AWQ_ARGS)
        assert r.returncode == 0, r.stderr
    assert run_kq("verify", outs["awq+gptq"]).returncode == 0
    shard = "model-00002-of-00003.safetensors"
    got = {k: (v / shard).read_bytes() for k, v in outs.items()}
    assert got["awq+gptq"] != got["gptq"] and got["awq+gptq"] != got["awq"]
