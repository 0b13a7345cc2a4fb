"""FP8 KV-cache scales for MLA models, calibrated on text, written where SGLang 0.5.23 reads them.

What an MLA layer caches per token is its compressed latent: kv_a_layernorm(kv_a_proj(x)[:kv_lora])
(kv_lora_rank values) and the rope key kv_a_proj(x)[kv_lora:] after rotary (qk_rope_head_dim). SGLang
keeps one KV pool for both, so the layer has one scale, K and V equal.

Where SGLang 0.5.23 reads them (checked in its code):
- `quantization_config.kv_cache_scheme` {type float, num_bits 8, strategy tensor, symmetric, not
  dynamic}: CompressedTensorsConfig.get_quant_method gives each RadixAttention a
  CompressedTensorsKVCacheMethod (layers/quantization/compressed_tensors/compressed_tensors.py), whose
  BaseKVCacheMethod (layers/quantization/kv_cache.py) creates the F32 scalars `k_scale`, `v_scale`
  (-1 = not loaded -> 1.0) and turns them into k_scale_float after loading; kv_cache_quant_algo
  "FP8" makes `--kv-cache-dtype auto` pick the FP8 pool.
- the tensors: DeepSeek-family MLA builds that RadixAttention as `self_attn.attn_mqa`; the weight
  loader (models/deepseek_common/deepseek_weight_loader.py) loads
  `model.layers.L.self_attn.attn_mqa.{k,v}_scale` by name (the MTP layer's under the draft's
  `model.decoder.` through the NextN name mapper).
- what uses them: the FlashMLA decode backend (non-DSA MLA: DeepSeek-V3, Kimi K2) descales with
  k_scale; the DSA backend uses k_scale_float only on its TRT-LLM and AITER kernels. On Hopper
  with the default DSA kernels (GLM-5.x) the FP8 latent is stored with one dynamic FP32 scale per
  128 values instead (DSATokenToKVPool, mem_cache/memory_pool.py) and the static scale is unused;
  `kq eval --kv-cache fp8` shows all three.

Calibration: the source model runs layer by layer over the calibration windows (as GPTQ does); a
layer's scale is amax / 448 (the e4m3 maximum) over the latent of every calibration token. The
rope key's values after rotation are bounded by the norm of each rotated pair, which is used for it.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from kq.errors import KqError
from kq.model import LayerwiseModel

E4M3_MAX = 448.0
SCALES_FILE = "kq-kv-scales.safetensors"
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


def scale_names(layer_prefix: str) -> tuple[str, str]:
    return layer_prefix + "self_attn.attn_mqa.k_scale", layer_prefix + "self_attn.attn_mqa.v_scale"


def check_mla(config: dict) -> None:
    if not config.get("kv_lora_rank"):
        raise KqError(f"--kv-cache fp8: {config.get('model_type')} is not an MLA model; kq calibrates the MLA "
                      "latent cache's scale (GLM-5.x, Kimi K2)")


def latent_amax(kv_lora: int):
    """A forward hook pair that records the latent's largest magnitude of one layer."""
    seen = {"amax": 0.0}

    def on_norm(mod, args, out):                 # kv_a_layernorm output: the cached no-rope latent
        seen["amax"] = max(seen["amax"], float(out.detach().abs().amax()))

    def on_proj(mod, args, out):                 # kv_a_proj_with_mqa output: [..., kv_lora + rope]
        rope = out.detach()[..., kv_lora:].float()
        pairs = rope.unflatten(-1, (-1, 2)).norm(dim=-1)   # rotary turns (2i, 2i+1) pairs; norms stay
        seen["amax"] = max(seen["amax"], float(pairs.amax()))
    return seen, on_norm, on_proj


@torch.no_grad()
def calibrate_kv_scales(model: LayerwiseModel, ids: torch.Tensor, *, batch: int = 8,
                        on_layer: Callable[[int, int], None] | None = None) -> dict[int, float]:
    """{layer: FP8 scale} of every causal decoder layer, from the source model on ids [N, S]."""
    check_mla(model.reader.config)
    kv_lora = model.config.kv_lora_rank
    hs = [model.embed(c) for c in ids.split(batch)]
    carry: list = [None] * len(hs)
    scales = {}
    for i in range(model.num_layers):
        layer = model.load_layer(i)
        seen, on_norm, on_proj = latent_amax(kv_lora)
        h1 = layer.self_attn.kv_a_layernorm.register_forward_hook(on_norm)
        h2 = layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(on_proj)
        for b in range(len(hs)):
            hs[b], carry[b] = model.forward_layer(layer, hs[b], carry[b])
        h1.remove(), h2.remove()
        scales[i] = max(seen["amax"], 1e-12) / E4M3_MAX
        del layer
        gc.collect()
        if on_layer:
            on_layer(i + 1, model.num_layers)
    return scales


def scale_tensors(scales: dict[int, float], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors SGLang loads: F32 scalars, K and V equal (one latent)."""
    out = {}
    for i, s in sorted(scales.items()):
        k, v = scale_names(f"{prefix}model.layers.{i}.")
        out[k] = torch.tensor(s, dtype=torch.float32)
        out[v] = torch.tensor(s, dtype=torch.float32)
    return out


def read_scales(reader, num_layers: int, prefix: str = "") -> dict[int, float] | None:
    """The k_scale of every layer in a checkpoint, or None when it has none."""
    names = [scale_names(f"{prefix}model.layers.{i}.")[0] for i in range(num_layers)]
    if not all(n in reader for n in names):
        return None
    return {i: float(reader.raw(n)) for i, n in enumerate(names)}


def write_scales(out, scales: dict[int, float], prefix: str = "") -> dict:
    """OUT/kq-kv-scales.safetensors, atomically: {file, tensors, sha256, size, nbytes}."""
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    from kq.checkpoint.manifest import sha256_file
    t = scale_tensors(scales, prefix)
    final = Path(out) / SCALES_FILE
    tmp = final.with_suffix(".tmp")
    save_file(t, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, final)
    return {"file": SCALES_FILE, "tensors": sorted(t), "sha256": sha256_file(final), "size": final.stat().st_size,
            "nbytes": 4 * len(t)}
