"""`KqConfig`: SGLang's compressed-tensors config for kq checkpoints, with kq's MoE method.

A subclass, not a wrapper: SGLang's model code asks `isinstance(quant_config,
CompressedTensorsConfig)` and reads `weight_block_size`, `target_scheme_map`, … (DeepSeek/GLM-5
attention post-processing, the shared-expert fusion rule), so everything but the routed
experts stays exactly SGLang's compressed-tensors behaviour.

Imports SGLang: load only inside an SGLang process (the plugin does).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

from kq.sglang.detect import is_kq_quant_config

NAME = "kq"



class KqConfig(CompressedTensorsConfig):
    # from_config is inherited: CompressedTensorsConfig.from_config builds `cls(...)`.

    def get_name(self) -> str:
        return NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> Optional[str]:
        # Take over kq checkpoints unless the user asked for SGLang's own path explicitly
        # (`--quantization compressed-tensors`) or switched the plugin off.
        if os.environ.get("KQ_SGLANG_DISABLE") == "1":
            return None
        if user_quant not in (None, NAME) or not is_kq_quant_config(hf_quant_cfg):
            return None
        return NAME

    def can_fuse_shared_expert(self) -> bool:
        # kq keeps the shared expert in FP8 and the routed experts in INT4: fusing the shared
        # expert as an extra routed expert would load FP8 tensors into INT4 slots.
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

        if isinstance(layer, FusedMoE):
            args = self._int4_expert_args(layer, prefix)
            if args is not None:
                from kq.sglang.moe import KqMoEMethod

                # No `layer.scheme`: SGLang's loader transposes expert weights only for its own
                # WNA16 scheme classes; kq's method keeps the checkpoint layout.
                layer.scheme = None
                return KqMoEMethod(self, args[0], prefix, activations=args[1])
        return super().get_quant_method(layer, prefix)

    def _int4_expert_args(self, layer, prefix):
        """(the routed experts' weight QuantizationArgs, "none" | "fp8") when they are kq's INT4
        group, W4A16 or W4AFP8 (dynamic FP8 input activations), else None (SGLang's own path).

        W4AFP8 experts stay with kq (its W4A8 kernel at prefill sizes, kq.sglang.moe): SGLang 0.5.23's
        CompressedTensorsW4AFP8MoE reads its INT4 parameters from the config group targeting `Linear`,
        which in a kq checkpoint is the FP8 group (num_bits 8, no group size), and fails building the
        expert weights."""
        from kq.checkpoint.ct_config import is_dynamic_fp8

        self._add_fused_moe_to_target_scheme_map()
        scheme = self.get_scheme_dict(layer, prefix + ".0.gate_proj")
        if not scheme:
            return None
        wq, aq = scheme.get("weights"), scheme.get("input_activations")
        if wq is None or (aq is not None and not is_dynamic_fp8(aq)):
            return None
        if (wq.num_bits, str(getattr(wq.type, "value", wq.type))) != (4, "int"):
            return None
        if not wq.symmetric or str(getattr(wq.strategy, "value", wq.strategy)) != "group" or wq.actorder:
            raise ValueError(f"kq: {prefix}: INT4 experts must be symmetric group-wise without actorder "
                             f"(got {wq}); serve this checkpoint with --quantization compressed-tensors")
        return wq, ("fp8" if aq is not None else "none")
