"""Lane layout: the weight layout of the CUDA lane-layout kernel (kq/kernels/cuda/, cuda_lanes.py),
which Triton's MoE kernel also reads (LANE in gemm_kernel.py), so a layer holds one layout.

Why another layout. Each lane of a warp copies the 16 bytes it needs of a 128-input block with one
16-byte copy (cp.async into its own slot of a per-warp shared-memory ring, read back by the same
lane only: no barrier) and its dequantising lop3s build the tensor core's A fragment in place.
The Triton kernel on the tiles layout is bound by executing its dequantisation and its CTA-wide
barriers; this layout lets the CUDA kernel do without both.

Per matrix W [N, K] (stored nibble c = q + 8, K padded to a multiple of 128 with nibble 8):
    words  [N/8, KB, 8, 4, 4] int32   (n-tile of 8 columns, 128-input block, column c in the tile,
                                       lane chunk t, word wd): lane 4c + t of a warp reads the 16
                                       bytes [c, t, :] of one (n-tile, block): 512 contiguous bytes
                                       per warp, and the next block follows.
    scales [N/8, 8, G] bf16           (n-tile, column, group): a column's groups of one block are one
                                       2-, 4- or 8-byte load (group 128, 64, 32)
Inside the 4 words of (column n, block kb, chunk t), nibble J = j + 4i (bits 4J..4J+3) of word wd is
input  k = 128 kb + 16 step + 4 t + 2 h + i,   step = (4 wd + j) // 2,  h = (4 wd + j) % 2.
Why that order: mma.m16n8k16 gives lane t (= lane % 4) the B-fragment rows 2t, 2t+1 (register b0b1)
and 2t+8, 2t+9 (b2b3) of each 16-input step. Mapping the step's logical row 2t + 8h + i to the
physical input 16 step + 4t + 2h + i (a permutation inside the step, applied to A and B alike, so
the product is unchanged) makes (1) each step's 16 inputs one aligned run, so a group of 32, 64 or 128
inputs is whole steps and the group scale can be applied after the dot; (2) a lane's activations for
a step 4 consecutive bf16 (one 8-byte load gives a0a1 and a4a5); (3) one shift by 4j and one
lop3 0x000F000F | 0x43004300 of a word leave the pair (i = 0, 1) as a bf16x2 register of 128 + c.
"""
from __future__ import annotations

import torch

from kq.format import check_group as _check_group
from kq.format import unpack_nibbles as unpack_checkpoint_nibbles

from .blocks import PACK_K

TILE = 8           # columns per n-tile (the n of mma.m16n8k16)
STEPS = PACK_K // 16


def lane_input(kb: int, t: int, wd: int, j: int, i: int) -> int:
    """The input index that nibble j + 4i of word wd of lane chunk t holds in block kb."""
    p = 4 * wd + j
    return PACK_K * kb + 16 * (p // 2) + 4 * t + 2 * (p % 2) + i


def _index(device=None) -> torch.Tensor:
    """[4 t, 4 wd, 8 J] -> input offset inside a block (J = j + 4i)."""
    idx = torch.empty(4, 4, 8, dtype=torch.long)
    for t in range(4):
        for wd in range(4):
            for j in range(4):
                for i in range(2):
                    idx[t, wd, j + 4 * i] = lane_input(0, t, wd, j, i)
    return idx.to(device) if device is not None else idx


def lane_pack(packed: torch.Tensor, scale: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout (weight_packed [E, N, K/8] int32, weight_scale [E, N, K/g]) -> lane layout
    (words [E, N/8, KB, 8, 4, 4] int32, scales [E, N/8, 8, Kp/g] bf16; padded groups scale 0)."""
    E, N, K8 = packed.shape
    K = K8 * 8
    if N % TILE:
        raise ValueError(f"lane_pack: {N} outputs is not a multiple of {TILE}")
    _check_group(group, K, "lane_pack")
    KB = -(-K // PACK_K)
    Kp = KB * PACK_K
    dev = packed.device
    idx = _index(dev).view(-1)                                       # [128]
    words = torch.empty(E, N // TILE, KB, TILE, 4, 4, dtype=torch.int32, device=dev)
    for e in range(E):
        codes = unpack_checkpoint_nibbles(packed[e])                 # [N, K] uint8
        if Kp != K:
            codes = torch.nn.functional.pad(codes, (0, Kp - K), value=8)
        blocks = codes.view(N, KB, PACK_K)[:, :, idx].view(N, KB, 4, 4, 8).to(torch.int32)   # [n, kb, t, wd, J]
        w = torch.zeros(N, KB, 4, 4, dtype=torch.int32, device=dev)
        for J in range(8):
            w |= blocks[..., J] << (4 * J)
        words[e] = w.view(N // TILE, TILE, KB, 4, 4).permute(0, 2, 1, 3, 4)
    s = torch.zeros(E, N // TILE, TILE, Kp // group, dtype=torch.bfloat16, device=dev)
    s[..., : K // group] = scale.to(torch.bfloat16).view(E, N // TILE, TILE, K // group)
    return words.contiguous(), s.contiguous()


def lane_unpack(words: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of lane_pack's word packing: words [E, N/8, KB, 8, 4, 4] int32 -> stored nibbles
    [E, N, k] uint8 (q + 8) in natural input order, the K padding dropped."""
    E, NT, KB = words.shape[:3]
    w = words.permute(0, 1, 3, 2, 4, 5).reshape(E, NT * TILE, KB, 4, 4)         # [e, n, kb, t, wd]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nib = (w.unsqueeze(-1) >> shifts) & 0xF                                      # [e, n, kb, t, wd, J]
    # (t, wd, J) flattened is _index's order; scatter each nibble to the input it holds
    codes = torch.empty(E, NT * TILE, KB, PACK_K, dtype=torch.uint8, device=words.device)
    codes[..., _index(words.device).view(-1)] = nib.reshape(E, NT * TILE, KB, PACK_K).to(torch.uint8)
    return codes.view(E, NT * TILE, KB * PACK_K)[..., :k]


def dequantize_lane(words: torch.Tensor, scales: torch.Tensor, k: int, group: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Lane layout (words, scales [E, N/8, 8, Gp]) -> dense weights [E, N, k] in `dtype`."""
    codes = lane_unpack(words, k).to(dtype) - 8
    E, N = codes.shape[:2]
    scale = scales.reshape(E, N, -1)[..., : k // group].to(dtype)                # padded groups dropped
    return codes * scale.repeat_interleave(group, dim=-1)
