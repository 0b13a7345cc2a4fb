"""The CUDA lane-layout kernel (kq/kernels/cuda_lanes.py: MoE stages, dense linear) against the
torch reference on a GPU."""
import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kq.kernels import prepack_moe, reference  # noqa: E402
from kq.kernels.layout import pack_checkpoint_nibbles  # noqa: E402

lanes = pytest.importorskip("kq.kernels.cuda_lanes")
DEV = "cuda"


def _rel(a, b):
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("E,H,I,T,k,group", [
    (16, 512, 256, 1, 8, 128), (16, 512, 256, 5, 8, 32), (32, 1024, 128, 16, 8, 64),
    (8, 768, 192, 3, 2, 64),          # I not a multiple of 128: the down stage's K is padded
    (64, 2048, 256, 40, 8, 128),      # experts with more than 8 pairs: several 8-row blocks each
])
@pytest.mark.parametrize("use_map", [False, True])
def test_lanes_moe_matches_reference(E, H, I, T, k, group, use_map):
    """The whole MoE (routing, both stages, combine) against the reference of the tiles layout; with
    an expert map (expert parallelism) every other expert is remote (-1) and the local ones renumbered."""
    gen = torch.Generator(device=DEV).manual_seed(E + H + T)
    nib13 = torch.randint(0, 16, (E, 2 * I, H), generator=gen, device=DEV)
    nib2 = torch.randint(0, 16, (E, H, I), generator=gen, device=DEV)
    s13 = (torch.rand(E, 2 * I, H // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    p13, p2 = pack_checkpoint_nibbles(nib13), pack_checkpoint_nibbles(nib2)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    pp = prepack_moe(p13, s13, p2, s2, group)
    x = (torch.randn(T, H, generator=gen, device=DEV) + 1.0).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(max(k, E // 2), generator=gen, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    emap = None
    if use_map:
        emap = torch.full((E,), -1, dtype=torch.int32, device=DEV)
        emap[::2] = torch.arange(0, (E + 1) // 2, dtype=torch.int32, device=DEV)
    got = lanes.fused_moe_lanes(x, lm, tw, ids, expert_map=emap, routed_scaling_factor=2.5)
    want = reference.fused_moe_w4a16(x, pp, tw, ids, expert_map=emap, routed_scaling_factor=2.5)
    assert _rel(got, want) < 1.5e-2


def _weights(e, n, k, group, gen):
    nib = torch.randint(0, 16, (e, n, k), generator=gen, device=DEV)
    s = (torch.rand(e, n, k // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    return pack_checkpoint_nibbles(nib), s, (nib.double() - 8) * s.double().repeat_interleave(group, dim=2)


@pytest.mark.parametrize("variants", [(g or lanes.GATE_UP_VARIANTS[0], d or lanes.DOWN_VARIANTS[0]) for g, d in
                                      itertools.zip_longest(lanes.GATE_UP_VARIANTS, lanes.DOWN_VARIANTS)])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_every_instance_matches_float64(variants, group):
    """Both stages, each (NT, KSPLIT, STAGES, FOLD) instance: K of 5 and 3 blocks (not a multiple of either),
    32 experts of which some get no pair and one gets 11 (two routed blocks), activations with a mean of
    1 and 0.5 (so a wrong 136 * sum(x) offset shows), outputs poisoned."""
    from kq.kernels.triton_ops import moe_align
    gen = torch.Generator(device=DEV).manual_seed(group + sum(map(int, variants[0] + variants[1])))
    E, H, I, T, k = 32, 640, 384, 11, 4
    p13, s13, w13 = _weights(E, 2 * I, H, group, gen)
    p2, s2, w2 = _weights(E, H, I, group, gen)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    ids = torch.stack([torch.randperm(12, generator=gen, device=DEV)[:k] for _ in range(T)])
    ids[:, 0] = 5                                        # expert 5 gets one pair per token: 11 > 8
    ids = ids.to(torch.int32)
    rt = moe_align(ids, E, 8)
    x = (torch.randn(T, H, generator=gen, device=DEV) + 1.0).to(torch.bfloat16)
    act = lanes.moe_gate_up(x, lm, rt, k, variants[0], out=torch.full((T * k, I), float("nan"), device=DEV, dtype=torch.bfloat16))
    flat = ids.view(-1).long()
    z = torch.einsum("ph,pnh->pn", x.double()[torch.arange(T * k, device=DEV) // k], w13[flat])
    want = z[:, :I] / (1 + torch.exp(-z[:, :I])) * z[:, I:]
    assert _rel(act, want) < 1e-2
    a = (torch.randn(T * k, I, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    y = lanes.moe_down(a, lm, rt, variants[1], out=torch.full((T * k, H), float("nan"), device=DEV, dtype=torch.bfloat16))
    assert _rel(y, torch.einsum("pi,phi->ph", a.double(), w2[flat])) < 1e-2


@pytest.mark.parametrize("variants", list(zip(lanes.GATE_UP_SCALE_A_VARIANTS, lanes.DOWN_SCALE_A_VARIANTS)))
@pytest.mark.parametrize("group", [64, 32])
def test_scale_a_instances_match_float64(variants, group):
    """The SCALE_A instances (the group scale multiplied into the weight operand, so each weight is q * s
    rounded to bf16): the cases and bound of test_every_instance_matches_float64 (K of 5 and 3 blocks, 10 and
    6 groups at 64, 20 and 12 at 32; a scale read from the wrong group would be off by far more)."""
    test_every_instance_matches_float64(variants, group)


@pytest.mark.parametrize("variant", lanes.GATE_UP_XSM_VARIANTS)
@pytest.mark.parametrize("H", [640, 1152])
def test_xsm_instances_match_float64(variant, H):
    """The gate+up instances whose activations go through the ring (group 128, so K is whole blocks): K of
    5 and 9 blocks (not multiples of the ring's 4 slots), 11 tokens of which one expert gets 11 pairs
    (two routed blocks), outputs poisoned."""
    from kq.kernels.triton_ops import moe_align
    gen = torch.Generator(device=DEV).manual_seed(H + variant[0])
    E, I, T, k, group = 32, 384, 11, 4, 128
    p13, s13, w13 = _weights(E, 2 * I, H, group, gen)
    p2, s2, _ = _weights(E, H, I, group, gen)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    ids = torch.stack([torch.randperm(12, generator=gen, device=DEV)[:k] for _ in range(T)])
    ids[:, 0] = 5
    ids = ids.to(torch.int32)
    rt = moe_align(ids, E, 8)
    x = (torch.randn(T, H, generator=gen, device=DEV) + 1.0).to(torch.bfloat16)
    act = lanes.moe_gate_up(x, lm, rt, k, variant, out=torch.full((T * k, I), float("nan"), device=DEV, dtype=torch.bfloat16))
    z = torch.einsum("ph,pnh->pn", x.double()[torch.arange(T * k, device=DEV) // k], w13[ids.view(-1).long()])
    assert _rel(act, z[:, :I] / (1 + torch.exp(-z[:, :I])) * z[:, I:]) < 1e-2


@pytest.mark.parametrize("E,T,k", [(64, 4, 8), (16, 300, 4)])
def test_public_moe_on_the_lane_layout_runs_the_cuda_kernel(E, T, k):
    """kq.kernels.fused_moe_w4a16 on a lane-layout layer: the CUDA kernel at decode sizes and above
    (300 tokens x 4 over 16 experts: 75 pairs each, 10 blocks), against the reference of the tiles
    layout; a routing whose 8-pair blocks overflow the grid goes to Triton's LANE mode."""
    from kq.kernels import _lanes_for, fused_moe_w4a16
    gen = torch.Generator(device=DEV).manual_seed(T)
    H, I, group = 512, 256, 128
    p13, s13, _ = _weights(E, 2 * I, H, group, gen)
    p2, s2, _ = _weights(E, H, I, group, gen)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    x = torch.randn(T, H, generator=gen, device=DEV).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    assert _lanes_for(x, lm, T * k) and not _lanes_for(x, lm, 8 * 65536)
    got = fused_moe_w4a16(x, lm, tw, ids)
    want = reference.fused_moe_w4a16(x, prepack_moe(p13, s13, p2, s2, group), tw, ids)
    assert _rel(got, want) < 1.5e-2


@pytest.mark.parametrize("variant", lanes.DENSE_VARIANTS)
@pytest.mark.parametrize("group", [128, 64, 32])
@pytest.mark.parametrize("m", [1, 13, 64])
def test_every_dense_instance_matches_float64(variant, group, m):
    """The dense instances (one matrix, rows in blocks of 8): N = 208 (26 n-tiles, not a multiple of
    the 4 or 8 a column group takes), K of 5 blocks or (below group 128) 3.5, output poisoned."""
    from kq.kernels import prepack_linear
    gen = torch.Generator(device=DEV).manual_seed(group + m + sum(variant))
    n, k = 208, 640 if group == 128 else 448
    p, s, w = _weights(1, n, k, group, gen)
    lin = prepack_linear(p[0], s[0], group, lane=True)
    x = (torch.randn(m, k, generator=gen, device=DEV) + 1.0).to(torch.bfloat16)
    y = lanes.linear(x, lin, variant, out=torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16))
    assert _rel(y, x.double() @ w[0].t()) < 1e-2


@pytest.mark.parametrize("m,path", [(1, "cuda"), (64, "cuda"), (65, "dequant"), (300, "dequant")])
def test_public_linear_on_the_lane_layout(m, path):
    """kq.kernels.w4a16_linear on a lane-layout linear, 3-D input: the CUDA kernel up to
    LANE_LINEAR_MAX_ROWS rows, dequantise + cuBLAS above (LANE_DEQUANT_MIN_M); all against the
    reference on the tiles layout. Triton's LANE mode for a dense matrix: the interpreter tests."""
    from kq.kernels import LANE_LINEAR_MAX_ROWS, prepack_linear, w4a16_linear
    from kq.kernels.triton_ops import LANE_DEQUANT_MIN_M
    assert (m <= LANE_LINEAR_MAX_ROWS) == (path == "cuda") and (path == "cuda" or m >= LANE_DEQUANT_MIN_M)
    gen = torch.Generator(device=DEV).manual_seed(m)
    p, s, _ = _weights(1, 1024, 768, 64, gen)
    x = torch.randn(1, m, 768, generator=gen, device=DEV).to(torch.bfloat16)
    got = w4a16_linear(x, prepack_linear(p[0], s[0], 64, lane=True))
    assert got.shape == (1, m, 1024)
    assert _rel(got, reference.w4a16_linear(x, prepack_linear(p[0], s[0], 64))) < 8e-3


@pytest.mark.parametrize("variant,group", [(v, g) for g in (128, 32) for v in lanes.DOWN_VARIANTS] +
                         [(v, 32) for v in lanes.DOWN_SCALE_A_VARIANTS])     # SCALE_A: built below group 128
def test_one_token_down_with_combine(variant, group):
    """One token: the down stage with the top-k combine in the same launch (moe_lanes.cuh combine_tail)
    against the two-launch path (moe_down, then combine_topk) and the float64 maths; a -1 pair (another
    EP rank's expert) adds nothing; three launches in a row and a CUDA-graph replay, so the arrival
    counts must return to zero; H = 640: a last column group of fewer warps."""
    from kq.kernels.triton_ops import combine_topk, route
    gen = torch.Generator(device=DEV).manual_seed(group + sum(map(int, variant)))
    E, H, I, k = 32, 640, 384, 8
    p2, s2, w2 = _weights(E, H, I, group, gen)
    p13, s13, _ = _weights(E, 2 * I, H, group, gen)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    ids = torch.randperm(E, generator=gen, device=DEV)[:k].to(torch.int32)[None].contiguous()
    ids[0, 3] = -1
    tw = torch.rand(1, k, generator=gen, device=DEV)
    rt = route(ids, E, 8)
    assert rt[1].data_ptr() == ids.data_ptr()
    a = (torch.randn(k, I, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    two = combine_topk(lanes.moe_down(a, lm, rt, variant), ids, tw, None, 2.5)
    loc = ids[0].long().clamp(min=0)
    y = torch.einsum("pi,phi->ph", a.double(), w2[loc]).to(torch.bfloat16).double()
    want = 2.5 * ((tw[0].double() * (ids[0] >= 0))[:, None] * y).sum(0, keepdim=True)
    for _ in range(3):
        got = lanes.moe_down_combined(a, lm, rt, ids, tw, 2.5, variant)
        assert got is not None and got.shape == (1, H)
        assert torch.allclose(got.float(), two.float(), rtol=2 ** -7, atol=0)
        assert _rel(got, want) < 1e-2
    # captured as SGLang does: a run on the capture stream first (which makes that stream's count buffer)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        assert lanes.moe_down_combined(a, lm, rt, ids, tw, 2.5, variant) is not None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=st):
        out = lanes.moe_down_combined(a, lm, rt, ids, tw, 2.5, variant)
    assert out is not None
    ids[0, 3] = next(e for e in range(E) if e not in ids[0].tolist())
    ids[0, 5] = -1
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    again = combine_topk(lanes.moe_down(a, lm, rt, variant), ids, tw, None, 2.5)
    assert torch.allclose(out.float(), again.float(), rtol=2 ** -7, atol=0)
