"""kq's batched, blocked GPTQ against a textbook one written here, and what GPTQ is for."""
from __future__ import annotations

import pytest
import torch

from kq.quantize.gptq import gptq_quantize
from kq.quantize.rtn import quantize_rtn


def _textbook_gptq(W, H, group, damp=0.01):
    """Optimal Brain Quantization order, one column at a time, with the explicit inverse
    Hessian downdated after each column (no Cholesky, no blocks); absmax/7.5 scales
    chosen from the current weights at each group's first column, rounded to bf16."""
    W = W.double().clone()
    H = H.double().clone()
    n = W.shape[1]
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * H.diagonal().mean() * torch.eye(n, dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    S = torch.zeros(W.shape[0], n // group, dtype=torch.float64)
    for i in range(n):
        if i % group == 0:
            s = (W[:, i:i + group].abs().amax(1) / 7.5).float().to(torch.bfloat16).double()
            S[:, i // group] = s
        q = (W[:, i] / s).round().clamp(-8, 7)
        Q[:, i] = q
        err = (W[:, i] - q * s) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
        Hinv = Hinv - Hinv[:, i:i + 1] @ Hinv[i:i + 1, :] / Hinv[i, i]
    return Q, S


def _problem(E=3, out=24, n=64, T=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / n ** 0.5 + torch.eye(n)   # correlated input features
    X = torch.randn(E, T, n, generator=g) @ mix
    W = torch.randn(E, out, n, generator=g) * 0.05
    H = X.transpose(1, 2) @ X
    return W, H, X


def test_matches_textbook_gptq():
    W, H, _ = _problem()
    Q, S = gptq_quantize(W, H, 16, clip="absmax", block=32)
    for e in range(W.shape[0]):
        Qr, Sr = _textbook_gptq(W[e], H[e], 16)
        same = (Q[e].double() == Qr).float().mean()
        assert same > 0.995, f"expert {e}: only {same:.4f} of the codes agree"
        assert torch.equal(S[e].double(), Sr) or (S[e].double() - Sr).abs().max() <= Sr.abs().max() * 2 ** -7


def test_lower_output_error_than_rtn():
    W, H, X = _problem(seed=1)
    for clip in ("absmax", "mse"):
        Q, S = gptq_quantize(W, H, 32, clip=clip)
        for e in range(W.shape[0]):
            deq = (Q[e].float().view(24, 2, 32) * S[e].float()[..., None]).view(24, 64)
            q_r, s_r = quantize_rtn(W[e], 32, clip)
            rtn = (q_r.float().view(24, 2, 32) * s_r.float()[..., None]).view(24, 64)
            err_gptq = (X[e] @ (W[e] - deq).T).square().sum()
            err_rtn = (X[e] @ (W[e] - rtn).T).square().sum()
            assert err_gptq < 0.8 * err_rtn, (clip, e, float(err_gptq / err_rtn))


def test_codes_and_scales_are_storable():
    W, H, _ = _problem(seed=2)
    Q, S = gptq_quantize(W, H, 32)
    assert Q.dtype == torch.int8 and int(Q.min()) >= -8 and int(Q.max()) <= 7
    assert S.dtype == torch.bfloat16 and S.shape == (3, 24, 2) and bool((S > 0).all())


def test_batched_equals_one_at_a_time_and_shared_hessian():
    W, H, _ = _problem(seed=3)
    Q, S = gptq_quantize(W, H, 16)
    for e in range(3):
        q1, s1 = gptq_quantize(W[e:e + 1], H[e:e + 1], 16)
        assert torch.equal(q1[0], Q[e]) and torch.equal(s1[0], S[e])
    Qs, Ss = gptq_quantize(W, H[:1], 16)                  # one Hessian for all experts
    q0, s0 = gptq_quantize(W[:1], H[:1], 16)
    assert torch.equal(Qs[0], q0[0]) and torch.equal(Ss[0], s0[0])


def test_inputs_that_never_fire():
    W, H, _ = _problem(seed=4)
    H[:, 5, :] = 0
    H[:, :, 5] = 0
    Q, S = gptq_quantize(W, H, 16)
    assert torch.isfinite(S.float()).all()
    assert (Q[:, :, 5] == 0).all()   # a dead input's weight is irrelevant: zeroed, as in GPTQ


def test_block_must_hold_whole_groups():
    W, H, _ = _problem()
    with pytest.raises(AssertionError):
        gptq_quantize(W, H, 32, block=48)


def test_scale_refit_lowers_each_rows_hessian_error_codes_unchanged():
    from kq.quantize.gptq import _damped
    W, H, _ = _problem(seed=5)
    for Hs in (H, H[:1]):                                                   # per expert and shared
        Q, S = gptq_quantize(W, Hs, 16)
        Q2, S2 = gptq_quantize(W, Hs, 16, refit=True)
        assert torch.equal(Q, Q2) and S2.dtype == torch.bfloat16 and bool((S2 > 0).all())
        Hd, _, _ = _damped(Hs, 0.01)

        def err(s):
            d = W - (Q.float().view(3, 24, 4, 16) * s.float()[..., None]).view(3, 24, 64)
            return ((d @ Hd) * d).sum(-1)                                   # [E, out]
        e1, e2 = err(S), err(S2)
        assert bool((e2 <= e1).all()) and float(e2.sum()) < 0.99 * float(e1.sum())
        changed = (S != S2).any(-1)
        assert bool((e2[changed] < e1[changed]).all())                     # a row changes only to gain
    # Before bf16 rounding, the refit is the least-squares solution (float64 check on one row).
    Q, S = gptq_quantize(W, H, 16)
    Hd, _, _ = _damped(H, 0.01)
    M = torch.zeros(64, 4, dtype=torch.float64)
    for j in range(4):
        M[j * 16:(j + 1) * 16, j] = Q[1, 7, j * 16:(j + 1) * 16].double()
    h = Hd[1].double()
    s = torch.linalg.solve(M.T @ h @ M, M.T @ h @ W[1, 7].double())
    S2 = gptq_quantize(W, H, 16, refit=True)[1]
    assert torch.allclose(S2[1, 7].double(), s, rtol=2 ** -7) or torch.equal(S2[1, 7], S[1, 7])


def test_scale_search_never_loses_to_mse_within_a_group():
    """With one group per row the solver's loss is the row's whole (damped) Hessian error, and the
    search scores exactly that over the same divisor grid as mse: per row it can only be lower."""
    W, H, _ = _problem(seed=4, n=64)
    Hd = H + 0.01 * H.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(64)
    errs = {}
    for clip in ("mse", "search"):
        Q, S = gptq_quantize(W, H, 64, clip=clip, block=64)
        d = W - Q.float() * S.float()                                   # one group: [E, out, 64]
        errs[clip] = torch.einsum("eoi,eij,eoj->eo", d, Hd, d)
    assert (errs["search"] <= errs["mse"] * (1 + 1e-4)).all()
    assert errs["search"].sum() < 0.97 * errs["mse"].sum(), float(errs["search"].sum() / errs["mse"].sum())


def test_asym_target_aims_at_the_full_precision_output():
    """--gptq-asym: w* = wd C H^-1 minimises |wd a0 - w a|^2 over w (a0: full-precision gate/up path,
    a: quantized path). Checked against lstsq, and it is wd itself when the paths agree."""
    from kq.quantize.layerwise import _asym_target
    g = torch.Generator().manual_seed(5)
    T, H, I, O = 3000, 32, 16, 24
    x = torch.randn(T, H, generator=g)
    wgu = torch.randn(2 * I, H, generator=g) * 0.2
    wd = torch.randn(O, I, generator=g)
    act = torch.nn.functional.silu
    wq = wgu + torch.randn(2 * I, H, generator=g) * 0.03
    gq, uq = (x @ wq.T).split(I, -1)
    a = act(gq) * uq
    g0, u0 = (x @ wgu.T).split(I, -1)
    a0 = act(g0) * u0
    w = _asym_target(wd, x, wgu, a, a.T @ a, act, None, 1e-9)
    ref = torch.linalg.lstsq(a.double(), (a0 @ wd.T).double()).solution.T.float()
    assert torch.allclose(w, ref, rtol=1e-3, atol=1e-3)
    err = lambda m: float((a0 @ wd.T - a @ m.T).square().sum())
    assert err(w) < 0.95 * err(wd)
    same = _asym_target(wd, x, wgu, a0, a0.T @ a0, act, None, 1e-9)
    assert torch.allclose(same, wd, rtol=1e-3, atol=1e-3)
