"""moe_align at prefill sizes (its 2048-pair steps) against its contract, on a GPU:

    python benchmarks/moe_align_check.py

Every routed pair in exactly one used block, and every 97th block's pairs all of its expert with
1 <= count <= block_m; prints one line per size (16384 tokens x 256 experts, 4096 x 384, 1024 x 256).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kq.kernels import triton_ops as ops  # noqa: E402
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
    print("moe_align", t, e, "ok" if ok else "WRONG", flush=True)
