"""An emulated FP8 (e4m3) KV cache for MLA models: what a decode pool with `--kv-cache-dtype fp8_e4m3` reads.

A decode step attends over cached keys/values only, its own token's included (SGLang writes the new
latent to the pool, then attends over the pool). So every key and value the quantized model's
attention sees is quantize-dequantized here: a forward hook on each layer's kv_a_layernorm replaces
the no-rope latent (kv_lora_rank values per token, what K and V are expanded from) by
    fp8(latent / s) * s
with s per mode:
- "scale-1":     s = 1.0, SGLang's value when the checkpoint has no scales (BaseKVCacheMethod's -1 -> 1.0);
- "calibrated":  s = the layer's k_scale written by `kq quantize --kv-cache fp8`;
- "block-128":   s = amax / 448 of every 128 consecutive latent values of a token, in float32: the
                 layout of SGLang's DSA FP8 pool on Hopper (DSATokenToKVPool, quantize_k_cache_separate),
                 which ignores static scales.
The rope key (qk_rope_head_dim values) is left as it is: SGLang's DSA pool stores it in BF16; for
non-DSA MLA (Kimi K2) this leaves out the rope part's FP8 error.
"""
from __future__ import annotations

import torch

from kq.errors import KqError
from kq.model import LayerwiseModel

MODES = ("scale-1", "calibrated", "block-128")
E4M3_MAX = 448.0


def qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Round through e4m3 at a static scale (saturating, as SGLang's cast of a scaled value)."""
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return y.to(x.dtype)


def qdq_blocks(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Dynamic FP32 scale per `block` values along the last dim (SGLang's DSA FP8 latent)."""
    d = x.shape[-1]
    if d % block:
        raise KqError(f"kv_lora_rank {d} is not a multiple of {block}")
    xb = x.float().unflatten(-1, (d // block, block))
    s = (xb.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
    return ((xb / s).to(torch.float8_e4m3fn).float() * s).flatten(-2).to(x.dtype)


def emulate_fp8_kv(model: LayerwiseModel, mode: str, scales: dict[int, float] | None = None) -> LayerwiseModel:
    """Make every layer `model` loads from now on read its latent through an FP8 cache."""
    if mode not in MODES:
        raise KqError(f"KV-cache mode {mode!r}: use one of {', '.join(MODES)}")
    if not model.reader.config.get("kv_lora_rank"):
        raise KqError("--kv-cache fp8: the emulated FP8 cache is the MLA latent's (GLM-5.x, Kimi K2); this model "
                      "is not MLA")
    if mode == "calibrated" and not scales:
        raise KqError("--kv-cache fp8: the checkpoint has no KV-cache scales (make them with "
                      "`kq quantize --kv-cache fp8 --calib FILE`)")
    load = model.load_layer

    def load_layer(i, *args, **kw):
        layer = load(i, *args, **kw)
        s = scales.get(i) if scales else None

        def hook(mod, inp, out):
            return qdq_blocks(out) if mode == "block-128" else qdq(out, 1.0 if mode == "scale-1" else s)
        layer.self_attn.kv_a_layernorm.register_forward_hook(hook)
        return layer

    model.load_layer = load_layer
    return model
