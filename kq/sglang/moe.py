"""kq's fused-MoE method for SGLang 0.5.23: INT4 routed experts on kq's W4A16 kernels.

Follows SGLang's MoE method interface (`FusedMoEMethodBase`): `create_weights` registers
parameters in the *checkpoint* layout, so SGLang's own `FusedMoE.weight_loader` fills them
per expert and per TP rank (gate/up split along the intermediate rows, down along its packed
input columns, scales with them) and honours expert parallelism's local-expert map;
`process_weights_after_loading` runs kq's prepack in the layout kq.kernels.moe_lane_layout chooses
(the lane layout on Hopper: the CUDA lane kernel) on those parameters, which `kq shard` per-rank files,
when there are some, fill instead of the full checkpoint (they hold the same checkpoint-layout slices:
one conversion path);
`apply` takes SGLang's dispatch output and returns its combine input.

When the checkpoint's INT4 group says dynamic FP8 activations (`fp8_activations`), a step of at least
W4A8_MIN_TOKENS tokens runs kq's W4A8 kernel (kq.kernels.w4a8: FP8 tensor cores, per-token FP8
activations; Hopper, lane layout, group 128) on the same weights; smaller steps (decode) keep the W4A16
kernels unchanged.

SGLang transposes expert weights on load only for its own WNA16 class names; this class is
not one of them, which is what keeps the checkpoint layout.
"""
from __future__ import annotations

import logging
import os

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from kq.kernels import fused_moe_w4a16, moe_lane_layout, prepack_moe, w4a8
from kq.sglang import rank_loader


log = logging.getLogger(__name__)


def w4a8_min_tokens() -> int:
    """Tokens from which a step of an FP8-activation checkpoint runs the W4A8 kernel: KQ_W4A8_MIN_TOKENS,
    default the H200 crossover against the W4A16 lane kernel (benchmarks/w4a8_bench.py)."""
    return int(os.environ.get("KQ_W4A8_MIN_TOKENS", W4A8_MIN_TOKENS))


# H200, GLM-5.2 experts, top-8 (benchmarks/results/h200/w4a8_call3_d34df76.jsonl): W4A8 against the W4A16 lane
# kernel 0.40x at 256 tokens, 0.81x at 512, 1.71x at 1024, 2.3-2.8x at 2048-4096 (the Triton W4A8 kernel; the
# register-operand kernel that replaced it is 3.7x the lane kernel at 2048 tokens (w4a8_62efaa9.jsonl), so the
# crossover should have moved down: not re-measured)
W4A8_MIN_TOKENS = 1024


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    key = message.split(": ", 2)[-1]  # the same condition on every layer: one line per process
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


class KqMoEMethod(FusedMoEMethodBase):
    def __init__(self, quant_config, weight_quant, prefix: str, activations: str = "none"):
        self.quant_config = quant_config
        self.group = int(weight_quant.group_size)
        self.prefix = prefix
        self.activations = activations  # what the checkpoint's INT4 group asks for: "none" | "fp8"
        self.fp8_activations = activations == "fp8"
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
            # The rank file holds the slices SGLang's loader would have taken from the checkpoint.
            rank_loader.fill_params(layer, layer.kq_rank_files)
        w13 = layer.w13_weight_packed.data
        lane = moe_lane_layout(w13.device, w13.shape[2] * 8, w13.shape[1] // 2)
        pp = prepack_moe(w13, layer.w13_weight_scale.data, layer.w2_weight_packed.data,
                         layer.w2_weight_scale.data, self.group, lane=lane)
        layer.kq_moe = pp
        # The W4A8 kernel's view of the group scales (1/32 of the INT4 weights' bytes), where it can run.
        layer.kq_w4a8_scales = (w4a8.block_scales(pp) if self.fp8_activations and w4a8.serves(pp, pp.w13_q.device)
                                else None)
        if self.fp8_activations and layer.kq_w4a8_scales is None:
            _warn_once(f"kq: {self.prefix}: the checkpoint asks for FP8 expert activations but kq's W4A8 kernel "
                       "does not serve this layer here (it needs Hopper, the lane layout and group 128): its "
                       "experts compute W4A16 (BF16 activations, same weights) at every size")
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
        rsf = 1.0 if rsf is None else float(rsf)
        if self.uses_w4a8(layer, x.shape[0]):
            out = w4a8.fused_moe_w4a8(x, layer.kq_moe, topk_weights.float(), topk_ids.to(torch.int32),
                                      scales=layer.kq_w4a8_scales, routed_scaling_factor=rsf)
        else:
            out = fused_moe_w4a16(x, layer.kq_moe, topk_weights.float(), topk_ids.to(torch.int32),
                                  routed_scaling_factor=rsf)
        return StandardCombineInput(hidden_states=out)

    @property
    def compute(self) -> str:
        """What the experts compute: W4A16 for a weight-only checkpoint; for an FP8-activation one, W4A8
        from w4a8_min_tokens() tokens a step where the kernel serves the layer (uses_w4a8), W4A16 below."""
        return f"w4a8 from {w4a8_min_tokens()} tokens, w4a16 below" if self.fp8_activations else "w4a16"

    def uses_w4a8(self, layer, num_tokens: int) -> bool:
        """FP8-activation checkpoint, a layer the W4A8 kernel serves (scales made at load), a prefill-sized
        step."""
        return (self.fp8_activations and getattr(layer, "kq_w4a8_scales", None) is not None
                and num_tokens >= w4a8_min_tokens())

    apply_weights = apply  # the scheme-level name used by SGLang's compressed-tensors schemes
