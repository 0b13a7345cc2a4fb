"""RTN: codes, bf16 scales, and the MSE search never worse than absmax."""
import torch

from kq.quantize.rtn import quantize_rtn


def _deq(q, s, g):
    return q.float() * s.float().repeat_interleave(g, 1)


def test_absmax_scale_and_range():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    q, s = quantize_rtn(w, 32, "absmax")
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (64, 8)
    assert q.min() >= -8 and q.max() <= 7
    amax = w.reshape(64, 8, 32).abs().amax(-1)
    assert torch.equal(s, (amax / 7.5).to(torch.bfloat16))
    # round to nearest with the stored scale: at most half a step off, except clamped +amax
    err = (_deq(q, s, 32) - w).abs()
    step = s.float().repeat_interleave(32, 1)
    assert (err <= 0.5 * step + 1e-7).float().mean() > 0.97


def test_mse_never_worse_than_absmax_per_group():
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    w[0, :32] = 0  # an all-zero group keeps a non-zero scale
    for g in (32, 64, 128):
        qa, sa = quantize_rtn(w, g, "absmax")
        qm, sm = quantize_rtn(w, g, "mse")
        ea = ((_deq(qa, sa, g) - w) ** 2).reshape(128, -1, g).sum(-1)
        em = ((_deq(qm, sm, g) - w) ** 2).reshape(128, -1, g).sum(-1)
        assert (em <= ea + 1e-12).all()
        assert em.sum() < 0.9 * ea.sum()
        assert (sm.float() > 0).all() and torch.isfinite(sm.float()).all()
        assert (qm[0, :32] == 0).all()


def test_deterministic():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
    a = quantize_rtn(w, 32)
    b = quantize_rtn(w.clone(), 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
