"""GLM-4.5/4.6/4.7 (`Glm4MoeForCausalLM`, `glm4_moe`) as compressed-tensors
float-quantized FP8: every Linear `X.weight` F8_E4M3 + `X.weight_scale` [out, 1]
(per output channel), activations dynamic per token.

Not confirmed against the Hub files (REFERENCE.md says so too): the scale dtype
(BF16 here, what llm-compressor's FP8 writers use; option `scale_dtype`) and the exact
`ignore` list (here lm_head, every router `mlp.gate`, and the MTP layer's `eh_proj`).
The config mirrors the Hub's transformers-4.5x style keys (rope_theta,
partial_rotary_factor, torch_dtype), which is what kq meets in the wild.
"""

from __future__ import annotations

from .layout import Layout
from .mla import add_dense_mlp, add_moe_mlp, add_mtp_extras

TINY = dict(
    num_layers=4, hidden=256, intermediate=768, moe_intermediate=512, n_experts=16, top_k=4,
    first_k_dense=1, mtp=True, heads=4, kv_heads=2, head_dim=64, vocab=4096, n_shared=1,
    max_position=1024, use_qk_norm=True,
)
# 512 -> 64 per rank at TP 8: a multiple of Marlin's 64 and of group 32 (valid).
# real_ratio: 1536/4 = 384 -> 48 per rank at TP 8: fails Marlin's %64 and group 32
# divides it but not 64/128 (for negative tests of the TP checks).
REAL_RATIO_MOE_INTERMEDIATE = 384
FULL = dict(
    TINY, num_layers=1, hidden=5120, intermediate=12288, moe_intermediate=1536, n_experts=160, top_k=8,
    first_k_dense=0, mtp=False, heads=96, kv_heads=8, head_dim=128, vocab=1024, max_position=131072,
)


WEIGHT_ARGS = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
              "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True, "type": "float"}
INPUT_ARGS = {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
              "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float"}


def ct_fp8_channel_config(ignore: list[str]) -> dict:
    """compressed-tensors float-quantized config: per-channel FP8 weights, dynamic per-token
    activations, one group targeting Linear (also used for the per-channel odd case of the
    DeepSeek-layout families, as in community FP8-Dynamic GLM-5 checkpoints)."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": INPUT_ARGS,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": WEIGHT_ARGS,
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def build(layout: Layout, o: dict) -> dict:
    n, h = o["num_layers"], o["hidden"]
    lo = dict(o, fp8="channel")  # every quantized Linear here is per-channel
    nh, kvh, hd = o["heads"], o["kv_heads"], o["head_dim"]
    layout.dense("lm_head.weight", (o["vocab"], h))
    layout.dense("model.embed_tokens.weight", (o["vocab"], h))
    ignore = ["lm_head"]
    for i in range(n + (1 if o["mtp"] else 0)):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        for name, out in (("q_proj", nh * hd), ("k_proj", kvh * hd), ("v_proj", kvh * hd)):
            layout.fp8_channel_linear(f"{a}.{name}", out, h, o["scale_dtype"], bias=True)
        layout.fp8_channel_linear(f"{a}.o_proj", h, nh * hd, o["scale_dtype"])
        if o["use_qk_norm"]:
            layout.norm(f"{a}.q_norm.weight", hd)
            layout.norm(f"{a}.k_norm.weight", hd)
        layout.norm(f"{p}.input_layernorm.weight", h)
        layout.norm(f"{p}.post_attention_layernorm.weight", h)
        if i < o["first_k_dense"] and i < n:
            add_dense_mlp(layout, p, h, o["intermediate"], lo)
        else:
            add_moe_mlp(layout, p, lo)
            ignore.append(f"{p}.mlp.gate")
        if i >= n:
            add_mtp_extras(layout, p, h)
            ignore.append(f"{p}.eh_proj")
    layout.norm("model.norm.weight", h)
    return config(o, [layout.prefix + m for m in ignore])


def config(o: dict, ignore: list[str]) -> dict:
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": 1,
        "eos_token_id": [0, 2],
        "head_dim": o["head_dim"],
        "hidden_act": "silu",
        "hidden_size": o["hidden"],
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": o["intermediate"],
        "max_position_embeddings": o["max_position"],
        "model_type": "glm4_moe",
        "moe_intermediate_size": o["moe_intermediate"],
        "norm_topk_prob": True,
        "num_attention_heads": o["heads"],
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": o["n_experts"],
        "n_shared_experts": o["n_shared"],
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": o["top_k"],
        "first_k_dense_replace": min(o["first_k_dense"], o["num_layers"]),
        "num_hidden_layers": o["num_layers"],
        "num_key_value_heads": o["kv_heads"],
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000,
        "num_nextn_predict_layers": 1 if o["mtp"] else 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0",
        "use_cache": True,
        "use_qk_norm": o["use_qk_norm"],
        "vocab_size": o["vocab"],
        "quantization_config": ct_fp8_channel_config(ignore),
    }


GENERATION_CONFIG = {"_from_model_config": True, "eos_token_id": [0, 2], "pad_token_id": 1,
                     "transformers_version": "4.54.0"}
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|user|>"]
