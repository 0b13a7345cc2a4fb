"""Kimi K2 (`DeepseekV3ForCausalLM`, model_type `kimi_k2`) in block FP8, and the
already-INT4 Kimi K2.5+ (`KimiK25ForConditionalGeneration`) that kq must refuse.

K2 differs from GLM-5 in ways a loader can trip on: the config comes with `auto_map`
remote code (configuration_deepseek.py / modeling_deepseek.py, copied, never run),
`quantization_config` has no `modules_to_not_convert`, shards are named without zero
padding (model-1-of-61.safetensors), and the tokenizer is a tiktoken ranks file.
"""

from __future__ import annotations

from .glm4_moe import ct_fp8_channel_config
from .layout import Layout
from .mla import add_dense_mlp, add_mla, add_moe_mlp, add_mtp_extras
from . import tokfiles

TINY = dict(
    num_layers=3, hidden=256, intermediate=768, moe_intermediate=256, n_experts=16, top_k=4,
    first_k_dense=1, mtp=False, heads=4, q_lora=128, kv_lora=128, qk_nope=64, qk_rope=32, v_head=64,
    vocab=4096, n_shared=1, max_position=4096,
)
# Real Kimi K2 dimensions, few layers and a small vocab, for benchmarks.
FULL = dict(
    TINY, num_layers=1, hidden=7168, intermediate=18432, moe_intermediate=2048, n_experts=384, top_k=8,
    first_k_dense=0, heads=64, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128,
    vocab=1024, max_position=131072,
)
# Kimi's special tokens sit in the last 256 ids of the vocab ([BOS] = 163584 of 163840).
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
            "<|im_middle|>", "[UNK]", "[PAD]", "<|media_pad|>"]


def token_layout(vocab: int) -> tuple[int, int]:
    """-> (BPE merges, first special id). Like Kimi, specials take the last 256 ids when the
    vocab has room for them after the byte tokens and merges; a very small vocab puts them
    right after the ranks instead."""
    if vocab >= 256 + tokfiles.MAX_MERGES + 256:
        return tokfiles.MAX_MERGES, vocab - 256
    n = tokfiles.merges_that_fit(vocab - 256 - len(SPECIALS))
    return n, 256 + n


def special_ids(vocab: int) -> dict[str, int]:
    start = token_layout(vocab)[1]
    return {s: start + i for i, s in enumerate(SPECIALS)}


def add_decoder(layout: Layout, o: dict) -> None:
    n, h = o["num_layers"], o["hidden"]
    layout.dense("lm_head.weight", (o["vocab"], h))
    layout.dense("model.embed_tokens.weight", (o["vocab"], h))
    for i in range(n + (1 if o["mtp"] else 0)):
        p = f"model.layers.{i}"
        add_mla(layout, p, o, indexer=False)
        layout.norm(f"{p}.input_layernorm.weight", h)
        layout.norm(f"{p}.post_attention_layernorm.weight", h)
        if i < o["first_k_dense"] and i < n:
            add_dense_mlp(layout, p, h, o["intermediate"], o)
        else:
            add_moe_mlp(layout, p, o)
        if i >= n:
            add_mtp_extras(layout, p, h)
    layout.norm("model.norm.weight", h)


def text_config(o: dict) -> dict:
    ids = special_ids(o["vocab"])
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "ep_size": 1,
        "first_k_dense_replace": min(o["first_k_dense"], o["num_layers"]),
        "hidden_act": "silu",
        "hidden_size": o["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": o["intermediate"],
        "kv_lora_rank": o["kv_lora"],
        "max_position_embeddings": o["max_position"],
        "model_type": "kimi_k2",
        "moe_intermediate_size": o["moe_intermediate"],
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": o["n_experts"],
        "n_shared_experts": o["n_shared"],
        "norm_topk_prob": True,
        "num_attention_heads": o["heads"],
        "num_experts_per_tok": o["top_k"],
        "num_hidden_layers": o["num_layers"],
        "num_key_value_heads": o["heads"],
        "num_nextn_predict_layers": 1 if o["mtp"] else 0,
        "pretraining_tp": 1,
        "q_lora_rank": o["q_lora"],
        "qk_nope_head_dim": o["qk_nope"],
        "qk_rope_head_dim": o["qk_rope"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "v_head_dim": o["v_head"],
        "vocab_size": o["vocab"],
    }


def build_k2(layout: Layout, o: dict) -> dict:
    add_decoder(layout, o)
    cfg = text_config(o)
    # Kimi K2's FP8 config: DeepSeek-V3 style, and no modules_to_not_convert at all.
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    if o["fp8"] == "channel":  # odd case: per-channel FP8 in the DeepSeek layout
        routers = [f"{layout.prefix}model.layers.{i}.mlp.gate" for i in range(o["num_layers"] + (1 if o["mtp"] else 0))
                   if not (i < o["first_k_dense"] and i < o["num_layers"])]
        cfg["quantization_config"] = ct_fp8_channel_config([layout.prefix + "lm_head"] + routers)
    return cfg


INT4_ARGS = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
             "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"}


def build_k25(layout: Layout, o: dict) -> dict:
    """K2.5+: text weights under `language_model.`, BF16 except the routed experts, which
    are pack-quantized INT4 group 32; a (tiny) vision tower and projector beside them."""
    o = dict(o, fp8="bf16", experts_int4=32)
    base_prefix = layout.prefix
    layout.prefix = base_prefix + "language_model."  # groups remember the prefix they were added with
    add_decoder(layout, o)
    layout.prefix = base_prefix
    v = o["vision_hidden"]
    layout.dense("vision_tower.patch_embed.proj.weight", (v, 3 * 14 * 14))
    layout.dense("vision_tower.encoder.blocks.0.attn.qkv.weight", (3 * v, v))
    layout.norm("vision_tower.encoder.blocks.0.norm0.weight", v)
    layout.dense("mm_projector.proj.0.weight", (o["hidden"], v))
    text = text_config(o)
    text.pop("auto_map")  # the outer config names the remote code
    ids = special_ids(o["vocab"])
    quant = {
        "config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                      "targets": ["Linear"], "weights": INT4_ARGS}},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "pad_token_id": ids["[PAD]"],
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "hidden_size": v, "patch_size": 14, "num_hidden_layers": 1},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.2",
    }
    # Where K2.5 keeps quantization_config is not confirmed: public configs show it in
    # text_config; "top" / "both" cover a loader that looks at the outer config.
    where = o["quant_config_in"]
    if where not in ("text_config", "top", "both"):
        raise ValueError(f"quant_config_in must be 'text_config', 'top' or 'both', got {where!r}")
    if where in ("text_config", "both"):
        text["quantization_config"] = quant
    if where in ("top", "both"):
        cfg["quantization_config"] = quant
    return cfg


PLACEHOLDER = '''"""Placeholder written by kq.synth for a synthetic {what} checkpoint.

Real checkpoints ship remote code here (named by config.json's auto_map). kq must copy
this file through and never execute it: importing it fails loudly so a test notices.
"""

raise RuntimeError("kq.synth placeholder {name}: remote code must never be executed")
'''


def remote_code_files(names: list[str], what: str) -> dict[str, str]:
    return {n: PLACEHOLDER.format(name=n, what=what) for n in names}


def tokenizer_files(o: dict) -> dict[str, str]:
    text, _ = tokfiles.tiktoken_model(token_layout(o["vocab"])[0])
    ids = special_ids(o["vocab"])
    entry = lambda s: {"content": s, "lstrip": False, "normalized": False, "rstrip": False,  # noqa: E731
                       "single_word": False, "special": True}
    cfg = {
        "added_tokens_decoder": {str(i): entry(s) for s, i in ids.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "chat_template": "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{% endfor %}",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": o["max_position"],
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    return {"tiktoken.model": text, "tokenizer_config.json": cfg}


def generation_config(o: dict) -> dict:
    return {"max_length": o["max_position"], "eos_token_id": special_ids(o["vocab"])["<|im_end|>"]}
