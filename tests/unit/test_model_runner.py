"""The layer-wise runner gives the logits of transformers' own whole model.

Reference: a float32 copy of each generated checkpoint, dequantized here (block or
per-channel FP8 scales expanded by hand, not through kq's reader), loaded with
transformers' `from_pretrained` (its own mapping of per-expert tensors onto the fused
expert parameters), run as one model. The runner reads the FP8 original.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kq.checkpoint.reader import CheckpointReader
from kq.errors import KqError
from kq.model import LayerwiseModel
from kq.synth import generate

SMALL = dict(hidden=128, n_experts=8, moe_intermediate=128, intermediate=256, vocab=512, num_layers=4)


def _dequant_copy(src, dst):
    """Every tensor as float32 under its own name; FP8 weights times their expanded scales."""
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    raw = {}
    for shard in sorted(set(idx.values())):
        with safe_open(str(src / shard), "pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    cfg = json.loads((src / "config.json").read_text())
    block = cfg["quantization_config"]["quant_method"] == "fp8"   # DeepSeek-style; else per-channel
    out = {}
    for k, t in raw.items():
        if k.endswith(("_scale_inv", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = raw.get(k + "_scale_inv", raw.get(k + "_scale")).float()
            if not block:                                         # per channel [out, 1]
                full = s.expand(t.shape)
            else:                                                 # 128x128 blocks
                full = s.repeat_interleave(128, 0)[: t.shape[0]].repeat_interleave(128, 1)[:, : t.shape[1]]
            out[k] = t.float() * full
        else:
            out[k] = t.float()
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    cfg.pop("quantization_config", None)
    cfg.pop("auto_map", None)
    if cfg.get("model_type") == "kimi_k2":
        cfg["model_type"] = "deepseek_v3"
    (dst / "config.json").write_text(json.dumps(cfg))


def _layerwise_logits(folder, ids):
    m = LayerwiseModel(CheckpointReader(folder))
    h, carry = m.embed(ids), None
    for i in range(m.num_layers):
        h, carry = m.forward_layer(m.load_layer(i), h, carry)
    return m.logits(h)


@pytest.mark.parametrize("family,opts", [
    ("glm5", dict(SMALL, index_topk=16)),   # DSA: top-16 of 32 tokens, so the indexer really selects
    ("glm4_moe", SMALL),
    ("kimi_k2", dict(SMALL, num_layers=3)),
])
def test_layerwise_logits_match_transformers_model(tmp_path, family, opts):
    from transformers import AutoModelForCausalLM
    src = generate(family, tmp_path / "src", seed=3, **opts)
    _dequant_copy(src, tmp_path / "ref")
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32).eval()
    ids = torch.randint(0, opts["vocab"], (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits
    got = _layerwise_logits(src, ids)
    assert got.shape == ref.shape
    # grouped vs per-expert matmuls: float32 rounding only
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert ref.std() > 0


def test_router_is_the_models_own(tmp_path):
    """Selection uses the correction bias, weights do not (DeepSeek/GLM routing)."""
    src = generate("glm5", tmp_path / "src", seed=4, **SMALL)
    m = LayerwiseModel(CheckpointReader(src))
    layer = m.load_layer(1)
    gate = layer.mlp.gate
    assert gate.e_score_correction_bias.abs().sum() > 0  # else selection would not test the bias
    x = torch.randn(64, SMALL["hidden"], generator=torch.Generator().manual_seed(1))
    _, w, idx = gate(x)
    scores = torch.sigmoid(x @ gate.weight.float().T)                     # [T, E]
    choice = scores + gate.e_score_correction_bias
    want_idx = choice.topk(m.config.num_experts_per_tok, -1).indices
    assert torch.equal(idx.sort(-1).values, want_idx.sort(-1).values)
    want_w = scores.gather(1, idx)
    want_w = want_w / want_w.sum(-1, keepdim=True) * m.config.routed_scaling_factor
    assert torch.allclose(w, want_w, atol=1e-6)


def test_unknown_family_is_refused(tmp_path):
    src = generate("glm5", tmp_path / "src", seed=0, **SMALL)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KqError, match="model_type 'llama'"):
        LayerwiseModel(CheckpointReader(src))


def test_missing_tensor_is_one_clear_error(tmp_path):
    src = generate("glm5", tmp_path / "src", seed=0, **SMALL)
    ix = json.loads((src / "model.safetensors.index.json").read_text())
    del ix["weight_map"]["model.layers.1.mlp.gate.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(ix))
    m = LayerwiseModel(CheckpointReader(src))
    with pytest.raises(KqError, match="model.layers.1.mlp.gate.weight"):
        m.load_layer(1)
