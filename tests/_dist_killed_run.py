"""Launched by torchrun: a real quantize in which one rank SIGKILLs itself at a chosen point (for the
resume-under-torchrun tests; torchrun then stops the other ranks, as it does when any rank dies):
  python -m torch.distributed.run --nproc-per-node N _dist_killed_run.py SRC OUT METHOD CALIB RANK POINT
METHOD rtn: POINT n = after this rank's n-th output shard is recorded; gptq, awq: after layer n is done.
The options are those of tests/test_distributed.py's METHODS (same work fingerprints as its CLI runs).
"""
import os
import signal
import sys
from pathlib import Path

import torch

from kq.checkpoint.source import open_source
from kq.quantize import distributed
from kq.quantize.plan import make_plan
from kq.quantize.run import Options, run_quantize

src, out, method, calib, kill_rank, point = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], \
    int(sys.argv[5]), int(sys.argv[6])
world, device = distributed.setup(torch.device("cpu"))
source = open_source(src)
plan = make_plan(source, group_size=32)
count = {"shards": 0}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def after_shard(name):
    count["shards"] += 1
    if method == "rtn" and world.rank == kill_rank and count["shards"] == point:
        die()


def on_layer(done, total, stats):
    if world.rank == kill_rank and done == point:
        die()


codes = None
if method in ("gptq", "awq"):
    from kq.quantize.awq import AwqConfig
    from kq.quantize.layerwise import GptqConfig, gptq_expert_codes
    cfg = GptqConfig(group=32, expert_chunk=1) if method == "gptq" else AwqConfig(group=32)
    codes = gptq_expert_codes(source, plan, out, calib=calib, samples=24, seqlen=32, device=device,
                              cfg=cfg, on_layer=on_layer)
run_quantize(source, plan, out, Options(method=method, group_size=32, calib=calib), device=device, expert_codes=codes,
             after_shard=after_shard)
print("finished without being killed")
