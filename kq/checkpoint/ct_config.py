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
- `--activations fp8`: the INT4 group also carries compressed-tensors' own W4AFP8 input
  activations (8-bit float, dynamic, per token), which is what makes SGLang pick
  `CompressedTensorsW4AFP8MoE` for the experts; the weight bytes are the same either way
  (docs/w4afp8.md);
- `ignore`: every Linear kept in BF16 (lm_head, routers, DSA weights_proj, MTP eh_proj),
  by exact name and by suffix regex (SGLang's MTP draft model renames layers).
"""
from __future__ import annotations

import json

from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

from kq.errors import KqError

from kq.format import EXPERT_TARGET  # noqa: E402  (kq.checkpoint.ct_config's API)
# BF16 Linear modules by suffix: routers, DSA indexer weights_proj, MTP projections.
BF16_SUFFIX_TARGETS = (r"re:.*mlp\.gate$", r"re:.*indexer\.weights_proj$", r"re:.*eh_proj$",
                       r"re:.*shared_head\.head$")
ACTIVATIONS = ("none", "fp8")
INT4_GROUP = "int4_experts"
# SGLang 0.5.23's W4AFP8 MoE kernel (CUTLASS, cutlass_w4a8_moe) is built for group 128 only.
FP8_ACTIVATION_GROUP = 128


def check_activations(activations: str, group_size: int | None) -> None:
    """Refuse, in one line, an --activations value kq cannot write for this group size."""
    if activations not in ACTIVATIONS:
        raise KqError(f"--activations {activations}: use none (W4A16) or fp8 (W4AFP8)")
    if activations == "fp8" and group_size != FP8_ACTIVATION_GROUP:
        raise KqError(f"--activations fp8 needs INT4 group size {FP8_ACTIVATION_GROUP} (SGLang's W4AFP8 MoE "
                      f"kernel supports group 128 only), not group {group_size}: quantize with --group-size 128")


def fp8_activation_args() -> QuantizationArgs:
    """compressed-tensors' own W4AFP8 preset activations: 8-bit float, dynamic, per token."""
    return PRESET_SCHEMES["W4AFP8"]["input_activations"].model_copy()


def is_dynamic_fp8(args) -> bool:
    """Are these input-activation args (a dict from config.json or a QuantizationArgs) dynamic
    8-bit float? The fields SGLang 0.5.23's `_is_wint4afp8` reads (it ignores the strategy)."""
    if args is None:
        return False
    get = args.get if isinstance(args, dict) else (lambda k, d=None: getattr(args, k, d))
    kind = get("type")
    return (get("num_bits") == 8 and str(getattr(kind, "value", kind)) == "float"
            and bool(get("dynamic")) is True)


def experts_fp8_activations(quantization_config: dict | None) -> bool:
    """Does this checkpoint's INT4 expert group ask for dynamic FP8 input activations (W4AFP8)?

    False for W4A16 (no input_activations); refuses (KqError) any other activation scheme on
    the INT4 group, so a caller never serves one it does not implement as W4A16 or W4AFP8."""
    group = _int4_group(quantization_config or {})
    if group is None:
        return False
    act = group.get("input_activations")
    if act is None:
        return False
    if is_dynamic_fp8(act):
        return True
    raise KqError(f"the INT4 expert group's input_activations {act} are neither absent (W4A16) nor dynamic "
                  "8-bit float (W4AFP8)")


def _int4_group(qc: dict) -> dict | None:
    groups = qc.get("config_groups") or {}
    if INT4_GROUP in groups:
        return groups[INT4_GROUP]
    int4 = [g for g in groups.values() if (g.get("weights") or {}).get("num_bits") == 4]
    return int4[0] if len(int4) == 1 else None


def with_activations(quantization_config: dict, activations: str) -> dict:
    """A kq quantization_config with the INT4 group's input activations set to ACTIVATIONS
    (everything else unchanged, as compressed-tensors reads it), validated again by compressed-tensors' models."""
    qc = json.loads(json.dumps(quantization_config))
    group = _int4_group(qc)
    if group is None:
        raise KqError("config.json: no single INT4 config group to set activations on")
    check_activations(activations, (group.get("weights") or {}).get("group_size"))
    group.pop("input_activations", None)
    if activations == "fp8":
        group["input_activations"] = fp8_activation_args().model_dump(exclude_none=True)
    # Through compressed-tensors' model again: validated, and in the key order kq quantize writes.
    return _drop_empty(QuantizationConfig.model_validate(qc).model_dump(exclude_none=True))


def expert_target(mtp_layer: int | None = None) -> str:
    """The INT4 group's regex. With the MTP layer kept (--keep-mtp) it must match neither that layer's
    checkpoint names (`model.layers.<mtp>.mlp.experts.E.*`) nor the names SGLang's draft model gives it
    (`model.decoder.mlp.experts.E.*`, no `layers.` in them): those experts then fall into the FP8 group."""
    if mtp_layer is None:
        return EXPERT_TARGET
    return rf"re:.*layers\.(?!{mtp_layer}\.)\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$"


def build_quantization_config(source_config: dict, *, group_size: int, source_format: str,
                              bf16_linears: list[str], has_fp8: bool, activations: str = "none",
                              mtp_layer: int | None = None) -> dict:
    check_activations(activations, group_size)
    groups = {
        INT4_GROUP: QuantizationScheme(
            targets=[expert_target(mtp_layer)],
            weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                     group_size=group_size, dynamic=False),
            input_activations=fp8_activation_args() if activations == "fp8" else None,
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
