"""Which transformers classes run each family, found by name (no remote code).

Every supported family's decoder layer, rotary embedding and final norm live in one
transformers modeling module. Kimi K2 ships `model_type: kimi_k2` with an `auto_map`
to remote code; its layers are DeepSeek-V3's, so it is built from `deepseek_v3`
without ever running the checkpoint's Python files.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from kq.errors import KqError


@dataclass(frozen=True)
class Arch:
    module: str        # transformers modeling module
    config_module: str
    config_cls: str
    prefix: str        # class-name prefix inside the module: <prefix>DecoderLayer, ...
    # GLM-5.x (DSA) layers return (hidden, topk_indices) and a "shared" indexer layer
    # reuses the previous layer's top-k: the runner carries it from layer to layer.
    carries_topk: bool = False
    # DSA's indexer needs an explicit causal mask (transformers forces one too).
    explicit_mask: bool = False


ARCHS = {
    "glm_moe_dsa": Arch("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
                        "transformers.models.glm_moe_dsa.configuration_glm_moe_dsa", "GlmMoeDsaConfig",
                        "GlmMoeDsa", carries_topk=True, explicit_mask=True),
    "glm4_moe": Arch("transformers.models.glm4_moe.modeling_glm4_moe",
                     "transformers.models.glm4_moe.configuration_glm4_moe", "Glm4MoeConfig", "Glm4Moe"),
    "deepseek_v3": Arch("transformers.models.deepseek_v3.modeling_deepseek_v3",
                        "transformers.models.deepseek_v3.configuration_deepseek_v3", "DeepseekV3Config", "DeepseekV3"),
}
ARCHS["kimi_k2"] = ARCHS["deepseek_v3"]

# Keys of config.json that describe storage or remote code, not the architecture.
_NOT_ARCH = ("quantization_config", "auto_map", "compression_config")


def arch_for(config: dict) -> Arch:
    mt = config.get("model_type")
    if mt not in ARCHS:
        raise KqError(f"kq cannot run model_type {mt!r} layer by layer; it knows {', '.join(sorted(ARCHS))}")
    return ARCHS[mt]


def classes(arch: Arch):
    """(DecoderLayer, RotaryEmbedding, RMSNorm, PreTrainedModel) classes of the family."""
    m = importlib.import_module(arch.module)
    return tuple(getattr(m, arch.prefix + n) for n in ("DecoderLayer", "RotaryEmbedding", "RMSNorm", "PreTrainedModel"))


def build_config(config: dict, attn: str = "sdpa"):
    """The transformers config object for a checkpoint's config.json (storage keys dropped)."""
    arch = arch_for(config)
    cls = getattr(importlib.import_module(arch.config_module), arch.config_cls)
    d = {k: v for k, v in config.items() if k not in _NOT_ARCH}
    d["model_type"] = cls.model_type
    try:
        cfg = cls(**d)
    except (TypeError, ValueError) as e:
        raise KqError(f"config.json does not describe a valid {cls.model_type} model: {e}") from None
    # sdpa is what transformers picks on CPU and GPU for these models; the experts use
    # the plain per-expert loop so the result does not depend on grouped-GEMM kernels.
    cfg._attn_implementation = attn
    cfg._experts_implementation = "eager"
    return cfg
