"""The host tuning knobs a quantize run reads from the environment (KQ_SWITCH_INTERVAL_US,
KQ_GPU_WORKERS): applied while the shards are written, undone after, and not part of the result."""
import sys

import torch

from kq_testutil import SMALL_GLM5
from kq.checkpoint.source import open_source
from kq.quantize.plan import make_plan
from kq.quantize.run import Options, run_quantize
from kq.synth import generate


def test_switch_interval_applies_during_the_run_only_and_the_output_does_not_change(tmp_path, monkeypatch):
    src = tmp_path / "src"
    generate("glm5", src, seed=5, **SMALL_GLM5)
    source = open_source(src)
    plan = make_plan(source, group_size=128)
    before = sys.getswitchinterval()
    seen = []
    run_quantize(source, plan, tmp_path / "a", Options(jobs=2), device=torch.device("cpu"),
                 after_shard=lambda name: seen.append(sys.getswitchinterval()))
    monkeypatch.setenv("KQ_SWITCH_INTERVAL_US", "250")
    monkeypatch.setenv("KQ_GPU_WORKERS", "2")
    opts = Options(jobs=2)
    assert (opts.switch_us, opts.gpu_workers) == (250.0, 2)
    run_quantize(source, plan, tmp_path / "b", opts, device=torch.device("cpu"),
                 after_shard=lambda name: seen.append(sys.getswitchinterval()))
    n = len(plan.shards)
    assert seen[:n] == [before] * n and seen[n:] == [0.00025] * n
    assert sys.getswitchinterval() == before
    # tuning is not part of what makes a folder "this same run" (a resume may change it)
    assert Options(jobs=1, gpu_workers=7, switch_us=100.0).fingerprint(source) == \
        Options(jobs=4, gpu_workers=1, switch_us=5000.0).fingerprint(source)
    for f in sorted(p.name for p in (tmp_path / "a").iterdir() if p.suffix == ".safetensors"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
