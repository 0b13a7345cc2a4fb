"""kq's fused-MoE method for SGLang 0.5.23: INT4 routed experts on kq's W4A16 kernels.

Follows SGLang's MoE method interface (`FusedMoEMethodBase`): `create_weights` registers
parameters in the *checkpoint* layout, so SGLang's own `FusedMoE.weight_loader` fills them
per expert and per TP rank (gate/up split along the intermediate rows, down along its packed
input columns, scales with them) and honours expert parallelism's local-expert map;
`process_weights_after_loading` runs kq's prepack (or reads `kq shard` per-rank files, which hold
the tiles layout) in the layout kq.kernels.moe_lane_layout chooses (the lane layout on Hopper: the
CUDA lane kernel; rank files are converted on the device);
`apply` takes SGLang's dispatch output and returns its combine input.

SGLang transposes expert weights on load only for its own WNA16 class names; this class is
not one of them, which is what keeps the checkpoint layout.
"""
from __future__ import annotations

import logging

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from kq.kernels import fused_moe_w4a16, moe_lane_layout, prepack_moe
from kq.kernels.layout import lane_from_tiles
from kq.sglang import rank_loader


log = logging.getLogger(__name__)
_warned_fp8 = False


class KqMoEMethod(FusedMoEMethodBase):
    # What the experts compute, whatever the checkpoint asks for: kq's W4A16 kernels (BF16
    # activations). A W4AFP8 checkpoint (activations "fp8") is served with the same math until
    # kq has a W4A8 kernel; it is logged once at load so no server claims FP8 activations.
    compute = "w4a16"

    def __init__(self, quant_config, weight_quant, prefix: str, activations: str = "none"):
        global _warned_fp8
        self.quant_config = quant_config
        self.group = int(weight_quant.group_size)
        self.prefix = prefix
        self.activations = activations  # what the checkpoint's INT4 group asks for
        if activations == "fp8" and self.compute == "w4a16" and not _warned_fp8:
            _warned_fp8 = True
            log.warning("kq: this checkpoint's experts ask for dynamic FP8 activations (W4AFP8); kq serves "
                        "them with its W4A16 kernels (BF16 activations, same weights): prefill is W4A16 math")
        self.runner = None
        self.moe_runner_config = None

    # ---- weights -------------------------------------------------------------------------
    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        E, H, I, g = num_experts, hidden_size, intermediate_size_per_partition, self.group
        tp = getattr(layer, "moe_tp_size", 1)
        # What `kq inspect --tp` refuses, refused again at load time with the same rule.
        if I % g or H % g or I % 8:
            raise ValueError(f"kq: {self.prefix}: expert intermediate size per rank {I} (TP {tp}) and hidden "
                             f"{H} must be multiples of the group size {g}; requantize with a group size "
                             f"dividing {I} or serve at a smaller TP")
        attrs = {k: v for k, v in extra_weight_attrs.items() if k == "weight_loader"}
        attrs["is_transposed"] = False
        params = {
            # name: (shape, dtype, scale?)  — checkpoint layout [out, in/8] / [out, in/g] per expert
            "w13_weight_packed": ((E, 2 * I, H // 8), torch.int32),
            "w2_weight_packed": ((E, H, I // 8), torch.int32),
            "w13_weight_scale": ((E, 2 * I, H // g), torch.bfloat16),
            "w2_weight_scale": ((E, H, I // g), torch.bfloat16),
            "w13_weight_shape": ((E, 2), torch.int64),
            "w2_weight_shape": ((E, 2), torch.int64),
        }
        for name, (shape, dtype) in params.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            # "group": SGLang's loader then shards scales exactly like the packed weights.
            set_weight_attrs(p, {**attrs, "quant_method": "group"})
        layer.kq_moe = None
        layer.kq_rank_files = rank_loader.find_for_layer(layer, self.prefix, self.group)

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "kq_moe", None) is not None:
            return
        if layer.kq_rank_files is not None:
            pp = rank_loader.load_prepacked(layer.kq_rank_files, device=layer.w13_weight_packed.device)
            if moe_lane_layout(pp.w13_q.device, pp.hidden, pp.intermediate):
                pp = lane_from_tiles(pp)      # rank files hold the tiles layout
        else:
            w13 = layer.w13_weight_packed.data
            lane = moe_lane_layout(w13.device, w13.shape[2] * 8, w13.shape[1] // 2)
            pp = prepack_moe(w13, layer.w13_weight_scale.data, layer.w2_weight_packed.data,
                             layer.w2_weight_scale.data, self.group, lane=lane)
        layer.kq_moe = pp
        # The checkpoint-layout copies are no longer needed: free them, keep the names.
        for name in ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale"):
            getattr(layer, name).data = torch.empty(0, dtype=getattr(layer, name).dtype,
                                                    device=getattr(layer, name).device)

    # ---- runner --------------------------------------------------------------------------
    def create_moe_runner(self, layer, moe_runner_config) -> None:
        if moe_runner_config.activation != "silu" or not moe_runner_config.is_gated:
            raise ValueError(f"kq: {self.prefix}: only gated SiLU experts are supported")
        if moe_runner_config.swiglu_limit is not None or moe_runner_config.gemm1_clamp_limit is not None:
            raise ValueError(f"kq: {self.prefix}: clamped SwiGLU is not supported")
        self.moe_runner_config = moe_runner_config
        self.runner = None  # direct kernel: standard top-k, local expert ids (SGLang's contract for None)

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        x = dispatch_output.hidden_states
        topk_weights, topk_ids = dispatch_output.topk_output[0], dispatch_output.topk_output[1]
        rsf = self.moe_runner_config.routed_scaling_factor
        # SGLang's standard dispatcher hands local expert ids, -1 for experts on other EP ranks;
        # kq's kernels skip -1 themselves (routing table and combine), so no expert map is needed.
        out = fused_moe_w4a16(x, layer.kq_moe, topk_weights.float(), topk_ids.to(torch.int32),
                              routed_scaling_factor=1.0 if rsf is None else float(rsf))
        return StandardCombineInput(hidden_states=out)

    apply_weights = apply  # the scheme-level name used by SGLang's compressed-tensors schemes
