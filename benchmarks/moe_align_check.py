"""moe_align at prefill sizes against its contract, and its two paths timed, on a GPU:

    python benchmarks/moe_align_check.py

Per size (16384 tokens x 256 experts, 4096 x 384, 1024 x 256, top-8, 64-row blocks): every routed pair in
exactly one used block, every 97th block's pairs all of its expert with 1 <= count <= block_m; the table of
the path a size takes (counted, sorted and scattered chunks from SORTED_ALIGN_MIN_PAIRS pairs) equal to the
one program an expert path's; both paths' µs (CUDA-graph replay, median of 20). One line per size.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_kernels as bk  # noqa: E402

from kq.kernels import triton_ops as ops  # noqa: E402

bk.STATE["idle_s"] = 0.2      # burst timing; a short idle is enough for a launch this size


def per_expert(ids, e, bm):
    saved, ops.SORTED_ALIGN_MIN_PAIRS = ops.SORTED_ALIGN_MIN_PAIRS, 1 << 62
    try:
        return ops.moe_align(ids, e, bm)
    finally:
        ops.SORTED_ALIGN_MIN_PAIRS = saved


g = torch.Generator(device="cuda").manual_seed(1)
for t, e, bm in ((16384, 256, 64), (4096, 384, 64), (1024, 256, 64)):
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:8] for _ in range(t)]).to(torch.int32)
    pairs, be, bs, bc = ops.moe_align(ids, e, bm)
    flat = ids.flatten().long()
    used = be >= 0
    ok = True
    rows = torch.cat([pairs[s:s + c] for s, c in zip(bs[used].tolist(), bc[used].tolist())])
    ok &= torch.equal(rows.sort().values.long(), torch.arange(flat.numel(), device="cuda"))
    for b in torch.nonzero(used).flatten().tolist()[::97]:
        s0, c = int(bs[b]), int(bc[b])
        ok &= bool((flat[pairs[s0:s0 + c].long()] == int(be[b])).all()) and 1 <= c <= bm
    w = per_expert(ids, e, bm)
    same = (torch.equal(pairs, w[0]) and torch.equal(be, w[1]) and torch.equal(bs[used], w[2][used])
            and torch.equal(bc[used], w[3][used]))
    path = "sorted" if flat.numel() >= ops.SORTED_ALIGN_MIN_PAIRS else "per-expert"
    print(f"moe_align {t} {e} {'ok' if ok else 'WRONG'} ({path}), same table as per-expert: {same}, "
          f"us: taken {bk.graph_us([lambda: ops.moe_align(ids, e, bm)], 20):.1f}, "
          f"per-expert {bk.graph_us([lambda: per_expert(ids, e, bm)], 20):.1f}", flush=True)
