"""Run a real quantize and SIGKILL this very process at a chosen point (for the resume
tests): `python _killed_run.py SRC OUT GROUP POINT` with POINT one of
  shard:N    right after output shard N (1-based) is recorded
  expert:N   in the middle of a shard, after N expert weights were quantized
  finish     after every shard, while the index/config/manifest are being written
"""
import os
import signal
import sys
from pathlib import Path

from kq.checkpoint.source import open_source
from kq.quantize.experts import rtn_parts
from kq.quantize.plan import make_plan
from kq.quantize.run import Options, run_quantize

src, out, group, point = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
source = open_source(src)
plan = make_plan(source, group_size=group)
kind, _, n = point.partition(":")
count = {"shards": 0, "experts": 0}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def after_shard(name):
    count["shards"] += 1
    if kind == "shard" and count["shards"] == int(n):
        die()


def codes(name, w, scale):
    count["experts"] += 1
    if kind == "expert" and count["experts"] == int(n):
        die()
    return rtn_parts(name, w, scale, group=group, clip="mse", device=__import__("torch").device("cpu"))


if kind == "finish":
    real = source.copy_extras
    source.copy_extras = lambda dest: (real(dest), die())
run_quantize(source, plan, out, Options(group_size=group), expert_codes=codes, after_shard=after_shard)
print("finished without being killed")
