"""kq quantize's options: one frozen, validated object (kq.quantize.run.Options) the CLI parses its flags into."""
from __future__ import annotations

import dataclasses

import pytest

from kq.errors import KqError
from kq.quantize.run import Options


def test_options_are_frozen_and_replace_validates_again():
    opts = Options(method="gptq", calib="c.txt", group_size=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.jobs = 2
    assert dataclasses.replace(opts, group_size=32).method_config().group == 32
    with pytest.raises(KqError, match="--group-size 48 is not supported"):
        dataclasses.replace(opts, group_size=48)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(method="gpt"), "--method gpt: use rtn, gptq, awq or awq+gptq"),
    (dict(clip="max"), "--clip max: use mse or absmax"),
    (dict(jobs=0), "--jobs 0: use 1 or more"),
    (dict(method="gptq"), "--method gptq needs --calib"),
    (dict(method="gptq", calib="c.txt", calib_policy="some"), "--calib-policy some: use one of all, routed, weighted"),
    (dict(method="gptq", calib="c.txt", gptq_damp=0.0), "GPTQ damp 0.0"),
    (dict(method="awq", calib="c.txt", gptq_expert_chunk=4), "--gptq-expert-chunk: GPTQ options"),
    (dict(method="gptq", calib="c.txt", gptq_expert_chunk=0), "--gptq-expert-chunk 0: use 1 or more"),
    (dict(kv_cache="fp8"), "--kv-cache fp8 needs --calib"),
    (dict(activations="fp8", group_size=32), "--activations fp8 needs INT4 group size 128"),
])
def test_bad_options_are_refused_in_one_place(kwargs, msg):
    with pytest.raises(KqError, match=msg.replace("+", r"\+")):
        Options(**kwargs)


def test_gptq_expert_chunk_reaches_awq_gptq_and_the_default_keeps_its_config():
    cfg = Options(method="awq+gptq", calib="c.txt", group_size=32, gptq_expert_chunk=2).method_config()
    assert cfg.expert_chunk == 2 and cfg.gptq == {"expert_chunk": 2}
    default = Options(method="awq+gptq", calib="c.txt", group_size=32).method_config()
    assert default.gptq == {} and default.expert_chunk == 16   # the resume fingerprint of earlier runs
    assert Options(method="awq", calib="c.txt", group_size=32).method_config().expert_chunk == 1
    assert Options(method="gptq", calib="c.txt", group_size=32, gptq_expert_chunk=4).method_config().expert_chunk == 4
    assert Options().method_config() is None
