"""`kq shard`: per-rank prepacked expert files reassemble exactly to the checkpoint's experts.
(Main venv: no SGLang needed. The SGLang side — that these files equal what SGLang's own loader
plus kq's prepack build on each rank — is in test_plugin.py.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open


def kq(*args):
    return subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from kq.synth import generate

    root = tmp_path_factory.mktemp("shard")
    src = generate("glm5", root / "src", seed=3, hidden=128, n_experts=8, moe_intermediate=256, num_layers=3,
                   vocab=512, intermediate=256)
    r = kq("quantize", src, "--out", root / "int4", "--group-size", "32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    return root / "int4"


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Independent reading of compressed-tensors pack-quantized: column 8w+k in bits [4k, 4k+4)."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = packed.to(torch.int64) & 0xFFFFFFFF
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def dense(folder, name, group):
    with safe_open(str(_file_of(folder, name + ".weight_packed")), "pt") as f:
        q = unpack(f.get_tensor(name + ".weight_packed")).float() - 8
    with safe_open(str(_file_of(folder, name + ".weight_scale")), "pt") as f:
        s = f.get_tensor(name + ".weight_scale").float()
    return q * s.repeat_interleave(group, dim=1)


def _file_of(folder, tensor):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return folder / idx[tensor]


@pytest.mark.parametrize("tp,ep", [(8, 1), (8, 2), (2, 1)])
def test_shard_files_reassemble_exactly(ckpt, tp, ep):
    from kq.kernels.layout import dequantize_prepacked

    r = kq("shard", ckpt, "--tp", tp, "--ep", ep, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    d = ckpt / "kq-shards" / f"tp{tp}-ep{ep}"
    assert out["out"] == str(d) and out["files"] == tp
    mf = json.loads((d / "manifest.json").read_text())
    assert (mf["tp"], mf["ep"], mf["group"]) == (tp, ep, 32)
    layers = sorted(mf["layers"])
    assert layers == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts", "model.layers.3.mlp.experts"]
    m, per_ep = tp // ep, 8 // ep
    for layer in layers:
        H, I = 128, 256
        gate = torch.zeros(8, I, H)
        up = torch.zeros(8, I, H)
        down = torch.zeros(8, H, I)
        i_tp = I // m
        for e in range(ep):
            for t in range(m):
                with safe_open(str(d / f"ep{e}-tp{t}.safetensors"), "pt") as f:
                    q13, s13, q2, s2 = (f.get_tensor(f"{layer}.{k}") for k in ("w13_q", "w13_s", "w2_q", "w2_s"))
                w13 = dequantize_prepacked(q13, s13, H, 32)        # [E_local, 2*i_tp, H]
                w2 = dequantize_prepacked(q2, s2, i_tp, 32)        # [E_local, H, i_tp]
                ex = slice(e * per_ep, (e + 1) * per_ep)
                rows = slice(t * i_tp, (t + 1) * i_tp)
                gate[ex, rows] = w13[:, :i_tp]
                up[ex, rows] = w13[:, i_tp:]
                down[ex, :, rows] = w2
        for x in range(8):
            assert torch.equal(gate[x], dense(ckpt, f"{layer}.{x}.gate_proj", 32)), (layer, x)
            assert torch.equal(up[x], dense(ckpt, f"{layer}.{x}.up_proj", 32)), (layer, x)
            assert torch.equal(down[x], dense(ckpt, f"{layer}.{x}.down_proj", 32)), (layer, x)
    for name, meta in mf["files"].items():
        assert (d / name).stat().st_size == meta["size"]


def test_shard_refuses_a_split_that_does_not_fit(ckpt):
    r = kq("shard", ckpt, "--tp", 16)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("kq: error:")
    assert "16 per rank, not a multiple of the group size 32" in r.stderr
    assert not (ckpt / "kq-shards" / "tp16-ep1").exists()


def test_shard_refuses_an_unfinished_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = kq("shard", tmp_path, "--tp", 8)
    assert r.returncode == 2 and "not a finished kq checkpoint" in r.stderr


def test_shard_refuses_ep_not_dividing_tp(ckpt):
    r = kq("shard", ckpt, "--tp", 8, "--ep", 3)
    assert r.returncode == 2 and "must divide the TP degree" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when there is no GPU")
def test_shard_device_cuda_without_gpu_is_one_line(ckpt, tmp_path):
    import shutil
    folder = shutil.copytree(ckpt, tmp_path / "int4", ignore=shutil.ignore_patterns("kq-shards"))
    r = kq("shard", folder, "--tp", "2", "--device", "cuda")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--device cuda: no CUDA GPU visible" in r.stderr
    assert not (folder / "kq-shards").exists()


@pytest.mark.gpu
def test_shard_prepack_on_gpu_writes_the_cpu_bytes(ckpt, tmp_path):
    import shutil
    out = {}
    for dev in ("cpu", "cuda"):
        folder = shutil.copytree(ckpt, tmp_path / dev, ignore=shutil.ignore_patterns("kq-shards"))
        r = kq("shard", folder, "--tp", "4", "--ep", "2", "--device", dev)
        assert r.returncode == 0, r.stderr
        out[dev] = {p.name: p.read_bytes() for p in sorted((folder / "kq-shards" / "tp4-ep2").iterdir())}
    assert out["cpu"].keys() == out["cuda"].keys() and len(out["cpu"]) == 5   # 4 rank files + manifest
    assert out["cpu"] == out["cuda"]
