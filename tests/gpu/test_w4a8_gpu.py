"""The W4A8 prefill MoE (kq/kernels/w4a8.py) compiled on a Hopper GPU against its float64 torch reference.

Weights go through the real pipeline (checkpoint nibbles -> prepack_moe(lane=True)); fresh random inputs
per case; intermediate and output buffers poisoned (NaN) so an unwritten routed row fails.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper GPU (FP8 wgmma)", allow_module_level=True)

from kq.kernels import prepack_moe  # noqa: E402
from kq.kernels import w4a8  # noqa: E402
from kq.kernels.layout import pack_checkpoint_nibbles  # noqa: E402

DEV = "cuda"


def _moe(e, h, i, gen):
    def mat(n, k):
        nib = torch.randint(0, 16, (e, n, k), generator=gen, device=DEV)
        s = (torch.rand(e, n, k // 128, generator=gen, device=DEV) * 0.02 + 1e-3).to(torch.bfloat16)
        return pack_checkpoint_nibbles(nib), s
    (p13, s13), (p2, s2) = mat(2 * i, h), mat(h, i)
    return prepack_moe(p13, s13, p2, s2, 128, lane=True)


def _poison(monkeypatch):
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        if t.is_floating_point() and t.element_size() >= 2:
            t.fill_(float("nan"))
        return t
    monkeypatch.setattr(w4a8.torch, "empty", empty)


CASES = [  # E, H, I, T, k, cfg family (small: the Triton kernel's tiles, large: BLOCK_M 128), cvt
    (8, 256, 128, 5, 2, "small", 1), (16, 512, 256, 77, 4, "small", 0), (16, 512, 256, 77, 4, "large", 1),
    (32, 1024, 384, 300, 8, "large", 0), (32, 1024, 384, 300, 8, "small", 1), (4, 768, 640, 130, 3, "large", 1),
    (8, 256, 128, 5, 2, "small", 2), (16, 512, 256, 77, 4, "large", 2), (32, 1024, 384, 300, 8, "small", 2),
    (32, 1024, 384, 300, 8, "large", 2), (4, 768, 640, 130, 3, "small", 2), (4, 2304, 640, 130, 3, "small", 2),
    (4, 768, 256, 600, 3, "small", 2),
    # the register-operand kernel (w4a8_rs.py): one, two, four warpgroups, 64- and 32-row routed blocks
    # (K blocks 1-18)
    (8, 256, 128, 5, 2, "rs", 3), (16, 512, 256, 77, 4, "rswg2", 3), (32, 1024, 384, 300, 8, "rs", 3),
    (32, 1024, 384, 300, 8, "rswg4", 3), (4, 768, 640, 130, 3, "rs32", 3), (4, 2304, 640, 130, 3, "rswg2", 3),
    (4, 768, 256, 600, 3, "rswg4", 3), (16, 512, 256, 77, 4, "rs32", 3),
    (32, 1024, 384, 300, 8, "default", 3), (4, 768, 256, 600, 3, "default", 3),    # both branches of configs()
    (16, 512, 256, 1100, 8, "default", 3),     # 8800 pairs: moe_align's chunked path (SORTED_ALIGN_MIN_PAIRS)
]
RS = {"rs": ((64, 32, 4, 4), (64, 64, 4, 3)), "rswg2": ((64, 64, 8, 3), (64, 128, 8, 3)),
      "rswg4": ((64, 128, 16, 3), (64, 256, 16, 3)), "rs32": ((32, 64, 8, 3), (32, 128, 8, 4))}


@pytest.mark.parametrize("e,h,i,t,k,family,cvt", CASES)
def test_w4a8_matches_reference(e, h, i, t, k, family, cvt, monkeypatch):
    gen = torch.Generator(device=DEV).manual_seed(e * 131 + t + cvt)
    pp = _moe(e, h, i, gen)
    x = (torch.randn(t, h, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen, device=DEV)[:k] for _ in range(t)]).to(torch.int32)
    ids[0, 0] = -1                                        # another EP rank's expert
    tw = torch.rand(t, k, generator=gen, device=DEV)
    if family in RS:
        up, dn = RS[family]
        cfg = (w4a8.W4A8Config(*up, 3), w4a8.W4A8Config(*dn, 3))
    elif family == "large":   # BLOCK_M 128 on two warpgroups
        cfg = (w4a8.W4A8Config(128, 64, 8, 4, cvt), w4a8.W4A8Config(128, 128, 8, 3, cvt))
    elif family == "default":   # what fused_moe_w4a8 picks
        cfg = w4a8.configs(t * k, e)
    else:                       # the Triton kernel's own tiles (BLOCK_M 64 on one warpgroup)
        cfg = tuple(w4a8.W4A8Config(*tiles, cvt, 168) for tiles in ((64, 64, 4, 4), (64, 128, 4, 3)))
    _poison(monkeypatch)
    got = w4a8.fused_moe_w4a8(x, pp, tw, ids, config=cfg, routed_scaling_factor=2.5)
    ref = w4a8.reference(x, pp, tw, ids, routed_scaling_factor=2.5)
    assert torch.isfinite(got).all()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1e-2, err


def test_w4a8_expert_map():
    gen = torch.Generator(device=DEV).manual_seed(3)
    e_local, e_global, t, k = 8, 16, 40, 4
    pp = _moe(e_local, 512, 256, gen)
    emap = torch.full((e_global,), -1, dtype=torch.int32, device=DEV)
    emap[4:12] = torch.arange(8, dtype=torch.int32, device=DEV)
    x = torch.randn(t, 512, generator=gen, device=DEV).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e_global, generator=gen, device=DEV)[:k] for _ in range(t)]).to(torch.int32)
    tw = torch.rand(t, k, generator=gen, device=DEV)
    got = w4a8.fused_moe_w4a8(x, pp, tw, ids, expert_map=emap)
    ref = w4a8.reference(x, pp, tw, ids, expert_map=emap)
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2


@pytest.mark.parametrize("cvt", [1, 2, 3])
def test_quantize_rows_matches_cpu(cvt):
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = (torch.randn(33, 640, generator=gen, device=DEV) * 10).to(torch.bfloat16)
    q, s, r = w4a8.quantize_rows(x, cvt)
    cq, cs, _ = w4a8.quantize_rows(x.cpu(), cvt)
    assert torch.allclose(s.cpu(), cs, rtol=1e-6)
    # the GPU divides with div.full (2 ulp): a code may land on the other side of a rounding tie
    differ = (q.cpu().view(torch.uint8) != cq.view(torch.uint8)).float().mean().item()
    assert differ < 1e-3
    assert (q.cpu().view(torch.uint8)[:, 640:] == 0).all()
    if cvt >= 2:        # block sums of the codes the kernel wrote, / 64
        want = q.float().view(33, -1, 128).double().sum(-1) / 64
        assert r.shape == (33, 5) and torch.allclose(r.double(), want, rtol=1e-6, atol=1e-6)
    else:
        assert r is None


def test_w4a8_cuda_graph_replay():
    gen = torch.Generator(device=DEV).manual_seed(9)
    pp = _moe(16, 512, 256, gen)
    sc = w4a8.block_scales(pp)
    x = torch.randn(64, 512, generator=gen, device=DEV).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=gen, device=DEV)[:4] for _ in range(64)]).to(torch.int32)
    tw = torch.rand(64, 4, generator=gen, device=DEV)
    w4a8.fused_moe_w4a8(x, pp, tw, ids, scales=sc)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = w4a8.fused_moe_w4a8(x, pp, tw, ids, scales=sc)
    x.copy_(torch.randn(64, 512, generator=gen, device=DEV).to(torch.bfloat16))
    ids.copy_(torch.stack([torch.randperm(16, generator=gen, device=DEV)[:4] for _ in range(64)]).to(torch.int32))
    g.replay()
    ref = w4a8.reference(x, pp, tw, ids)
    assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2
