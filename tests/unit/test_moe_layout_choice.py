"""Which weight layout a loader prepacks a MoE layer in (kq.kernels.moe_lane_layout), and that a
lane-layout layer runs where the CUDA lane kernel does not (here: the CPU reference)."""
import pytest
import torch

from kq.kernels import fused_moe_w4a16, lanes_available, moe_lane_layout, prepack_moe
from kq.kernels.layout import pack_checkpoint_nibbles

CPU = torch.device("cpu")


def test_auto_keeps_the_tiles_layout_where_the_cuda_kernel_cannot_run(monkeypatch):
    monkeypatch.delenv("KQ_MOE_LAYOUT", raising=False)
    assert not lanes_available(CPU)
    assert moe_lane_layout(CPU, 6144, 256) is False


def test_forced_choices(monkeypatch):
    monkeypatch.setenv("KQ_MOE_LAYOUT", "lane")
    assert moe_lane_layout(CPU, 6144, 256) is True
    with pytest.raises(ValueError, match=r"KQ_MOE_LAYOUT=lane: hidden 6144 and intermediate 200 per rank must be "
                                         r"multiples of 16"):
        moe_lane_layout(CPU, 6144, 200)
    monkeypatch.setenv("KQ_MOE_LAYOUT", "tiles")
    assert moe_lane_layout(CPU, 6144, 256) is False
    monkeypatch.setenv("KQ_MOE_LAYOUT", "Lane")
    with pytest.raises(ValueError, match=r"KQ_MOE_LAYOUT='Lane': expected one of auto, lane, tiles"):
        moe_lane_layout(CPU, 6144, 256)


def test_a_lane_layout_layer_gives_the_tiles_layout_result_on_the_cpu():
    gen = torch.Generator().manual_seed(3)
    E, H, I, T, k, group = 4, 256, 128, 3, 2, 64
    p13 = pack_checkpoint_nibbles(torch.randint(0, 16, (E, 2 * I, H), generator=gen))
    p2 = pack_checkpoint_nibbles(torch.randint(0, 16, (E, H, I), generator=gen))
    s13 = (torch.rand(E, 2 * I, H // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 3], [2, 0]], dtype=torch.int32)
    tw = torch.rand(T, k, generator=gen)
    lane = fused_moe_w4a16(x, prepack_moe(p13, s13, p2, s2, group, lane=True), tw, ids)
    tiles = fused_moe_w4a16(x, prepack_moe(p13, s13, p2, s2, group), tw, ids)
    assert torch.equal(lane, tiles)

