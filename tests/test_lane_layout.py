"""The CUDA lane kernel's layout (kq/kernels/lane_layout.py), on the CPU: the
kernel's step-by-step reading, emulated, equals a float64 matmul of the checkpoint's weights."""
import pytest
import torch

from kq.kernels.lane_layout import dequantize_lane, emulate_mma_gemm, lane_input, lane_pack, lane_unpack
from kq.kernels.layout import pack_checkpoint_nibbles


def test_every_input_of_a_block_sits_in_exactly_one_place():
    seen = sorted(lane_input(0, t, wd, j, i) for t in range(4) for wd in range(4) for j in range(4) for i in range(2))
    assert seen == list(range(128))
    # a 16-input step is one aligned run, so groups of 32/64/128 are whole steps
    for wd in range(4):
        for j in range(4):
            step = (4 * wd + j) // 2
            assert all(16 * step <= lane_input(0, t, wd, j, i) < 16 * step + 16 for t in range(4) for i in range(2))


@pytest.mark.parametrize("group,k", [(32, 256), (64, 192), (128, 384)])
def test_emulated_kernel_equals_a_float64_matmul(group, k):
    gen = torch.Generator().manual_seed(group + k)
    E, N, M = 2, 24, 5
    nib = torch.randint(0, 16, (E, N, k), generator=gen)
    scale = (torch.rand(E, N, k // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    words, s = lane_pack(pack_checkpoint_nibbles(nib), scale, group)
    assert words.shape == (E, N // 8, -(-k // 128), 8, 4, 4) and s.shape == (E, N // 8, 8, -(-k // 128) * 128 // group)
    x = torch.randn(M, k, generator=gen)
    for e in range(E):
        w = (nib[e].double() - 8) * scale[e].double().repeat_interleave(group, dim=1)     # [N, K]
        want = x.double() @ w.t()
        got = emulate_mma_gemm(x, words[e], s[e], group)
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_lane_pack_refuses_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        lane_pack(torch.zeros(1, 12, 16, dtype=torch.int32), torch.ones(1, 12, 4), 32)


@pytest.mark.parametrize("group,k", [(32, 256), (32, 192), (64, 320), (64, 128), (128, 384), (128, 128)])
def test_lane_unpack_inverts_lane_pack(group, k):
    # K a multiple of 128 and not (192, 320: the padding must be dropped again)
    gen = torch.Generator().manual_seed(7 * group + k)
    E, N = 2, 16
    nib = torch.randint(0, 16, (E, N, k), generator=gen)
    scale = (torch.rand(E, N, k // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    words, s = lane_pack(pack_checkpoint_nibbles(nib), scale, group)
    assert torch.equal(lane_unpack(words, k), nib.to(torch.uint8))
    want = (nib.float() - 8) * scale.float().repeat_interleave(group, dim=-1)
    assert torch.equal(dequantize_lane(words, s, k, group), want)
