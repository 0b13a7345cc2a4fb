"""Weight layouts: the compressed-tensors checkpoint layout and kq's prepacked kernel layout.

Checkpoint (compressed-tensors `pack-quantized`, symmetric int4):
    weight_packed [N, K/8] int32   input column 8w+k in bits [4k, 4k+4) of word w, stored nibble = q + 8
    weight_scale  [N, K/g] bf16    W[n, k] = (nibble - 8) * scale[n, k // g]

Prepacked (what the Triton kernels stream), per matrix of N outputs and K inputs:
    q [Kp/8, N] int32   Kp = K rounded up to PACK_K (128); N is the contiguous axis, so a tile of
                        BLOCK_N columns is one run of 4*BLOCK_N bytes per row (16-byte loads).
                        Inside each 128-row block b of K, word w (0..15) holds in nibble J (bits
                        [4J, 4J+4)) input k = 128*b + 32*(J % 4) + 2*w + J // 4.  So one shift by 4j
                        and one mask 0x000F000F of a word leave inputs 128b+32j+2w and +1 in the
                        two 16-bit halves: a packed bf16 pair, exactly the register a tensor-core
                        B fragment wants (two consecutive k of one column), and the 16 words of a
                        block give 32 consecutive inputs per j.
    s [Kp/g, N] bf16    the scales transposed (N contiguous); padded groups have scale 0.
Padded inputs (K < k < Kp) hold nibble 8 (q = 0), so they add nothing.

Everything here is plain torch and runs on any device; prepacking is done once at load time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kq.format import GROUP_SIZES  # noqa: F401  (kq.kernels.layout's API)
from kq.format import NIBBLE_SHIFTS as _SHIFTS
from kq.format import check_group as _check_group
from kq.format import pack_nibbles as pack_checkpoint_nibbles  # noqa: F401
from kq.format import unpack_nibbles as unpack_checkpoint_nibbles

from .blocks import PACK_K, padded_k
from .lane_layout import lane_pack

_WORDS = PACK_K // 8    # words per column in one 128-input block


def prepack_matrix(packed: torch.Tensor, scale: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout -> prepacked layout for a stack of matrices.

    packed [E, N, K/8] int32, scale [E, N, K/g] -> (q [E, Kp/8, N] int32, s [E, Kp/g, N] bf16).
    Works expert by expert so peak extra memory is one expert's unpacked codes.
    """
    E, N, K8 = packed.shape
    K = K8 * 8
    _check_group(group, K, "prepack")
    if scale.shape != (E, N, K // group):
        raise ValueError(f"prepack: scale shape {tuple(scale.shape)} != {(E, N, K // group)} "
                         f"for weight_packed {tuple(packed.shape)} and group {group}")
    Kp = padded_k(K)
    q = torch.empty(E, Kp // 8, N, dtype=torch.int32, device=packed.device)
    s = torch.zeros(E, Kp // group, N, dtype=torch.bfloat16, device=packed.device)
    s[:, : K // group] = scale.transpose(1, 2).to(torch.bfloat16)
    for e in range(E):
        codes = unpack_checkpoint_nibbles(packed[e])                      # [N, K]
        if Kp != K:
            codes = torch.nn.functional.pad(codes, (0, Kp - K), value=8)  # q = 0 in the padding
        # k = 128 b + 32 jj + 2 w + i  holds nibble J = jj + 4 i of word w:  [N, b, jj, w, i] -> [b, w, J, N]
        c = codes.view(N, Kp // PACK_K, 4, _WORDS, 2).permute(1, 3, 4, 2, 0).reshape(Kp // PACK_K, _WORDS, 8, N)
        c = c.to(torch.int32)
        word = torch.zeros(Kp // PACK_K, _WORDS, N, dtype=torch.int32, device=packed.device)
        for j in range(8):
            word |= c[:, :, j, :] << (4 * j)
        q[e] = word.reshape(Kp // 8, N)
    return q, s


def prepacked_nibbles(q: torch.Tensor, k: int) -> torch.Tensor:
    """Prepacked q [E, Kp/8, N] -> stored nibbles [E, N, K] uint8 in natural column order."""
    E, Kp8, N = q.shape
    Kp = Kp8 * 8
    w = q.view(E, Kp // PACK_K, _WORDS, N)                                 # [E, b, w, N]
    nib = (w.unsqueeze(3) >> _SHIFTS.to(q.device).view(1, 1, 1, 8, 1)) & 0xF   # [E, b, w, J, N]
    nib = nib.view(E, Kp // PACK_K, _WORDS, 2, 4, N)                       # J = jj + 4 i
    codes = nib.permute(0, 5, 1, 4, 2, 3).reshape(E, N, Kp)                # k = 128b + 32jj + 2w + i
    return codes[:, :, :k].to(torch.uint8)


def dequantize_prepacked(q: torch.Tensor, s: torch.Tensor, k: int, group: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prepacked (q, s) -> dense weights [E, N, K] in `dtype`."""
    codes = prepacked_nibbles(q, k).to(dtype) - 8
    scale = s[:, : k // group].transpose(1, 2).to(dtype)                    # [E, N, K/g]
    return codes * scale.repeat_interleave(group, dim=-1)


@dataclass(frozen=True)
class PrepackedLinear:
    """One W4A16 linear in kernel layout. q [Kp/8, N] int32, s [Kp/g, N] bf16; y = x @ W^T.

    lane: when True, q [N/8, Kp/128, 8, 4, 4] and s [N/8, 8, Kp/g] are the lane layout
    (lane_layout.lane_pack of one matrix), read by the CUDA kernel for few rows on Hopper and by the
    Triton kernels otherwise."""
    q: torch.Tensor
    s: torch.Tensor
    out_features: int
    in_features: int
    group: int
    lane: bool = False


@dataclass(frozen=True)
class PrepackedMoE:
    """A layer's routed experts in kernel layout.

    w13: gate and up stacked along the output dim ([gate; up], SGLang's w13), q [E, Hp/8, 2I], s [E, Hp/g, 2I]
    w2:  down, q [E, Ip/8, H], s [E, Ip/g, H]

    lane: when True, w13_q/w13_s/w2_q/w2_s are instead lane-layout tensors from lane_layout.lane_pack
    (the CUDA lane kernel's layout, which the Triton kernels also read): w13 = [gate; up] rows as in
    the checkpoint, q [E, 2I/8, Hp/128, 8, 4, 4], s [E, 2I/8, 8, Hp/g], so gate's columns are n-tiles
    0 .. I/8-1 and up's n-tiles I/8 .. 2I/8-1; w2 q [E, H/8, Ip/128, 8, 4, 4], s [E, H/8, 8, Ip/g].
    """
    w13_q: torch.Tensor
    w13_s: torch.Tensor
    w2_q: torch.Tensor
    w2_s: torch.Tensor
    num_experts: int
    hidden: int
    intermediate: int
    group: int
    lane: bool = False


def lane_fits(*sizes: int) -> bool:
    """The lane layout's shapes: the CUDA lane kernel works on pairs of 8-column n-tiles of every
    matrix, so its output sizes (a MoE's hidden and intermediate size, a linear's N) must be
    multiples of 16."""
    return all(n % 16 == 0 for n in sizes)


def prepack_linear(weight_packed: torch.Tensor, weight_scale: torch.Tensor, group: int,
                   lane: bool = False) -> PrepackedLinear:
    """weight_packed [N, K/8] int32, weight_scale [N, K/g] -> PrepackedLinear (lane=True: the lane
    layout, N a multiple of 16: what the CUDA kernel reads at M = 1..64 on Hopper)."""
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise ValueError(f"prepack_linear: weight_packed must be 2-D int32, got {weight_packed.dim()}-D "
                         f"{weight_packed.dtype}")
    N, K8 = weight_packed.shape
    if lane:
        if not lane_fits(N):
            raise ValueError(f"prepack_linear(lane=True): {N} outputs is not a multiple of 16")
        q, s = lane_pack(weight_packed.unsqueeze(0), weight_scale.unsqueeze(0), group)
        return PrepackedLinear(q=q[0], s=s[0], out_features=N, in_features=K8 * 8, group=group, lane=True)
    q, s = prepack_matrix(weight_packed.unsqueeze(0), weight_scale.unsqueeze(0), group)
    return PrepackedLinear(q=q[0], s=s[0], out_features=N, in_features=K8 * 8, group=group)


def prepack_moe(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                w2_scale: torch.Tensor, group: int, lane: bool = False) -> PrepackedMoE:
    """w13_packed [E, 2I, H/8], w13_scale [E, 2I, H/g], w2_packed [E, H, I/8], w2_scale [E, H, I/g].

    lane=False: the tiles layout above; lane=True: the lane layout (see PrepackedMoE)."""
    for name, t in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
        if t.dtype != torch.int32 or t.dim() != 3:
            raise ValueError(f"prepack_moe: {name} must be 3-D int32, got {t.dim()}-D {t.dtype}")
    E, two_i, h8 = w13_packed.shape
    H = h8 * 8
    if two_i % 2:
        raise ValueError(f"prepack_moe: w13 has {two_i} output rows; expected [gate; up] (an even number)")
    I = two_i // 2
    if tuple(w2_packed.shape) != (E, H, I // 8):
        raise ValueError(f"prepack_moe: w2_packed shape {tuple(w2_packed.shape)} != {(E, H, I // 8)} "
                         f"implied by w13_packed {tuple(w13_packed.shape)}")
    if lane:
        w13_q, w13_s, w2_q, w2_s = _lane_moe_tensors(w13_packed, w13_scale, w2_packed, w2_scale, group, H, I)
    else:
        w13_q, w13_s = prepack_matrix(w13_packed, w13_scale, group)
        w2_q, w2_s = prepack_matrix(w2_packed, w2_scale, group)
    return PrepackedMoE(w13_q, w13_s, w2_q, w2_s, num_experts=E, hidden=H, intermediate=I, group=group,
                        lane=lane)


def _lane_moe_tensors(w13_packed, w13_scale, w2_packed, w2_scale, group: int, H: int, I: int):
    """prepack_moe's lane-layout branch: the checks lane_pack leaves out, then lane_pack per matrix."""
    if not lane_fits(H, I):
        raise ValueError(f"prepack_moe(lane=True): intermediate size {I} and hidden size {H} must both be "
                         f"multiples of 16 for the lane layout")
    for name, packed, scale in (("w13", w13_packed, w13_scale), ("w2", w2_packed, w2_scale)):
        E, N, K8 = packed.shape
        _check_group(group, K8 * 8, "prepack_moe")
        if scale.shape != (E, N, K8 * 8 // group):
            raise ValueError(f"prepack_moe: {name} scale shape {tuple(scale.shape)} != "
                             f"{(E, N, K8 * 8 // group)} for group {group}")
    return (*lane_pack(w13_packed, w13_scale, group), *lane_pack(w2_packed, w2_scale, group))

