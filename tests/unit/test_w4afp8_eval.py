"""`kq eval --activations fp8`: the FP8-activation expert emulation (kq.eval.fp8_act) against an
independent reference (e4m3 rounding from the format's definition, float64 arithmetic on the
dequantized weights), and the command end to end on a small checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kq.checkpoint.pack import dequantize_int4, pack_int4
from kq.eval.fp8_act import Fp8ActExperts, act_scale, fp8_linear, quantize_e4m3


def _e4m3_table() -> torch.Tensor:
    """Every non-negative finite e4m3fn value, by code (0..126): exponent bias 7, subnormals
    below exponent 1, code 127 (S.1111.111) is NaN."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


TABLE = _e4m3_table()


def ref_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value, ties to the even code, saturating at 448 (float64)."""
    a = v.abs().clamp(max=448.0).double().flatten()
    hi = torch.searchsorted(TABLE, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - TABLE[lo], TABLE[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return (TABLE[pick] * torch.sign(v.double().flatten())).reshape(v.shape)


def ref_fp8_linear(x, codes, scales, mode):
    """float64: x -> e4m3 with scale amax/448 -> times the dequantized INT4 weight."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True) if mode == "token" else x.abs().amax().reshape(1, 1)
    a = amax.clamp_min(1e-10) / 448
    w = dequantize_int4(pack_int4(codes), scales, codes.shape).double()
    return (ref_e4m3(x / a) * a) @ w.T


def _weights(n, k, g, gen):
    codes = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return codes, scales


def test_e4m3_cast_is_round_to_nearest_even_of_the_format():
    gen = torch.Generator().manual_seed(0)
    # Every representable value, every midpoint between neighbours (ties), and random values.
    mids = (TABLE[1:] + TABLE[:-1]) / 2
    v = torch.cat([TABLE, mids, torch.randn(20000, generator=gen, dtype=torch.float64) * 100])
    v = torch.cat([v, -v]).float()
    got = quantize_e4m3(v, torch.ones(1))
    assert torch.equal(got.double(), ref_e4m3(v.double()))


@pytest.mark.parametrize("mode", ["token", "tensor"])
@pytest.mark.parametrize("g", [128, 32])
def test_fp8_linear_matches_float64_reference(mode, g):
    gen = torch.Generator().manual_seed(1)
    n, k, t = 96, 256, 40
    codes, scales = _weights(n, k, g, gen)
    # Rows of very different magnitudes: per-token and per-tensor scales differ for real.
    x = torch.randn(t, k, generator=gen) * torch.logspace(-2, 1, t)[:, None]
    got = fp8_linear(x, codes, scales, mode).double()
    ref = ref_fp8_linear(x, codes, scales, mode)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max())
    # And it is not W4A16: the activations really were rounded.
    exact = x.double() @ dequantize_int4(pack_int4(codes), scales, codes.shape).double().T
    assert (got - exact).abs().max() > 1e-3 * exact.abs().max()


def test_scales_are_amax_over_448():
    x = torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0], [2.0, 0.5, -4.48]])
    assert torch.allclose(act_scale(x, "token"), torch.tensor([[2.0], [1e-10 / 448], [0.01]]))
    assert torch.allclose(act_scale(x, "tensor"), torch.tensor([[2.0]]))


@pytest.mark.parametrize("mode", ["token", "tensor"])
def test_experts_match_reference_moe(mode):
    """The whole routed-expert block: gate/up, SiLU*up, down, routing weights; per-tensor scales
    over all tokens (gate/up) and over all routed rows of all experts (down)."""
    gen = torch.Generator().manual_seed(2)
    E, H, I, T, K, g = 4, 256, 128, 24, 2, 128
    w13 = [_weights(2 * I, H, g, gen) for _ in range(E)]
    w2 = [_weights(H, I, g, gen) for _ in range(E)]
    x = torch.randn(T, H, generator=gen) * torch.logspace(-1, 1, T)[:, None]
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[idx == 3] = 0  # expert 3 gets no token
    wts = torch.rand(T, K, generator=gen)
    mod = Fp8ActExperts(torch.stack([c for c, _ in w13]), torch.stack([s for _, s in w13]),
                        torch.stack([c for c, _ in w2]), torch.stack([s for _, s in w2]), F.silu, mode)
    got = mod(x, idx, wts).double()

    # Reference: first every routed (token, slot) row's intermediate, then the down projection.
    inter = {}
    for t in range(T):
        for s in range(K):
            e = int(idx[t, s])
            gu = ref_fp8_linear(x[t:t + 1], *w13[e], mode) if mode == "token" else None
            inter[(t, s)] = (e, gu)
    if mode == "tensor":
        for e in range(E):
            rows = [(t, s) for (t, s), (ee, _) in inter.items() if ee == e]
            if rows:
                gu = ref_fp8_linear(x, *w13[e], "tensor")  # the scale is over all tokens of the call
                for t, s in rows:
                    inter[(t, s)] = (e, gu[t:t + 1])
    h = {k: F.silu(gu[:, :I]) * gu[:, I:] for k, (e, gu) in inter.items()}
    a2 = max(float(v.abs().max()) for v in h.values()) / 448
    ref = torch.zeros(T, H, dtype=torch.float64)
    for (t, s), (e, _) in inter.items():
        w = dequantize_int4(pack_int4(w2[e][0]), w2[e][1], (H, I)).double()
        hv = h[(t, s)]
        a = hv.abs().amax() / 448 if mode == "token" else a2
        ref[t] += (ref_e4m3(hv / a) * a @ w.T)[0] * float(wts[t, s])
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max())


@pytest.mark.slow
def test_kq_eval_activations_fp8_end_to_end(small_glm5, tmp_path):
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "kq", "quantize", str(small_glm5), "--out", str(out), "--group-size",
                        "128", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    r = subprocess.run([sys.executable, "-m", "kq", "eval", str(out), "--against", str(small_glm5), "--text", str(text),
                        "--seqs", "4", "--seqlen", "64", "--activations", "fp8", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    acts = rec["activations"]
    assert set(acts) == {"none", "fp8_token", "fp8_tensor", "emulation"}
    for k in ("fp8_token", "fp8_tensor"):
        # FP8 activations move the logits further from the source than W4A16 alone.
        assert acts[k]["kl"] > rec["kl"] > 0
        assert acts[k]["kl_vs_w4a16"] == pytest.approx(acts[k]["kl"] / rec["kl"])
        assert acts[k]["ppl_source"] == pytest.approx(rec["ppl_source"])
    assert json.loads((out / "kq-eval.json").read_text())["activations"]["fp8_token"] == acts["fp8_token"]
    # A W4A16-only eval of the same folder gives the same top-level figures.
    r = subprocess.run([sys.executable, "-m", "kq", "eval", str(out), "--against", str(small_glm5), "--text", str(text),
                        "--seqs", "4", "--seqlen", "64", "--json"], capture_output=True, text=True, timeout=600)
    plain = json.loads(r.stdout)
    assert "activations" not in plain and plain["kl"] == pytest.approx(rec["kl"], rel=1e-9)
