"""GLM-5.x (`GlmMoeDsaForCausalLM`, `glm_moe_dsa`) in DeepSeek-style block FP8.

Names, dtypes, config keys and `modules_to_not_convert` follow the trained
../shared/models/tiny-glm-5.2-fp8 checkpoint (written by transformers 5.17), which
follows zai-org/GLM-5.x-FP8. Tiny defaults equal that model's dimensions.
"""

from __future__ import annotations

from .glm4_moe import ct_fp8_channel_config
from .layout import Layout
from .mla import add_mla, add_moe_mlp, add_dense_mlp, add_mtp_extras

TINY = dict(
    num_layers=4, hidden=256, intermediate=768, moe_intermediate=256, n_experts=16, top_k=4,
    first_k_dense=1, mtp=True, heads=4, q_lora=128, kv_lora=128, qk_nope=64, qk_rope=32, v_head=64,
    index_heads=2, index_head_dim=64, index_topk=96, vocab=4096, n_shared=1, max_position=1024,
)
# Real GLM-5.2 dimensions (transformers' GlmMoeDsaConfig defaults), few layers, small vocab:
# for benchmarks on full-size layer shapes.
FULL = dict(
    TINY, num_layers=1, hidden=6144, intermediate=12288, moe_intermediate=2048, n_experts=256, top_k=8,
    first_k_dense=0, mtp=False, heads=64, q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256,
    index_heads=32, index_head_dim=128, index_topk=2048, vocab=1024, max_position=202752,
)


def glm52_indexer_types(n: int) -> list[str]:
    """GLM-5.2 shares the DSA indexer: its own weights on layers i<3 or i%4==2 (REFERENCE.md)."""
    return ["full" if i < 3 or i % 4 == 2 else "shared" for i in range(n)]


def resolve_indexer_types(spec, n: int) -> list[str] | None:
    """'glm5.2' -> the sharing rule; 'full' -> GLM-5/5.1 (no key in config, every layer
    has an indexer) -> None; a list -> itself."""
    if spec in (None, "glm5.2"):
        return glm52_indexer_types(n)
    if spec == "full":
        return None
    types = list(spec)
    if len(types) != n or set(types) - {"full", "shared"}:
        raise ValueError(f"indexer_types must be {n} of 'full'/'shared', got {types}")
    return types


def build(layout: Layout, o: dict) -> dict:
    """Add every tensor to layout; return config.json."""
    n, h = o["num_layers"], o["hidden"]
    itypes = resolve_indexer_types(o["indexer_types"], n)
    n_mtp = 1 if o["mtp"] else 0
    layout.dense("lm_head.weight", (o["vocab"], h))
    layout.dense("model.embed_tokens.weight", (o["vocab"], h))
    not_convert = ["lm_head", "model.embed_tokens", "model.norm"]
    for i in range(n + n_mtp):
        p = f"model.layers.{i}"
        # The MTP layer (index n) is a full MoE layer with its own indexer.
        indexer = i >= n or itypes is None or itypes[i] == "full"
        add_mla(layout, p, o, indexer=indexer)
        layout.norm(f"{p}.input_layernorm.weight", h)
        layout.norm(f"{p}.post_attention_layernorm.weight", h)
        not_convert += [f"{p}.{m}" for m in ("input_layernorm", "post_attention_layernorm",
                                             "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")]
        if i < o["first_k_dense"] and i < n:
            add_dense_mlp(layout, p, h, o["intermediate"], o)
        else:
            add_moe_mlp(layout, p, o)
            not_convert += [f"{p}.mlp.gate", f"{p}.mlp.gate.e_score_correction_bias"]
        if i >= n:
            add_mtp_extras(layout, p, h)
            not_convert += [f"{p}.shared_head.norm", f"{p}.hnorm", f"{p}.enorm", f"{p}.eh_proj"]
        if indexer and o["indexers_proj_quirk"]:
            # GLM-5.2's Hub config names `indexers_proj` for the tensor `indexer.weights_proj`
            not_convert.append(f"{p}.self_attn.indexers_proj")
    layout.norm("model.norm.weight", h)
    cfg = config(o, itypes, [layout.prefix + m for m in not_convert])
    if o["fp8"] == "channel":
        # odd case: per-channel FP8 in the GLM-5 layout needs a compressed-tensors config
        bf16_linears = [m for m in not_convert if m.endswith((".mlp.gate", ".eh_proj"))]
        bf16_linears += [f"model.layers.{i}.self_attn.indexer.weights_proj" for i in range(n + n_mtp)
                         if i >= n or itypes is None or itypes[i] == "full"]
        cfg["quantization_config"] = ct_fp8_channel_config(
            [layout.prefix + m for m in ["lm_head"] + bf16_linears])
    return cfg


def config(o: dict, itypes: list[str] | None, not_convert: list[str]) -> dict:
    n, fkd = o["num_layers"], min(o["first_k_dense"], o["num_layers"])
    cfg = {
        "transformers_version": "5.17.0",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "output_hidden_states": False,
        "return_dict": True,
        "dtype": "bfloat16",
        "chunk_size_feed_forward": 0,
        "is_encoder_decoder": False,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "problem_type": None,
        "vocab_size": o["vocab"],
        "hidden_size": o["hidden"],
        "intermediate_size": o["intermediate"],
        "moe_intermediate_size": o["moe_intermediate"],
        "num_hidden_layers": n,
        "num_attention_heads": o["heads"],
        "num_key_value_heads": o["heads"],
        "n_shared_experts": o["n_shared"],
        "n_routed_experts": o["n_experts"],
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": o["kv_lora"],
        "q_lora_rank": o["q_lora"],
        "qk_rope_head_dim": o["qk_rope"],
        "v_head_dim": o["v_head"],
        "qk_nope_head_dim": o["qk_nope"],
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": o["top_k"],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": o["max_position"],
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-05,
        "use_cache": True,
        "pad_token_id": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "mlp_layer_types": ["dense"] * fkd + ["sparse"] * (n - fkd),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "index_topk": o["index_topk"],
        "index_head_dim": o["index_head_dim"],
        "index_n_heads": o["index_heads"],
        "mlp_bias": False,
        "head_dim": o["qk_rope"],
        "first_k_dense_replace": fkd,
        "layer_types": ["deepseek_sparse_attention"] * n,
        "indexer_types": itypes,
        "qk_head_dim": o["qk_nope"] + o["qk_rope"],
        "_name_or_path": "",
        "model_type": "glm_moe_dsa",
        "output_attentions": False,
        "num_nextn_predict_layers": 1 if o["mtp"] else 0,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": not_convert,
        },
    }
    if itypes is None:
        del cfg["indexer_types"]  # GLM-5 / 5.1: no sharing, no key
    return cfg


GENERATION_CONFIG = {"eos_token_id": 0, "pad_token_id": 1}
