"""The Triton kernels on a CUDA GPU against the float32 torch reference (run on the H200).

Random inputs drawn fresh for every case, outputs poisoned (NaN) before each run so an
unwritten element fails, shapes chosen to hit the edges: odd M, N not a multiple of the
tile, K padded, every group size, experts with no tokens, an expert map, split-K on and off.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kq.kernels import prepack_linear, prepack_moe, reference  # noqa: E402
from kq.kernels.layout import pack_checkpoint_nibbles  # noqa: E402

ops = pytest.importorskip("kq.kernels.triton_ops")
DEV = "cuda"


def _weights(e, n, k, group, gen):
    nib = torch.randint(0, 16, (e, n, k), generator=gen, device=DEV)
    scale = (torch.rand(e, n, k // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    return pack_checkpoint_nibbles(nib), scale


def _rel(a, b):
    assert not torch.isnan(a).any(), "unwritten (NaN-poisoned) or NaN output"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _poisoned_out(monkeypatch):
    """Make torch.empty in the launch wrappers return NaN-filled buffers."""
    real_empty = torch.empty

    def empty(*a, **kw):
        t = real_empty(*a, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.int32:
            t.fill_(-7)
        return t
    monkeypatch.setattr(ops.torch, "empty", empty)


DENSE_CASES = [(m, n, k, g) for g in (32, 64, 128)
               for (m, n, k) in [(1, 4096, 7168), (3, 200, 384), (17, 1000, 2048), (64, 7168, 2048),
                                 (129, 768, 1536), (300, 520, 1024), (1, 96, 192 if g != 128 else 256)]]


@pytest.mark.parametrize("m,n,k,group", DENSE_CASES)
def test_dense_matches_reference(m, n, k, group, monkeypatch):
    gen = torch.Generator(device=DEV).manual_seed(m * 7 + n + k + group)
    p, s = _weights(1, n, k, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    _poisoned_out(monkeypatch)
    got = ops.w4a16_linear(x, w)
    assert _rel(got, reference.w4a16_linear(x, w)) < 8e-3


@pytest.mark.parametrize("split", [1, 2, 4])
def test_dense_split_k_configs(split, monkeypatch):
    gen = torch.Generator(device=DEV).manual_seed(split)
    p, s = _weights(1, 520, 1024, 64, gen)
    w = prepack_linear(p[0], s[0], 64)
    x = torch.randn(5, 1024, generator=gen, device=DEV).to(torch.bfloat16)
    _poisoned_out(monkeypatch)
    for cfg in (ops.TileConfig(16, 64, split), ops.TileConfig(16, 128, split, num_warps=8)):
        assert _rel(ops.w4a16_linear(x, w, config=cfg), reference.w4a16_linear(x, w)) < 8e-3


SWAP_CONFIGS = [ops.TileConfig(bm, bn, split, warps, stages, swap=True, masks=masks)
                for bm, bn, split, warps, stages, masks in [
                    (16, 64, 1, 4, 3, False), (32, 128, 2, 4, 3, False), (64, 128, 4, 8, 3, False),
                    (64, 128, 2, 4, 4, True), (128, 128, 1, 8, 3, False), (64, 64, 4, 4, 3, True),
                    (64, 128, 4, 8, 2, False)]]


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="swap_kernel is wgmma: Hopper only")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,n", [(17, 1000), (64, 7168), (33, 520), (200, 768), (1, 256)])
def test_swap_kernel_matches_reference(m, n, group, monkeypatch):
    # every tile shape, split and mask variant of swap_kernel; K padded (not a multiple of 128) at
    # groups 32 and 64; then its fp32 partial sums against a float64 product with the weights rounded
    # to bf16 as the kernel rounds q * s (an indexing slip would be off by O(1), not 1e-5)
    k = 2048 if group == 128 else 960
    gen = torch.Generator(device=DEV).manual_seed(m * 3 + n + group)
    p, s = _weights(1, n, k, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    want = reference.w4a16_linear(x, w)
    _poisoned_out(monkeypatch)
    kb = -(-k // 128)
    for cfg in SWAP_CONFIGS:
        if kb % cfg.split_k == 0:
            assert _rel(ops.w4a16_linear(x, w, config=cfg), want) < 8e-3, cfg
    codes = (p[0].unsqueeze(-1) >> torch.arange(0, 32, 4, device=DEV, dtype=torch.int32) & 0xF).flatten(1).double() - 8
    wq = (codes * s[0].double().repeat_interleave(group, dim=1)).to(torch.bfloat16).double()
    exact = x.double() @ wq.t()
    for split in (1, 3 if kb % 3 == 0 else 2):
        part = torch.full((split, m, n), float("nan"), device=DEV)
        ops._launch_swap(x, w.q, w.s, part, k, n, group, ops.TileConfig(64, 128, split, swap=True), rows=m)
        assert _rel(part.sum(0), exact) < 1e-5       # fp32 sums over K = 2048: ~2e-6


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("fold,masks", [(True, False), (False, False), (True, True), (False, True)])
def test_fold_and_unmasked_loads_match_reference(group, fold, masks, monkeypatch):
    # FOLD takes 136 * sum(x) off per group: activations with a large common offset (mean 4)
    # make that cancellation as hard as it gets; idle masks (K % 128 == 0, N % BLOCK_N == 0)
    # dropped or kept, dense and fused MoE, odd row counts
    gen = torch.Generator(device=DEV).manual_seed(group + 10 * fold + masks)
    p, s = _weights(1, 1024, 4096, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = (torch.randn(7, 4096, generator=gen, device=DEV) + 4.0).to(torch.bfloat16)
    _poisoned_out(monkeypatch)
    cfg = ops.TileConfig(16, 64, 1, fold=fold, masks=masks)
    assert _rel(ops.w4a16_linear(x, w, config=cfg), reference.w4a16_linear(x, w)) < 8e-3
    E, H, I, T, k = 32, 2048, 256, 5, 8
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    pp = prepack_moe(p13, s13, p2, s2, group)
    xm = (torch.randn(T, H, generator=gen, device=DEV) + 4.0).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    cfg2 = ops.TileConfig(16, 128, 1, fold=fold, masks=masks)
    got = ops.fused_moe_w4a16(xm, pp, tw, ids, configs=(cfg, cfg2))
    assert _rel(got, reference.fused_moe_w4a16(xm, pp, tw, ids)) < 1.5e-2


MOE_CASES = [  # E, H, I, T, k, group, use_map
    (16, 512, 256, 1, 8, 128, False),
    (16, 512, 256, 7, 8, 32, True),
    (64, 1024, 128, 33, 8, 64, False),
    (8, 768, 192, 5, 2, 64, False),        # I not a multiple of 128: K of the down projection padded
    (32, 256, 512, 300, 4, 32, True),      # prefill-style tiles (many tokens per expert)
    (160, 5120, 192, 16, 8, 32, False),    # GLM-4.7 TP8 slice
    (32, 256, 128, 1100, 8, 64, True),     # 8800 pairs: moe_align's chunked path (SORTED_ALIGN_MIN_PAIRS)
]


@pytest.mark.parametrize("lane", [False, True])
@pytest.mark.parametrize("E,H,I,T,k,group,use_map", MOE_CASES)
def test_fused_moe_matches_reference(E, H, I, T, k, group, use_map, lane, monkeypatch):
    # lane: the kernel reads the lane layout, the reference the tiles layout of the same checkpoint
    gen = torch.Generator(device=DEV).manual_seed(E + H + T)
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    pp = prepack_moe(p13, s13, p2, s2, group)
    kernel_pp = prepack_moe(p13, s13, p2, s2, group, lane=True) if lane else pp
    x = torch.randn(T, H, generator=gen, device=DEV).to(torch.bfloat16)
    # routing over the first half of the experts only: the rest receive no token
    ids = torch.stack([torch.randperm(max(k, E // 2), generator=gen, device=DEV)[:k] for _ in range(T)])
    ids = ids.to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    emap = None
    if use_map:
        emap = torch.arange(E, device=DEV, dtype=torch.int32)
        emap[1::3] = -1                                   # these experts live on another rank
    _poisoned_out(monkeypatch)
    got = ops.fused_moe_w4a16(x, kernel_pp, tw, ids, expert_map=emap, routed_scaling_factor=2.5)
    want = reference.fused_moe_w4a16(x, pp, tw, ids, expert_map=emap, routed_scaling_factor=2.5)
    assert _rel(got, want) < 1.5e-2


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("fold,masks", [(True, False), (False, False), (True, True), (False, True)])
def test_lane_layout_fold_masks_split_and_prefill_tiles(group, fold, masks, monkeypatch):
    # the lane layout through every kernel variant: FOLD on/off (activations offset by 4, the
    # hardest cancellation), idle masks dropped or kept, split-K 2, and the BLOCK_M 64 tiles (DEQ 1)
    gen = torch.Generator(device=DEV).manual_seed(group + 10 * fold + masks)
    E, H, I, T, k = 32, 2048, 256, 5, 8
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    tiles = prepack_moe(p13, s13, p2, s2, group)
    lane = prepack_moe(p13, s13, p2, s2, group, lane=True)
    x = (torch.randn(T, H, generator=gen, device=DEV) + 4.0).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    want = reference.fused_moe_w4a16(x, tiles, tw, ids)
    _poisoned_out(monkeypatch)
    def cfg(m, n, split=1, warps=4):
        return ops.TileConfig(m, n, split, warps, fold=fold, masks=masks)
    for cfgs in ((cfg(16, 64), cfg(16, 128)), (cfg(16, 64, 2), cfg(16, 64)), (cfg(64, 64, 1, 8), cfg(64, 128, 1, 8))):
        assert _rel(ops.fused_moe_w4a16(x, lane, tw, ids, configs=cfgs), want) < 1.5e-2, cfgs


def test_fused_moe_capture_in_cuda_graph_and_replay_with_new_routing():
    gen = torch.Generator(device=DEV).manual_seed(5)
    E, H, I, T, k, g = 32, 1024, 256, 4, 8, 128
    p13, s13 = _weights(E, 2 * I, H, g, gen)
    p2, s2 = _weights(E, H, I, g, gen)
    pp = prepack_moe(p13, s13, p2, s2, g)
    x = torch.randn(T, H, generator=gen, device=DEV).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    ops.fused_moe_w4a16(x, pp, tw, ids)          # warm-up compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe_w4a16(x, pp, tw, ids)
    for _ in range(3):                           # new routing and inputs written into the captured buffers
        ids.copy_(torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)]))
        x.copy_(torch.randn(T, H, generator=gen, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, reference.fused_moe_w4a16(x, pp, tw, ids)) < 1.5e-2
