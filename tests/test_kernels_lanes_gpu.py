"""The experimental CUDA decode MoE (kq/kernels/cuda_lanes.py) against the torch reference on a GPU."""
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
def test_lanes_moe_matches_reference(E, H, I, T, k, group):
    gen = torch.Generator(device=DEV).manual_seed(E + H + T)
    nib13 = torch.randint(0, 16, (E, 2 * I, H), generator=gen, device=DEV)
    nib2 = torch.randint(0, 16, (E, H, I), generator=gen, device=DEV)
    s13 = (torch.rand(E, 2 * I, H // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    p13, p2 = pack_checkpoint_nibbles(nib13), pack_checkpoint_nibbles(nib2)
    lm = lanes.lane_moe(p13, s13, p2, s2, group)
    pp = prepack_moe(p13, s13, p2, s2, group)
    x = (torch.randn(T, H, generator=gen, device=DEV) + 1.0).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(max(k, E // 2), generator=gen, device=DEV)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen, device=DEV)
    got = lanes.fused_moe_lanes(x, lm, tw, ids, routed_scaling_factor=2.5)
    want = reference.fused_moe_w4a16(x, pp, tw, ids, routed_scaling_factor=2.5)
    assert _rel(got, want) < 1.5e-2
