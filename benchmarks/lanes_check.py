"""Diagnose the experimental CUDA decode MoE (kq/kernels/cuda_lanes.py) on a GPU, stage by stage.

Prints, for the ungated (down) and gated (gate+up) stages on small shapes, the relative error against
a float64 dequantize-then-matmul; for the ungated stage with one-hot activations it also maps which
weight input each kernel input actually met (a layout or fragment mix-up shows as a permutation).
Usage on the GPU machine: python3 benchmarks/lanes_check.py
"""
from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, ".")
from kq.kernels import cuda_lanes  # noqa: E402
from kq.kernels.lane_layout import lane_pack  # noqa: E402
from kq.kernels import prepack_moe  # noqa: E402
from kq.kernels.layout import PrepackedMoE, pack_checkpoint_nibbles  # noqa: E402
from kq.kernels.triton_ops import moe_align  # noqa: E402

DEV = "cuda"


def weights(e, n, k, group, gen):
    nib = torch.randint(0, 16, (e, n, k), generator=gen, device=DEV)
    s = (torch.rand(e, n, k // group, generator=gen, device=DEV) * 0.05 + 1e-3).to(torch.bfloat16)
    w = (nib.double() - 8) * s.double().repeat_interleave(group, dim=2)
    return pack_checkpoint_nibbles(nib), s, w


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def down_stage(e, h, i, t, k, group, gen):
    """act [P, I] -> y [P, H] = act[p] @ W2[expert(p)]^T, the kernel against float64."""
    p2, s2, w2 = weights(e, h, i, group, gen)
    p13, s13, _ = weights(e, 2 * i, h, group, gen)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    ids = torch.stack([torch.randperm(e, generator=gen, device=DEV)[:k] for _ in range(t)]).to(torch.int32)
    act = torch.randn(t * k, i, generator=gen, device=DEV).to(torch.bfloat16)
    rt = moe_align(ids, e, 8)
    y = cuda_lanes.moe_down(act, lm, rt)
    want = torch.stack([act[p].double() @ w2[ids.view(-1)[p]].t() for p in range(t * k)])
    return rel(y, want)


def gate_up_stage(e, h, i, t, k, group, gen):
    p13, s13, w13 = weights(e, 2 * i, h, group, gen)
    p2, s2, _ = weights(e, h, i, group, gen)
    lm = prepack_moe(p13, s13, p2, s2, group, lane=True)
    ids = torch.stack([torch.randperm(e, generator=gen, device=DEV)[:k] for _ in range(t)]).to(torch.int32)
    x = torch.randn(t, h, generator=gen, device=DEV).to(torch.bfloat16)
    act = cuda_lanes.moe_gate_up(x, lm, moe_align(ids, e, 8), k)
    rows = []
    for p in range(t * k):
        z = x[p // k].double() @ w13[ids.view(-1)[p]].t()
        g, u = z[:i], z[i:]
        rows.append(g / (1 + torch.exp(-g)) * u)
    return rel(act, torch.stack(rows))


def one_hot_map(n, kdim, group):
    """One expert, one row, x = e_k for every k: which weight input did the kernel multiply?"""
    gen = torch.Generator(device=DEV).manual_seed(7)
    nib = torch.randint(0, 16, (1, n, kdim), generator=gen, device=DEV)
    s = torch.ones(1, n, kdim // group, device=DEV, dtype=torch.bfloat16)
    p = pack_checkpoint_nibbles(nib)
    q, sc = lane_pack(p, s, group)
    lm = PrepackedMoE(q, sc, q, sc, num_experts=1, hidden=n, intermediate=kdim, group=group, lane=True)
    w = (nib[0].double() - 8)                                   # [n, kdim]
    rt = moe_align(torch.zeros(1, 1, dtype=torch.int32, device=DEV), 1, 8)
    bad = []
    for kk in range(kdim):
        x = torch.zeros(1, kdim, device=DEV, dtype=torch.bfloat16)
        x[0, kk] = 1
        y = cuda_lanes.moe_down(x, lm, rt)[0].double()
        if not torch.equal(y, w[:, kk]):
            hits = [j for j in range(kdim) if torch.equal(y, w[:, j])]
            bad.append((kk, hits[:3], (y - w[:, kk]).abs().max().item()))
    return bad


def main():
    t0 = time.time()
    cuda_lanes._ext()
    print(f"extension built/loaded in {time.time() - t0:.1f} s", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for args in [(1, 256, 128, 1, 1, 128), (4, 256, 128, 3, 2, 32), (8, 512, 256, 5, 8, 64),
                 (16, 512, 256, 20, 8, 128), (8, 768, 192, 3, 2, 64)]:
        for name, fn in (("down", down_stage), ("gate_up", gate_up_stage)):
            try:
                print(f"{name:8s} E,H,I,T,k,g={args}: rel {fn(*args, gen):.2e}", flush=True)
            except Exception as ex:   # report and go on: the next shape may say more
                print(f"{name:8s} E,H,I,T,k,g={args}: {ex!r}"[:300], flush=True)
    for n, kdim, g in [(16, 128, 128), (32, 256, 32)]:
        bad = one_hot_map(n, kdim, g)
        print(f"one-hot N={n} K={kdim} g={g}: {len(bad)} inputs wrong; first: {bad[:8]}", flush=True)


if __name__ == "__main__":
    main()
