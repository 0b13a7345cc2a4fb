"""Every family and odd layout through `kq quantize` + `kq verify`, with the kept tensors
byte-identical and the experts within RTN error of the source."""
import json

import pytest
import torch
from safetensors import safe_open

from kq_testutil import run_kq
from kq.checkpoint.reader import CheckpointReader
from kq.recipes import expert_match
from kq.synth import generate

SMALL = dict(hidden=128, n_experts=4, num_layers=3, vocab=512)
CASES = {
    "glm4_moe": ("glm4_moe", dict(SMALL, moe_intermediate=256, intermediate=256)),
    "kimi_k2": ("kimi_k2", dict(SMALL, moe_intermediate=128, intermediate=256)),
    "glm5_split_scale": ("glm5", dict(SMALL, moe_intermediate=128, intermediate=256, split_scale=True)),
    "glm5_language_model_prefix": ("glm5", dict(SMALL, moe_intermediate=128, intermediate=256, prefix="language_model.")),
    "glm5_dims_not_128": ("glm5", dict(SMALL, hidden=160, moe_intermediate=96, intermediate=224)),
    "glm5_unpadded_single_file": ("glm5", dict(SMALL, moe_intermediate=128, intermediate=256, single_file=True)),
}


def _raw_bytes(folder, name, index):
    with safe_open(str(folder / index[name]), "pt") as f:
        t = f.get_tensor(name)
    return t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _index(folder):
    p = folder / "model.safetensors.index.json"
    if p.exists():
        return json.loads(p.read_text())["weight_map"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


@pytest.mark.parametrize("case", list(CASES))
def test_family_quantizes_and_verifies(tmp_path, case):
    family, opts = CASES[case]
    src, out = tmp_path / "src", tmp_path / "out"
    generate(family, src, seed=5, **opts)
    r = run_kq("quantize", src, "--out", out, "--group-size", "32", "--device", "cpu", "--clip", "absmax")
    assert r.returncode == 0, r.stderr
    v = run_kq("verify", out)
    assert v.returncode == 0, v.stderr

    si, oi = _index(src), _index(out)
    src_cfg = json.loads((src / "config.json").read_text())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fp8_w = qc["config_groups"]["fp8"]["weights"]
    assert fp8_w["strategy"] == ("channel" if family == "glm4_moe" else "block")
    experts = [n for n in si if expert_match(n)]
    assert experts
    rs, ro = CheckpointReader(src), CheckpointReader(out)
    for n in experts:
        base = n[: -len(".weight")]
        w, wq = rs.weight(base), ro.weight(base)
        assert wq.shape == w.shape
        assert ((wq - w).norm() / w.norm()) < 0.15, n
    expert_scales = {e + s for e in experts for s in ("_scale_inv", "_scale")}
    kept = [n for n in si if n not in experts and n not in expert_scales]
    for n in kept:
        out_name = n[: -len("_inv")] if n.endswith(".weight_scale_inv") else n
        assert _raw_bytes(src, n, si) == _raw_bytes(out, out_name, oi), n
    # every non-weight file of the source is carried through unchanged
    for p in src.iterdir():
        if not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    if family == "kimi_k2":
        assert sorted(set(oi.values())) == ["model-1-of-3.safetensors", "model-2-of-3.safetensors", "model-3-of-3.safetensors"]
        assert (out / "tiktoken.model").exists() and (out / "modeling_deepseek.py").exists()
        assert json.loads((out / "config.json").read_text())["auto_map"] == src_cfg["auto_map"]
