"""Prepack exactness and the torch reference, on the CPU, against independent float64 maths."""
import numpy as np
import pytest
import torch

from kq.kernels import PrepackedMoE, fused_moe_w4a16, prepack_linear, prepack_moe, reference, w4a16_linear
from kq.kernels.layout import (dequantize_prepacked, pack_checkpoint_nibbles, prepack_matrix, prepacked_nibbles,
                               unpack_checkpoint_nibbles)


def _pack_words_py(nibbles_row):
    """Independent packer: python ints, input column 8w+k in bits [4k, 4k+4) of word w."""
    words = []
    for w in range(len(nibbles_row) // 8):
        v = 0
        for k in range(8):
            v |= int(nibbles_row[8 * w + k]) << (4 * k)
        words.append(v - (1 << 32) if v >= 1 << 31 else v)
    return words


def _ckpt(e, n, k, group, gen):
    nib = torch.randint(0, 16, (e, n, k), generator=gen)
    packed = torch.tensor([[_pack_words_py(r) for r in m] for m in nib.tolist()], dtype=torch.int32)
    scale = (torch.rand(e, n, k // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    return nib, packed, scale


def _dequant64(nib, scale, group):
    """float64 W[e, n, k] = (nibble - 8) * scale[e, n, k // group], straight from the checkpoint."""
    s = scale.double().numpy()
    return torch.from_numpy((nib.double().numpy() - 8.0) * np.repeat(s, group, axis=-1))


def test_checkpoint_unpack_matches_python_packer_for_every_nibble_and_position():
    # every value 0..15 at every one of the 8 positions of a word
    nib = torch.tensor([[(v + p) % 16 for p in range(8)] for v in range(16)], dtype=torch.uint8)
    packed = torch.tensor([_pack_words_py(r) for r in nib.tolist()], dtype=torch.int32)
    assert torch.equal(pack_checkpoint_nibbles(nib), packed)
    assert torch.equal(unpack_checkpoint_nibbles(packed), nib)


@pytest.mark.parametrize("k", [128, 192, 256, 384])
def test_prepack_places_every_input_where_the_kernel_reads_it(k):
    # exhaustive over positions: input k of output n must sit in word 16*(k//128) + (k%32)//2,
    # nibble (k%128)//32 + 4*(k%2)
    gen = torch.Generator().manual_seed(k)
    nib, packed, scale = _ckpt(2, 24, k, 32, gen)
    q, s = prepack_matrix(packed, scale, 32)
    kp = -(-k // 128) * 128
    assert q.shape == (2, kp // 8, 24) and q.dtype == torch.int32
    qn = q.numpy().astype(np.int64) & 0xFFFFFFFF
    for kk in range(kp):
        word = 16 * (kk // 128) + (kk % 32) // 2
        shift = 4 * ((kk % 128) // 32 + 4 * (kk % 2))
        got = (qn[:, word, :] >> shift) & 0xF
        want = nib[:, :, kk].numpy() if kk < k else np.full((2, 24), 8)     # padding: q = 0
        assert np.array_equal(got, want), kk
    assert torch.equal(s[:, : k // 32], scale.transpose(1, 2))
    assert torch.all(s[:, k // 32:] == 0)
    assert torch.equal(prepacked_nibbles(q, k), nib.to(torch.uint8))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_prepacked_equals_float64_checkpoint_dequant(group):
    gen = torch.Generator().manual_seed(group)
    nib, packed, scale = _ckpt(3, 40, 256, group, gen)
    q, s = prepack_matrix(packed, scale, group)
    got = dequantize_prepacked(q, s, 256, group, dtype=torch.float64)
    assert torch.equal(got, _dequant64(nib, scale, group))


def test_prepack_refuses_bad_group_and_shapes_with_one_clear_message():
    gen = torch.Generator().manual_seed(0)
    _, packed, scale = _ckpt(1, 8, 192, 64, gen)
    with pytest.raises(ValueError, match="group size 16 is not one of"):
        prepack_matrix(packed, scale, 16)
    with pytest.raises(ValueError, match="input size 192 is not a multiple of the group size 128"):
        prepack_matrix(packed, scale, 128)
    with pytest.raises(ValueError, match="scale shape"):
        prepack_matrix(packed, scale[:, :, :2], 64)
    with pytest.raises(ValueError, match="even number"):
        prepack_moe(packed[:, :7], scale[:, :7], packed, scale, 64)
    with pytest.raises(ValueError, match="must be 3-D int32"):
        prepack_moe(packed.float(), scale, packed, scale, 64)


@pytest.mark.parametrize("lane", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_reference_linear_matches_float64(group, lane):
    gen = torch.Generator().manual_seed(1)
    k = 320 if group < 128 else 384                          # 320: both layouts pad K to 384
    nib, packed, scale = _ckpt(1, 48, k, group, gen)
    lin = prepack_linear(packed[0], scale[0], group, lane=lane)
    assert lin.lane == lane
    if lane:
        assert lin.q.shape == (6, 3, 8, 4, 4) and lin.s.shape == (6, 8, 384 // group)
    x = torch.randn(2, 3, k, generator=gen).to(torch.bfloat16)
    want = x.double() @ _dequant64(nib, scale, group)[0].t()
    got = w4a16_linear(x, lin)                      # CPU -> the reference
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()).item() < 4e-3
    with pytest.raises(ValueError, match=f"x has 128 input features, the weight {k}"):
        w4a16_linear(x[..., :128], lin)


def test_lane_linear_needs_a_multiple_of_16_outputs():
    gen = torch.Generator().manual_seed(2)
    _, packed, scale = _ckpt(1, 40, 128, 128, gen)
    assert prepack_linear(packed[0], scale[0], 128).out_features == 40     # the tiles layout takes it
    with pytest.raises(ValueError, match=r"prepack_linear\(lane=True\): 40 outputs is not a multiple of 16"):
        prepack_linear(packed[0], scale[0], 128, lane=True)


def _moe64(x, nib13, s13, nib2, s2, group, tw, ids, emap, rsf):
    """Independent float64 MoE: token by token, pair by pair."""
    w13 = _dequant64(nib13, s13, group)
    w2 = _dequant64(nib2, s2, group)
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) if emap is None else int(emap[int(ids[t, j])])
            if e < 0:
                continue
            gu = w13[e] @ x[t].double()
            act = torch.nn.functional.silu(gu[:i]) * gu[i:]
            out[t] += float(tw[t, j]) * (w2[e] @ act)
    return out * rsf


@pytest.mark.parametrize("group,use_map", [(32, False), (64, True), (128, False)])
def test_reference_fused_moe_matches_float64(group, use_map):
    gen = torch.Generator().manual_seed(group)
    E, H, I, T, k = 6, 256, 128, 5, 2
    nib13, p13, s13 = _ckpt(E, 2 * I, H, group, gen)
    nib2, p2, s2 = _ckpt(E, H, I, group, gen)
    pp = prepack_moe(p13, s13, p2, s2, group)
    assert isinstance(pp, PrepackedMoE) and (pp.num_experts, pp.hidden, pp.intermediate) == (E, H, I)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [5, 3], [0, 1]], dtype=torch.int32)   # experts 2, 4: no tokens
    tw = torch.rand(T, k, generator=gen)
    emap = torch.tensor([1, -1, 2, 0, 4, 5], dtype=torch.int32) if use_map else None  # global 1 on another rank
    want = _moe64(x, nib13, s13, nib2, s2, group, tw, ids, emap, 1.5)
    got = fused_moe_w4a16(x, pp, tw, ids, expert_map=emap, routed_scaling_factor=1.5)
    assert got.shape == (T, H) and got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()).item() < 4e-3
    if use_map:   # token 1's pair to global expert 1 lives elsewhere: only its other pair counts
        assert not torch.allclose(got.double(), _moe64(x, nib13, s13, nib2, s2, group, tw, ids, None, 1.5),
                                  rtol=1e-2, atol=1e-3)
    # the lane layout of the same checkpoint dequantizes to the same float32 weights
    lane = prepack_moe(p13, s13, p2, s2, group, lane=True)
    assert lane.lane and not pp.lane
    assert torch.equal(fused_moe_w4a16(x, lane, tw, ids, expert_map=emap, routed_scaling_factor=1.5), got)


@pytest.mark.parametrize("hidden,inter", [(128, 40), (40, 128)])
def test_prepack_moe_lane_refuses_sizes_off_16(hidden, inter):
    p13 = torch.zeros(1, 2 * inter, hidden // 8, dtype=torch.int32)
    p2 = torch.zeros(1, hidden, inter // 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"intermediate size {inter} and hidden size {hidden} must both be "
                                         "multiples of 16"):
        prepack_moe(p13, torch.ones(1, 2 * inter, 1), p2, torch.ones(1, hidden, 1), 32, lane=True)
    with pytest.raises(ValueError, match="w2 scale shape"):
        prepack_moe(torch.zeros(1, 64, 16, dtype=torch.int32), torch.ones(1, 64, 4),
                    torch.zeros(1, 128, 4, dtype=torch.int32), torch.ones(1, 128, 2), 32, lane=True)


def test_fused_moe_refuses_mismatched_shapes():
    gen = torch.Generator().manual_seed(0)
    _, p13, s13 = _ckpt(2, 128, 128, 32, gen)
    _, p2, s2 = _ckpt(2, 128, 64, 32, gen)
    pp = prepack_moe(p13, s13, p2, s2, 32)
    x = torch.randn(3, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \[T, 128\]"):
        fused_moe_w4a16(x[:, :64], pp, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="must both be"):
        fused_moe_w4a16(x, pp, torch.rand(3, 2), torch.zeros(3, 1, dtype=torch.int32))
    assert torch.equal(reference.local_expert_ids(torch.tensor([[1, 0]]), torch.tensor([-1, 7])),
                       torch.tensor([[7, -1]]))
    # SGLang's EP dispatcher writes -1 for experts on other ranks: never an index into the map
    assert torch.equal(reference.local_expert_ids(torch.tensor([[-1, 1]]), torch.tensor([5, 6])),
                       torch.tensor([[-1, 6]]))
    assert torch.equal(reference.local_expert_ids(torch.tensor([[-1, 1]]), None), torch.tensor([[-1, 1]]))
