"""The `quantization_config` kq writes into config.json, built from compressed-tensors'
own pydantic models (so the library validates it) and shaped for SGLang 0.5.23:

- top-level `format: pack-quantized` (SGLang's WNA16 MoE path refuses `mixed-precision`);
- group `int4_experts`: the routed experts by name regex, INT4 symmetric group-wise,
  per-group format pack-quantized; a name match wins over a class match in both
  SGLang and compressed-tensors, so the experts never fall into the FP8 group;
- group `fp8`: targets the class `Linear`, because SGLang reads `weight_block_size` and
  the DeepSeek/GLM-5 attention post-processing from the group that targets Linear.
  Block strategy with the source's block for DeepSeek-style sources, channel strategy
  for GLM-4.x's per-channel FP8; dynamic FP8 activations as the source serves them;
- `ignore`: every Linear kept in BF16 (lm_head, routers, DSA weights_proj, MTP eh_proj),
  by exact name and by suffix regex (SGLang's MTP draft model renames layers).
"""
from __future__ import annotations

from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

# Matches `…layers.L.mlp.experts.E.gate_proj` (checkpoint names and SGLang's per-expert
# names, with or without a `language_model.` or draft-model prefix).
EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
# BF16 Linear modules by suffix: routers, DSA indexer weights_proj, MTP projections.
BF16_SUFFIX_TARGETS = (r"re:.*mlp\.gate$", r"re:.*indexer\.weights_proj$", r"re:.*eh_proj$",
                       r"re:.*shared_head\.head$")


def expert_target(mtp_layer: int | None = None) -> str:
    """The INT4 group's regex. With the MTP layer kept (--keep-mtp) it must match neither that layer's
    checkpoint names (`model.layers.<mtp>.mlp.experts.E.*`) nor the names SGLang's draft model gives it
    (`model.decoder.mlp.experts.E.*`, no `layers.` in them): those experts then fall into the FP8 group."""
    if mtp_layer is None:
        return EXPERT_TARGET
    return rf"re:.*layers\.(?!{mtp_layer}\.)\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$"


def build_quantization_config(source_config: dict, *, group_size: int, source_format: str,
                              bf16_linears: list[str], has_fp8: bool, mtp_layer: int | None = None) -> dict:
    groups = {
        "int4_experts": QuantizationScheme(
            targets=[expert_target(mtp_layer)],
            weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                     group_size=group_size, dynamic=False),
            format="pack-quantized"),
    }
    if has_fp8:
        groups["fp8"] = _fp8_scheme(source_config, source_format)
    ignore = sorted(set(bf16_linears)) + list(BF16_SUFFIX_TARGETS)
    if source_format == "fp8_channel":
        # GLM-4.x's own ignore list (lm_head, routers, …) stays authoritative.
        ignore = sorted(set((source_config.get("quantization_config") or {}).get("ignore", [])) | set(ignore))
    cfg = QuantizationConfig(config_groups=groups, quant_method="compressed-tensors",
                             format="pack-quantized", quantization_status="compressed", ignore=ignore)
    return _drop_empty(cfg.model_dump(exclude_none=True))


def _drop_empty(d):
    # Older compressed-tensors (0.18, SGLang's pin) knows fewer fields: write only what is set.
    if isinstance(d, dict):
        return {k: _drop_empty(v) for k, v in d.items() if v is not None and v != {}}
    if isinstance(d, list):
        return [_drop_empty(v) for v in d]
    return d


def _fp8_scheme(source_config: dict, source_format: str) -> QuantizationScheme:
    qc = source_config.get("quantization_config") or {}
    if source_format == "fp8_channel":
        # Keep the source's own FP8 group (per-channel weights, per-token activations).
        for g in (qc.get("config_groups") or {}).values():
            if "Linear" in g.get("targets", []):
                s = QuantizationScheme.model_validate({**g, "format": "float-quantized"})
                return s
        return QuantizationScheme(
            targets=["Linear"], format="float-quantized",
            weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel", dynamic=False),
            input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True))
    block = list(qc.get("weight_block_size") or [128, 128])
    return QuantizationScheme(
        targets=["Linear"], format="float-quantized",
        weights=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                                 block_structure=block, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                                           group_size=block[1], dynamic=True))
