"""The Triton kernels on the CPU through Triton's interpreter, against the torch reference.

Needs triton installed (a CPU-only torch is fine). The interpreter runs the kernels' dots in
fp32 (DOT_F32: it mis-multiplies bf16 dots), so the bf16 tensor-core path is GPU-tested only.
"""
import importlib.util
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if "kq.kernels.triton_ops" in sys.modules and "_triton_interpreter" not in sys.modules:
    pytest.skip("kq.kernels.triton_ops was already loaded compiled (a CUDA run): "
                "the GPU tests cover it", allow_module_level=True)
import _triton_interpreter  # noqa: E402,F401  (loads kq's kernels under the interpreter)
import torch  # noqa: E402

from kq.kernels import prepack_linear, prepack_moe, reference  # noqa: E402
from kq.kernels.layout import pack_checkpoint_nibbles, unpack_checkpoint_nibbles  # noqa: E402

ops = _triton_interpreter.ops
assert ops._INTERPRETED


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Triton consults TRITON_INTERPRET again while launching; set it only while these tests run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _weights(e, n, k, group, gen):
    nib = torch.randint(0, 16, (e, n, k), generator=gen)
    return pack_checkpoint_nibbles(nib), (torch.rand(e, n, k // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m,n,k,group,cfg", [
    (3, 80, 256, 32, None),                               # N not a multiple of the tile
    (1, 48, 192, 64, None),                               # K padded to 256
    (17, 64, 384, 128, ops.TileConfig(16, 32, 3)),       # odd M over two row blocks, split-K 3
    (5, 64, 256, 32, ops.TileConfig(16, 64, 2)),
])
def test_dense_kernel_matches_reference(m, n, k, group, cfg):
    gen = torch.Generator().manual_seed(m * n + k)
    p, s = _weights(1, n, k, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    got = ops.w4a16_linear(x, w, config=cfg)
    want = reference.w4a16_linear(x, w)
    assert got.shape == (m, n)
    assert _rel(got, want) < 8e-3


@pytest.mark.parametrize("m,n,k,group,cfg", [
    (3, 80, 256, 32, None),                               # N not a multiple of the tile
    (1, 48, 192, 64, None),                               # K padded to 256
    (17, 64, 384, 128, ops.TileConfig(16, 32, 3)),       # odd M over two row blocks, split-K 3
])
def test_dense_kernel_reads_the_lane_layout(m, n, k, group, cfg):
    # a lane-layout linear (E = 1 of the MoE's lane layout) through the Triton kernel's LANE mode,
    # against the reference on the tiles layout of the same checkpoint tensors
    gen = torch.Generator().manual_seed(m * n + k + 1)
    p, s = _weights(1, n, k, group, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    got = ops.w4a16_linear(x, prepack_linear(p[0], s[0], group, lane=True), config=cfg)
    assert got.shape == (m, n)
    assert _rel(got, reference.w4a16_linear(x, prepack_linear(p[0], s[0], group))) < 8e-3


@pytest.mark.parametrize("m,n,k,group,cfg", [
    (17, 80, 256, 32, ops.TileConfig(16, 64, swap=True)),          # odd M over two row blocks, N past the tile
    (5, 128, 320, 64, ops.TileConfig(32, 64, swap=True)),           # K padded to 384
    (33, 64, 384, 128, ops.TileConfig(16, 64, 3, swap=True)),       # split-K 3: fp32 partials, then the reduce
    (9, 96, 256, 128, ops.TileConfig(16, 64, 2, masks=True, swap=True)),
])
def test_swap_kernel_matches_reference(m, n, k, group, cfg):
    gen = torch.Generator().manual_seed(m * n + k + 7)
    p, s = _weights(1, n, k, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    got = ops.w4a16_linear(x, w, config=cfg)
    assert got.shape == (m, n)
    assert _rel(got, reference.w4a16_linear(x, w)) < 8e-3


@pytest.mark.parametrize("group,k", [(32, 256), (64, 320), (128, 384)])
def test_swap_kernel_partial_sums_are_exact(group, k):
    # swap_kernel multiplies the scale into the operand, each weight q * s rounded to bf16: its fp32
    # partial sums (one K block per split) equal, to fp32 rounding, a float64 product with the
    # checkpoint's weights rounded the same way (an indexing slip would be off by O(1))
    gen = torch.Generator().manual_seed(group + k)
    m, n = 19, 80
    p, s = _weights(1, n, k, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    split = -(-k // 128)              # one K block per split
    part = torch.full((split, m, n), float("nan"))
    ops._launch_swap(x, w.q, w.s, part, k, n, group, ops.TileConfig(16, 64, split, swap=True), rows=m)
    codes = unpack_checkpoint_nibbles(p[0]).double() - 8
    wq = (codes * s[0].double().repeat_interleave(group, dim=1)).to(torch.bfloat16).double()
    assert _rel(part.double().sum(0), x.double() @ wq.t()) < 1e-6


@pytest.mark.parametrize("swap", [False, True])
def test_a_split_that_does_not_divide_the_k_blocks_is_refused(swap):
    gen = torch.Generator().manual_seed(5)
    p, s = _weights(1, 64, 384, 128, gen)         # 3 blocks of 128 inputs
    x = torch.randn(2, 384, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="split_k 2 does not divide the 3 K blocks of 128"):
        ops.w4a16_linear(x, prepack_linear(p[0], s[0], 128), config=ops.TileConfig(16, 64, 2, swap=swap))


def test_swap_config_refuses_the_lane_layout():
    gen = torch.Generator().manual_seed(3)
    p, s = _weights(1, 64, 128, 128, gen)
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="tiles layout"):
        ops.w4a16_linear(x, prepack_linear(p[0], s[0], 128, lane=True), config=ops.TileConfig(16, 64, swap=True))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_lane_dequantisation_is_the_tiles_one(group):
    # the large-M path (dequantise once, then a matmul) of a lane-layout linear: its bf16 W^T equals
    # the tiles layout's byte for byte, K padded (320 -> 384 below group 128) and N past the last
    # 128-wide program
    gen = torch.Generator().manual_seed(group)
    k = 320 if group < 128 else 384
    p, s = _weights(1, 144, k, group, gen)
    lane, tiles = prepack_linear(p[0], s[0], group, lane=True), prepack_linear(p[0], s[0], group)
    wt = ops.dequantize(lane)
    assert wt.shape == (k, 144) and torch.equal(wt, ops.dequantize(tiles))
    x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
    got = ops.w4a16_linear(x, lane, dequant_min_m=1)
    assert _rel(got, reference.w4a16_linear(x, tiles)) < 8e-3


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("masks", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_fold_and_mask_variants_match_reference(fold, masks, group):
    # FOLD (codes as q + 136, offset taken off per group) and the unmasked EVEN_K/EVEN_N loads,
    # each on and off, on a shape where the masks are idle (K = 256, N = 64 = BLOCK_N), M odd
    gen = torch.Generator().manual_seed(group + 2 * fold + masks)
    p, s = _weights(1, 64, 256, group, gen)
    w = prepack_linear(p[0], s[0], group)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    got = ops.w4a16_linear(x, w, config=ops.TileConfig(16, 64, fold=fold, masks=masks))
    assert _rel(got, reference.w4a16_linear(x, w)) < 8e-3
    E, H, I, T, k = 4, 256, 128, 3, 2
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    pp = prepack_moe(p13, s13, p2, s2, group)
    xm = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 1], [2, 3]], dtype=torch.int32)
    tw = torch.rand(T, k, generator=gen)
    cfg = ops.TileConfig(16, 64, fold=fold, masks=masks)
    got = ops.fused_moe_w4a16(xm, pp, tw, ids, configs=(cfg, cfg))
    assert _rel(got, reference.fused_moe_w4a16(xm, pp, tw, ids)) < 1.5e-2


def test_dense_dequantize_then_matmul_path_matches_reference():
    gen = torch.Generator().manual_seed(3)
    p, s = _weights(1, 40, 192, 64, gen)
    w = prepack_linear(p[0], s[0], 64)
    x = torch.randn(6, 192, generator=gen).to(torch.bfloat16)
    wt = ops.dequantize(w).float().t()
    want = reference.dequantize_prepacked(w.q[None], w.s[None], 192, 64)[0]
    # within one bf16 step (the interpreter truncates float->bf16 where the GPU rounds)
    assert torch.allclose(wt, want, rtol=2 ** -7, atol=0)
    got = ops.w4a16_linear(x, w, dequant_min_m=1)
    assert _rel(got, reference.w4a16_linear(x, w)) < 8e-3


def _check_routing(ids, emap, e, block_m):
    pairs, blk_e, blk_s, blk_c = ops.moe_align(ids, e, block_m, emap)
    local = reference.local_expert_ids(ids, emap).flatten()
    seen = []
    for b in range(blk_e.numel()):
        ex = int(blk_e[b])
        if ex < 0:
            continue
        c, s0 = int(blk_c[b]), int(blk_s[b])
        assert 1 <= c <= block_m
        rows = pairs[s0:s0 + c].tolist()
        assert all(int(local[p]) == ex for p in rows)
        seen += rows
    want = sorted(p for p in range(local.numel()) if int(local[p]) >= 0)
    assert sorted(seen) == want          # every local pair exactly once, remote pairs never
    return blk_e


def test_routing_table_of_a_prefill_sized_batch():
    """8800 pairs: moe_align's 2048-pair steps (prefill sizes), a chunk boundary inside every expert's
    run, remote experts through a map, a -1 id."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(24, generator=gen)[:8] for _ in range(1100)]).to(torch.int32)
    ids[7, 3] = -1
    emap = torch.full((24,), -1, dtype=torch.int32)
    emap[2:18] = torch.randperm(16, generator=gen).to(torch.int32)
    blk_e = _check_routing(ids, emap, 16, 64)
    assert set(blk_e.tolist()) - {-1} == set(range(16))
    _check_routing(ids.clamp(max=15), None, 16, 32)


@pytest.mark.parametrize("e,t", [(15, 1100), (16, 1030)])
def test_sorted_routing_table_is_the_per_expert_one(e, t, monkeypatch):
    """From SORTED_ALIGN_MIN_PAIRS pairs moe_align counts, sorts and scatters 1024-pair chunks: the same
    table, bit for bit, as the one program an expert below it (pairs of an expert in increasing order,
    i.e. a stable sort of the local ids), with an expert map, a -1 id and E + 1 a power of two or not."""
    gen = torch.Generator().manual_seed(e)
    ids = torch.stack([torch.randperm(e + 4, generator=gen)[:8] for _ in range(t)]).to(torch.int32)
    ids[3, 1] = -1
    emap = torch.full((e + 4,), -1, dtype=torch.int32)
    emap[3:3 + e] = torch.randperm(e, generator=gen).to(torch.int32)
    assert ids.numel() >= ops.SORTED_ALIGN_MIN_PAIRS
    got = ops.moe_align(ids, e, 64, emap)
    monkeypatch.setattr(ops, "SORTED_ALIGN_MIN_PAIRS", 10 ** 9)
    want = ops.moe_align(ids, e, 64, emap)
    local = reference.local_expert_ids(ids, emap).flatten()
    n = int((local >= 0).sum())
    used = want[1] >= 0                        # (the rest of pairs and of the unused blocks is never read)
    assert torch.equal(got[0][:n], want[0][:n]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2][used], want[2][used]) and torch.equal(got[3][used], want[3][used])
    order = torch.argsort(torch.where(local >= 0, local, e), stable=True)[:n]
    assert torch.equal(got[0][:n], order.to(torch.int32))
    _check_routing(ids, emap, e, 64)


def test_routing_table_covers_each_local_pair_once():
    ids = torch.tensor([[0, 3, 5], [3, 1, 0], [1, 0, 3], [5, 3, 1], [0, 1, 3]], dtype=torch.int32)
    blk_e = _check_routing(ids, None, 6, 2)
    assert set(blk_e.tolist()) - {-1} == {0, 1, 3, 5}      # experts 2 and 4 get no block
    _check_routing(ids, torch.tensor([1, -1, 2, 0, 4, 5], dtype=torch.int32), 6, 4)


def test_one_token_routing_is_the_identity_without_a_launch():
    ids = torch.tensor([[3, 0, -1, 5]], dtype=torch.int32)
    pairs, blk_e, blk_s, blk_c = ops.route(ids, 6, 16)
    assert blk_e.data_ptr() == ids.data_ptr()                 # the ids themselves, read in place
    assert pairs.tolist() == blk_s.tolist() == [0, 1, 2, 3] and blk_c.tolist() == [1, 1, 1, 1]
    assert ops.route(ids, 6, 8)[0] is pairs                   # the constant half is made once
    # every local pair exactly once with its expert, the -1 pair in an unused block: moe_align's contract
    local = reference.local_expert_ids(ids, None).flatten()
    seen = [int(pairs[int(blk_s[b])]) for b in range(4) if int(blk_e[b]) >= 0]
    assert seen == [0, 1, 3] and all(int(blk_e[b]) == int(local[p]) for b, p in zip([0, 1, 3], seen))
    # not one token, int64 ids, or an expert map: moe_align's table (blocks in expert order)
    two = torch.tensor([[3, 0], [0, 5]], dtype=torch.int32)
    assert ops.one_token_routing(two) is None and ops.one_token_routing(ids.long()) is None
    assert set(ops.route(two, 6, 16)[1].tolist()) == {0, 3, 5, -1}
    emap = torch.tensor([1, -1, 2, 0, 4, 5], dtype=torch.int32)
    assert ops.route(ids, 6, 16, emap)[1].tolist()[:3] == [0, 1, 5]      # local ids 0, 1, -1, 5 sorted


@pytest.mark.parametrize("group,ids", [(32, [[0, 3, 5]]), (128, [[4, -1, 1]])])
def test_one_token_moe_matches_reference(group, ids):
    gen = torch.Generator().manual_seed(group)
    E, H, I = 6, 256, 128
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    pp = prepack_moe(p13, s13, p2, s2, group)
    x = torch.randn(1, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor(ids, dtype=torch.int32)
    tw = torch.rand(1, 3, generator=gen)
    got = ops.fused_moe_w4a16(x, pp, tw, ids, routed_scaling_factor=2.5)
    want = reference.fused_moe_w4a16(x, pp, tw, ids, routed_scaling_factor=2.5)
    assert _rel(got, want) < 1.5e-2


@pytest.mark.parametrize("group,use_map,cfgs", [
    (32, False, None),
    (64, True, (ops.TileConfig(16, 32, 2), ops.TileConfig(16, 64, 1))),
    (128, False, (ops.TileConfig(64, 64, 1), ops.TileConfig(64, 128, 1))),   # prefill-style tiles
])
def test_fused_moe_kernel_matches_reference(group, use_map, cfgs):
    gen = torch.Generator().manual_seed(group)
    E, H, I, T, k = 6, 256, 128, 5, 3
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    pp = prepack_moe(p13, s13, p2, s2, group)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3, 5], [3, 1, 0], [1, 0, 3], [5, 3, 1], [0, 1, 3]], dtype=torch.int32)
    tw = torch.rand(T, k, generator=gen)
    emap = torch.tensor([1, -1, 2, 0, 4, 5], dtype=torch.int32) if use_map else None
    got = ops.fused_moe_w4a16(x, pp, tw, ids, expert_map=emap, routed_scaling_factor=2.5, configs=cfgs)
    want = reference.fused_moe_w4a16(x, pp, tw, ids, expert_map=emap, routed_scaling_factor=2.5)
    assert got.shape == (T, H)
    assert _rel(got, want) < 1.5e-2      # the kernel rounds the SiLU*mul activations to bf16


_IDS = torch.tensor([[0, 3, 5], [3, 1, 0], [1, 0, 3], [5, 3, 1], [0, 1, 3]], dtype=torch.int32)
_EMAP = torch.tensor([1, -1, 2, 0, 4, 5], dtype=torch.int32)     # global 1 on another rank


@pytest.mark.parametrize("group,use_map,H,I,cfgs", [
    (32, False, 256, 128, None),
    (64, True, 256, 128, (ops.TileConfig(16, 32, 2), ops.TileConfig(16, 64, 1))),     # split-K 2
    (128, False, 256, 128, (ops.TileConfig(64, 64, 1), ops.TileConfig(64, 128, 1))),  # prefill-style tiles
    (64, True, 256, 192, None),                         # I not a multiple of 128: down's K padded
    (32, False, 160, 96, (ops.TileConfig(16, 64, 1), ops.TileConfig(16, 128, 1))),   # N % BLOCK_N != 0, H padded
    (128, True, 256, 128, (ops.TileConfig(16, 64, 2, fold=False, masks=True),          # the masked, unfolded
                           ops.TileConfig(16, 64, 1, fold=False, masks=True))),        # loads at group 128
    (32, False, 256, 128, (ops.TileConfig(16, 64, 1, fold=True, masks=True),) * 2),   # FOLD at group 32
])
def test_fused_moe_kernel_reads_the_lane_layout(group, use_map, H, I, cfgs):
    # the same checkpoint tensors prepacked both ways: the kernel on the lane layout against the
    # reference on the tiles layout (the lane layout's reference path is another test's)
    gen = torch.Generator().manual_seed(group + I)
    E, T, k = 6, 5, 3
    p13, s13 = _weights(E, 2 * I, H, group, gen)
    p2, s2 = _weights(E, H, I, group, gen)
    lane = prepack_moe(p13, s13, p2, s2, group, lane=True)
    tiles = prepack_moe(p13, s13, p2, s2, group)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    tw = torch.rand(T, k, generator=gen)
    emap = _EMAP if use_map else None
    got = ops.fused_moe_w4a16(x, lane, tw, _IDS, expert_map=emap, routed_scaling_factor=2.5, configs=cfgs)
    want = reference.fused_moe_w4a16(x, tiles, tw, _IDS, expert_map=emap, routed_scaling_factor=2.5)
    assert got.shape == (T, H)
    assert _rel(got, want) < 1.5e-2      # the kernel rounds the SiLU*mul activations to bf16


def test_lane_gate_up_stage_matches_the_tiles_layout():
    # stage 1 alone, split-K 2, I = 96 on 64-column tiles, on both layouts: up's columns must come
    # from the second half of w13
    gen = torch.Generator().manual_seed(5)
    E, H, I, T, k = 3, 256, 96, 4, 2
    p13, s13 = _weights(E, 2 * I, H, 32, gen)
    p2, s2 = _weights(E, H, I, 32, gen)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0]], dtype=torch.int32)
    cfg = ops.TileConfig(16, 64, 2)
    routing = ops.moe_align(ids, E, cfg.block_m)
    acts = [ops.moe_gate_up(x, prepack_moe(p13, s13, p2, s2, 32, lane=lane), routing, k, cfg)
            for lane in (False, True)]
    assert _rel(acts[1], acts[0]) < 1e-2


@pytest.mark.parametrize("use_map", [False, True])
def test_fused_moe_skips_pairs_marked_minus_one(use_map):
    # SGLang's EP dispatcher hands local ids with -1 for experts on other ranks
    gen = torch.Generator().manual_seed(11)
    E, H, I, T, k = 4, 128, 128, 3, 2
    p13, s13 = _weights(E, 2 * I, H, 64, gen)
    p2, s2 = _weights(E, H, I, 64, gen)
    pp = prepack_moe(p13, s13, p2, s2, 64)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, -1], [-1, 3], [2, 0]], dtype=torch.int32)
    tw = torch.rand(T, k, generator=gen)
    emap = torch.arange(E, dtype=torch.int32) if use_map else None
    got = ops.fused_moe_w4a16(x, pp, tw, ids, expert_map=emap)
    want = reference.fused_moe_w4a16(x, pp, tw, ids, expert_map=emap)
    only_local = reference.fused_moe_w4a16(x, pp, tw * (ids >= 0), ids.clamp(min=0), expert_map=emap)
    assert torch.equal(want, only_local)
    assert _rel(got, want) < 1.5e-2


def test_tile_heuristics_split_k_divides_k_blocks_and_stay_on_mma_sync_tiles():
    for m, n, k in [(1, 12288, 6144), (16, 4096, 7168), (64, 12288, 6144), (200, 7168, 2048), (1, 96, 192)]:
        cfg = ops.dense_config(m, n, k, 132)
        assert (-(-k // 128)) % cfg.split_k == 0 and (-(-k // 128)) // cfg.split_k >= 1
        assert cfg.block_m in (16, 32)          # BLOCK_M 64 would take the slow wgmma/plain path
    assert ops.dense_config(1, 12288, 6144, 132).split_k == 4
    # on Hopper (swap=True) swap_kernel takes 33-255 rows: 64 activation rows split to two waves up to 64
    # rows (the probe's pick: 12288x6144 at 48-64 rows split 4, 4096x7168 split 8), 128 unsplit above;
    # 2 stages (3 programs per SM) where that makes the grid one wave
    for m, n, k, want in [(48, 12288, 6144, (64, 4, 2)), (64, 12288, 6144, (64, 4, 2)), (64, 4096, 7168, (64, 8, 3)),
                          (65, 12288, 6144, (128, 1, 3)), (255, 7168, 2048, (128, 1, 3))]:
        cfg = ops.dense_config(m, n, k, 132, swap=True)
        assert cfg.swap and (cfg.block_m, cfg.split_k, cfg.num_stages) == want and (cfg.block_n, cfg.num_warps) == (128, 8)
        assert (-(-k // 128)) % cfg.split_k == 0
    for m in (1, 16, 32):                       # mma.sync up to 32 rows, with or without wgmma
        assert ops.dense_config(m, 12288, 6144, 132, swap=True) == ops.dense_config(m, 12288, 6144, 132)
    c1, c2 = ops.moe_configs(1 * 8, 384, 7168, 256, 132, 128)       # one token: 8 blocks x 4 column tiles
    assert (c1.block_m, c1.split_k, c2.block_m, c2.block_n) == (16, 8, 16, 128)
    assert ops.moe_configs(16 * 8, 384, 7168, 256, 132, 32)[1].block_n == 64
    p1, p2 = ops.moe_configs(4096 * 8, 256, 6144, 2048, 132, 128)     # prefill: mma.sync tiles too
    assert (p1.block_m, p1.block_n, p1.split_k, p2.block_m, p2.block_n) == (16, 128, 1, 32, 128)
    m1, m2 = ops.moe_configs(512 * 8, 256, 6144, 2048, 132, 128)      # 16 pairs per expert
    assert (m1.block_m, m2.block_m) == (16, 16)
