"""The GPU RTN path of `kq quantize` (worker threads on CUDA streams of their own, pinned
D2H): deterministic across --jobs, equal to the kernel called plainly, NaN refused.
Marked gpu: needs a CUDA GPU (`python3 -m pytest -m gpu tests/gpu/test_run_gpu.py`)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from kq_testutil import run_kq

pytestmark = pytest.mark.gpu


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_gpu_quantize_deterministic_across_jobs_and_equal_to_kernel(tmp_path, small_glm5):
    outs = {}
    for jobs in (1, 3):
        out = tmp_path / f"out{jobs}"
        r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cuda",
                   "--jobs", str(jobs), "--json", env={"KQ_PROFILE": "1"} if jobs == 3 else None)
        assert r.returncode == 0, r.stderr
        outs[jobs] = out
        if jobs == 3:
            stages = json.loads(r.stdout.strip().splitlines()[-1])["profile"]["stages"]
            assert {"gpu_first_call", "read", "h2d", "kernel", "d2h", "write", "sha256"} <= set(stages), stages
    assert _files(outs[1]) == _files(outs[3])
    # every INT4 part equals the Triton kernel's on the default stream
    from kq.checkpoint.source import open_source
    from kq.quantize.rtn_triton import rtn_pack_gpu
    src = open_source(str(small_glm5))
    idx = json.loads((outs[1] / "model.safetensors.index.json").read_text())["weight_map"]
    n = 0
    for name in src.index.weight_map:
        if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
            continue
        sf = load_file(small_glm5 / src.index.weight_map[name])
        w, bs = sf[name], sf[name + "_scale_inv"]
        p, s = rtn_pack_gpu(w.cuda(), bs.cuda(), 32, "mse")
        base = name[: -len(".weight")]
        got = load_file(outs[1] / idx[base + ".weight_packed"])
        assert torch.equal(got[base + ".weight_packed"], p.cpu()) and torch.equal(got[base + ".weight_scale"], s.cpu())
        n += 1
    assert n > 0


def test_gpu_non_finite_refused():
    from kq.errors import KqError
    from kq.quantize.experts import rtn_parts
    w = torch.ones(128, 256).to(torch.float8_e4m3fn).pin_memory()
    scale = torch.full((1, 2), float("inf")).pin_memory()  # a corrupted block scale
    with pytest.raises(KqError, match="NaN or Inf"):
        rtn_parts("x.weight", w, scale, group=128, clip="mse", device=torch.device("cuda"))
