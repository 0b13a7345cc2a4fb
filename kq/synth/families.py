"""The registry: family names, their options (default + one-line description), and the
step that turns (family, seed, options) into a Layout, a shard assignment and side files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import glm4_moe, glm5, kimi
from .assemble import assign, dump_json, split_scales
from .layout import Layout
from . import tokfiles


@dataclass(frozen=True)
class Option:
    default: Any
    help: str


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    tiny: dict = field(repr=False)  # all dimensions, some not exposed as options (e.g. max_position)
    full: dict = field(repr=False)  # real layer shapes, few layers, small vocab
    options: dict[str, Option] = field(default_factory=dict)
    make: Callable[["Plan", dict], None] = field(default=None, repr=False)


@dataclass
class Plan:
    layout: Layout
    files: dict[str, str | bytes]
    assignment: dict[str, str] = field(default_factory=dict)
    index: bool = True
    overwrite: bool = False
    threads: int | None = None
    workers: int | None = None
    moved_scales: list[str] = field(default_factory=list)


COMMON = {
    "n_shards": Option(3, "number of safetensors shards (ignored when max_shard_bytes is set)"),
    "max_shard_bytes": Option(None, "cut shards at about this many bytes instead of n_shards"),
    "shard_names": Option("padded", "'padded' (model-00001-of-00003) or 'unpadded' (model-1-of-3)"),
    "split_scale": Option(False, "odd case: put every other weight's scale in the next shard"),
    "prefix": Option("", "odd case: prefix every tensor name, e.g. 'language_model.'"),
    "single_file": Option(False, "one model.safetensors and no index (n_shards forced to 1)"),
    "size": Option("tiny", "'tiny' or 'full' (real layer shapes, few layers, small vocab)"),
    "overwrite": Option(False, "replace a non-empty out_dir"),
    "threads": Option(None, "torch intra-op threads while generating (default 1)"),
    "workers": Option(None, "tensor groups generated in parallel (default: 1 for tiny, min(16, cores) for full)"),
}

# Dimension options: their defaults are the family's tiny preset (shown by FAMILIES);
# size="full" swaps in the full-size preset for every dimension not given explicitly.
DIM_HELP = {
    "num_layers": "decoder layers (num_hidden_layers), MTP not counted",
    "hidden": "hidden_size (need not be a multiple of 128: block scales use ceil)",
    "intermediate": "dense MLP intermediate_size",
    "moe_intermediate": "routed/shared expert intermediate size",
    "n_experts": "routed experts per MoE layer",
    "top_k": "num_experts_per_tok",
    "first_k_dense": "first_k_dense_replace: leading dense-MLP layers",
    "mtp": "add the MTP layer at index num_layers",
    "vocab": "vocab_size (embeddings and lm_head rows)",
    "heads": "attention heads",
    "n_shared": "shared experts (their intermediate is n_shared * moe_intermediate)",
}
MLA_HELP = DIM_HELP | {
    "q_lora": "q_lora_rank",
    "kv_lora": "kv_lora_rank",
    "qk_nope": "qk_nope_head_dim",
    "qk_rope": "qk_rope_head_dim",
    "v_head": "v_head_dim",
}
FP8_OPTIONS = {
    "fp8": Option("block", "'block' (128x128, weight_scale_inv) or 'channel' (odd case: per-channel weight_scale)"),
    "scale_dtype": Option("BF16", "per-channel scale dtype when fp8='channel'"),
}


def dims(tiny: dict, helps: dict[str, str]) -> dict[str, Option]:
    return {k: Option(tiny[k], h) for k, h in helps.items()}


def _check_fp8(o: dict) -> None:
    if o["fp8"] not in ("block", "channel"):
        raise ValueError(f"fp8 must be 'block' or 'channel', got {o['fp8']!r}")
    if o["scale_dtype"] not in ("BF16", "F32", "F16"):
        raise ValueError(f"scale_dtype must be BF16, F16 or F32, got {o['scale_dtype']!r}")


def make_glm5(plan: Plan, o: dict) -> None:
    _check_fp8(o)
    cfg = glm5.build(plan.layout, o)
    plan.files["config.json"] = dump_json(cfg)
    plan.files["generation_config.json"] = dump_json(glm5.GENERATION_CONFIG)
    plan.files["tokenizer.json"] = tokfiles.tokenizer_json(["<|endoftext|>", "<|pad|>"], o["vocab"])
    plan.files["tokenizer_config.json"] = dump_json({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>", "model_max_length": o["max_position"]})


def make_glm4_moe(plan: Plan, o: dict) -> None:
    _check_fp8(o | {"fp8": "channel"})
    if o["real_ratio"]:
        o = dict(o, moe_intermediate=glm4_moe.REAL_RATIO_MOE_INTERMEDIATE)
    plan.files["config.json"] = dump_json(glm4_moe.build(plan.layout, o))
    plan.files["generation_config.json"] = dump_json(glm4_moe.GENERATION_CONFIG)
    plan.files["tokenizer.json"] = tokfiles.tokenizer_json(glm4_moe.SPECIALS, o["vocab"])
    plan.files["tokenizer_config.json"] = dump_json({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>", "model_max_length": o["max_position"]})


def _kimi_side_files(plan: Plan, o: dict, code: list[str], what: str) -> None:
    plan.files["generation_config.json"] = dump_json(kimi.generation_config(o))
    for name, data in kimi.tokenizer_files(o).items():
        plan.files[name] = data if isinstance(data, str) else dump_json(data)
    plan.files.update(kimi.remote_code_files(code, what))


def make_kimi_k2(plan: Plan, o: dict) -> None:
    _check_fp8(o)
    plan.files["config.json"] = dump_json(kimi.build_k2(plan.layout, o))
    _kimi_side_files(plan, o, ["configuration_deepseek.py", "modeling_deepseek.py", "tokenization_kimi.py"], "Kimi K2")


def make_kimi_k25(plan: Plan, o: dict) -> None:
    if o["hidden"] % 32 or o["moe_intermediate"] % 32:
        raise ValueError("kimi_k25: hidden and moe_intermediate must be multiples of the INT4 group (32)")
    plan.files["config.json"] = dump_json(kimi.build_k25(plan.layout, o))
    _kimi_side_files(plan, o, ["configuration_kimi_k25.py", "modeling_kimi_k25.py", "configuration_deepseek.py",
                               "modeling_deepseek.py", "tokenization_kimi.py"], "Kimi K2.5")


GLM4_OPTIONS = COMMON | dims(glm4_moe.TINY, DIM_HELP | {
    "kv_heads": "num_key_value_heads (GQA)",
    "head_dim": "head_dim",
    "use_qk_norm": "per-head q_norm/k_norm weights (GLM-4.5+ have them)",
}) | {
    "scale_dtype": Option("BF16", "dtype of X.weight_scale [out,1]; the Hub files' real dtype is unconfirmed"),
    "real_ratio": Option(False, "moe_intermediate 384 (1536/4): 48 per rank at TP 8, fails Marlin's %64"),
}
KIMI_OPTIONS = COMMON | dims(kimi.TINY, MLA_HELP) | {"shard_names": Option("unpadded", COMMON["shard_names"].help)}

FAMILIES: dict[str, Family] = {
    "glm5": Family(
        "glm5",
        "GLM-5.x GlmMoeDsaForCausalLM (glm_moe_dsa): block FP8, MLA + DSA indexer, MTP layer",
        glm5.TINY, glm5.FULL,
        COMMON | dims(glm5.TINY, MLA_HELP | {
            "index_heads": "index_n_heads",
            "index_head_dim": "index_head_dim",
            "index_topk": "index_topk (config only)",
        }) | FP8_OPTIONS | {
            "indexer_types": Option("glm5.2", "'glm5.2' (full if i<3 or i%4==2, else shared), 'full' (GLM-5/5.1: no key), or a list"),
            "indexers_proj_quirk": Option(False, "list `self_attn.indexers_proj` in modules_to_not_convert (GLM-5.2 Hub naming quirk)"),
        },
        make_glm5,
    ),
    "glm4_moe": Family(
        "glm4_moe",
        "GLM-4.5/4.6/4.7 Glm4MoeForCausalLM: compressed-tensors per-channel FP8, GQA with q/k/v bias, MTP layer",
        glm4_moe.TINY, glm4_moe.FULL,
        GLM4_OPTIONS,
        make_glm4_moe,
    ),
    "kimi_k2": Family(
        "kimi_k2",
        "Kimi K2 DeepseekV3ForCausalLM (kimi_k2): block FP8 without modules_to_not_convert, "
        "unpadded shard names, tiktoken.model, auto_map placeholder .py files",
        kimi.TINY, kimi.FULL,
        KIMI_OPTIONS | FP8_OPTIONS,
        make_kimi_k2,
    ),
    "kimi_k25": Family(
        "kimi_k25",
        "Kimi K2.5+ KimiK25ForConditionalGeneration: already INT4 (pack-quantized g32 experts under "
        "language_model.), for testing that kq refuses it",
        kimi.TINY, kimi.FULL,
        KIMI_OPTIONS | {
            "vision_hidden": Option(64, "hidden size of the (tiny) vision tower"),
            "quant_config_in": Option("text_config", "where quantization_config goes: 'text_config' (as public K2.5 configs show), 'top' or 'both'")},
        make_kimi_k25,
    ),
}


def build(family: str, seed: int, options: dict) -> Plan:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    fam = FAMILIES[family]
    unknown = set(options) - set(fam.options)
    if unknown:
        raise TypeError(f"{family}: unknown option(s) {sorted(unknown)}; valid: {sorted(fam.options)}")
    size = options.get("size", "tiny")
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    o = fam.tiny | {k: opt.default for k, opt in fam.options.items()}
    if size == "full":
        o |= fam.full  # the preset replaces every default dimension...
    o |= options  # ...and an explicit option wins over both
    plan = Plan(Layout(seed, prefix=o["prefix"]), {}, overwrite=o["overwrite"], threads=o["threads"],
                workers=o["workers"])
    fam.make(plan, o)
    if o["single_file"]:
        plan.assignment = {e.name: "model.safetensors" for e in plan.layout.entries}
        plan.index = False
    else:
        plan.assignment = assign(plan.layout, o["n_shards"], o["max_shard_bytes"], o["shard_names"])
    if o["split_scale"]:
        plan.moved_scales = split_scales(plan.layout, plan.assignment)
    return plan
