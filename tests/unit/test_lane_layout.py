"""The CUDA lane kernel's layout (kq/kernels/lane_layout.py), on the CPU: the
kernel's step-by-step reading, emulated, equals a float64 matmul of the checkpoint's weights."""
import pytest
import torch

from kq.kernels.lane_layout import PACK_K, STEPS, TILE, dequantize_lane, lane_input, lane_pack, lane_unpack
from kq.kernels.layout import pack_checkpoint_nibbles



def emulate_mma_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """What the CUDA kernel computes for one matrix, step by step the way it reads: x [M <= 16, K]
    -> y [M, N] float64. Lane (g, t) of step s takes its B pairs from word s // 2 at shifts
    4 (2 (s % 2) + h), h = 0, 1, and its A pairs from x[16 s + 4 t + 2 h + i]; the tests check this
    bookkeeping (and where a group ends) against a plain matmul of the checkpoint's weights."""
    M, K = x.shape
    NT, KB = words.shape[0], words.shape[1]
    xp = torch.zeros(M, KB * PACK_K, dtype=torch.float64)
    xp[:, :K] = x.double()
    w = words.to(torch.int64) & 0xFFFFFFFF                       # [NT, KB, 8, 4, 4]
    y = torch.zeros(M, NT * TILE, dtype=torch.float64)
    for kb in range(KB):
        part = torch.zeros(M, NT, TILE, dtype=torch.float64)
        for s in range(STEPS):
            for t in range(4):
                for h in range(2):
                    word = w[:, kb, :, t, s // 2]                  # [NT, 8 columns]
                    for i in range(2):
                        c = (word >> (4 * (2 * (s % 2) + h) + 16 * i)) & 0xF
                        xk = xp[:, kb * PACK_K + 16 * s + 4 * t + 2 * h + i]      # [M]
                        part += xk[:, None, None] * (c.double() + 128.0)        # codes enter as q + 136
                        part -= xk[:, None, None] * 136.0                        # the offset dot
            if (16 * (s + 1)) % group == 0:
                gi = (kb * PACK_K + 16 * s) // group
                y += (part * scales[:, :, gi].double()).reshape(M, NT * TILE)
                part.zero_()
    return y


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
