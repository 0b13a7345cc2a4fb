"""INT4 packing against compressed-tensors' own packer and an independent bit-level unpack."""
import numpy as np
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from kq.checkpoint.pack import dequantize_int4, pack_int4, unpack_int4


def test_pack_matches_compressed_tensors_bytes():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (37, 256), generator=g, dtype=torch.int8)
    ours = pack_int4(q)
    theirs = pack_to_int32(q, 4)
    assert ours.dtype == torch.int32 and ours.shape == (37, 32)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size([37, 256])), q)


def test_every_code_in_every_nibble_position():
    # 16 codes x 8 positions: each word holds one code repeated, checked bit by bit with numpy.
    q = torch.arange(-8, 8, dtype=torch.int8).repeat_interleave(8).reshape(16, 8)
    words = pack_int4(q).numpy().view(np.uint32)[:, 0]
    for row, code in enumerate(range(-8, 8)):
        for k in range(8):
            assert (int(words[row]) >> (4 * k)) & 0xF == code + 8
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_column_order_least_significant_first():
    q = torch.full((1, 8), -8, dtype=torch.int8)
    q[0, 3] = 7  # column 3 -> bits [12, 16) of word 0
    w = int(pack_int4(q).numpy().view(np.uint32)[0, 0])
    assert w == 0xF << 12


def test_dequantize_group_scales():
    q = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8] * 2], dtype=torch.int8)
    s = torch.tensor([[0.5, 2.0]], dtype=torch.bfloat16)
    w = dequantize_int4(pack_int4(q), s, (1, 16))
    expect = q.float() * torch.tensor([0.5] * 8 + [2.0] * 8)
    assert torch.equal(w, expect)
