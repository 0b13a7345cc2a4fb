"""Is a `quantization_config` one that kq wrote? (No SGLang import: usable anywhere.)

Two signs, either suffices: an explicit marker key (`kq_version`, ignored by compressed-tensors'
pydantic models, which use extra="ignore") or kq's own shape — a compressed-tensors
pack-quantized config whose `int4_experts` group targets the routed experts with kq's regex.
"""
from __future__ import annotations

from typing import Any

from kq.format import EXPERT_TARGET


def is_kq_quant_config(qc: Any) -> bool:
    if not isinstance(qc, dict):
        return False
    if str(qc.get("quant_method", "")).lower() not in ("compressed-tensors", "compressed_tensors"):
        return False
    if qc.get("kq_version"):
        return True
    group = (qc.get("config_groups") or {}).get("int4_experts") or {}
    return EXPERT_TARGET in (group.get("targets") or []) and qc.get("format") == "pack-quantized"
