"""The trained tiny GLM-5.2 model through `kq quantize` at group 32 and 128: experts match
an independent dequantization to RTN error, everything else is byte-identical, and the
compressed-tensors library decompresses the result."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open

from kq_testutil import TINY_MODEL

EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _all(folder):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(idx.values())):
        with safe_open(str(folder / shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _src_weight(src, name):
    # Independent FP8 block dequant: numpy, explicit 128x128 block expansion.
    w = src[name].to(torch.float32).numpy()
    s = src[name + "_scale_inv"].numpy()
    full = np.kron(s, np.ones((128, 128), dtype=np.float32))[: w.shape[0], : w.shape[1]]
    return w * full


def _unpack(packed, shape):
    # Independent nibble extraction: uint32 view, shift by 4k, low nibble, minus 8.
    words = packed.numpy().view(np.uint32)
    nib = np.stack([(words >> (4 * k)) & 0xF for k in range(8)], axis=-1).reshape(words.shape[0], -1)
    return nib[:, : shape[1]].astype(np.int32) - 8


@pytest.fixture(scope="module", params=[32, 128])
def quantized(request, trained_output):
    return request.param, trained_output(request.param)


@pytest.fixture(scope="module")
def source_tensors():
    return _all(TINY_MODEL)


def test_experts_match_independent_dequant(quantized, source_tensors):
    group, out = quantized
    dst = _all(out)
    experts = [n for n in source_tensors if EXPERT.match(n)]
    assert len(experts) == 4 * 16 * 3  # layers 1-3 and the MTP layer 4
    for name in experts:
        base = name[: -len(".weight")]
        assert name not in dst and name + "_scale_inv" not in dst
        packed, scale, shape = dst[base + ".weight_packed"], dst[base + ".weight_scale"], dst[base + ".weight_shape"]
        assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16 and shape.dtype == torch.int64
        w = _src_weight(source_tensors, name)
        assert shape.tolist() == list(w.shape)
        assert packed.shape == (w.shape[0], w.shape[1] // 8) and scale.shape == (w.shape[0], w.shape[1] // group)
        q = _unpack(packed, w.shape)
        s = np.repeat(scale.to(torch.float32).numpy(), group, axis=1)
        # RTN with the stored scale: each code is the nearest representable one
        expect = np.clip(np.rint(w / s), -8, 7)
        assert (q == expect).mean() > 0.999, name
        rel = np.linalg.norm(q * s - w) / np.linalg.norm(w)
        assert rel < 0.12, (name, rel)


def test_everything_else_byte_identical(quantized, source_tensors):
    _, out = quantized
    dst = _all(out)
    kept = [n for n in source_tensors if not EXPERT.match(n) and not (n.endswith("_scale_inv") and EXPERT.match(n[: -len("_scale_inv")]))]
    assert len(kept) > 100
    for name in kept:
        out_name = name[: -len("_inv")] if name.endswith(".weight_scale_inv") else name
        a, b = source_tensors[name], dst[out_name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes(), name
    # nothing else was added
    n_expert_parts = 3 * sum(1 for n in source_tensors if EXPERT.match(n))
    assert len(dst) == len(kept) + n_expert_parts
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (TINY_MODEL / f).read_bytes()


def test_compressed_tensors_decompresses_output(quantized):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from kq.checkpoint.reader import CheckpointReader

    group, out = quantized
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["int4_experts"]
    assert scheme.weights.group_size == group and scheme.weights.num_bits == 4
    r = CheckpointReader(out)
    for base in ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.3.mlp.experts.15.down_proj",
                 "model.layers.4.mlp.experts.7.up_proj"):
        sd = {k: r.raw(f"{base}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")}
        ct = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
        assert ct.dtype == torch.bfloat16  # it dequantizes in the scale's dtype: q * s rounded once
        assert torch.equal(ct, r.weight(base).to(torch.bfloat16))


def test_config_keeps_source_keys_and_declares_groups(quantized):
    _, out = quantized
    src_cfg = json.loads((TINY_MODEL / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == \
           {k: v for k, v in src_cfg.items() if k != "quantization_config"}
    qc = cfg["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["fp8"]["targets"] == ["Linear"]
    assert qc["config_groups"]["fp8"]["weights"]["block_structure"] == [128, 128]
    for m in ("lm_head", "model.layers.1.mlp.gate", "model.layers.4.eh_proj", "model.layers.0.self_attn.indexer.weights_proj"):
        assert m in qc["ignore"]
