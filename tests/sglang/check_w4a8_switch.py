"""kq's SGLang MoE method on an FP8-activation checkpoint, in SGLang 0.5.23 on the CPU (run in the side
venv by test_w4a8_switch.py).

    python check_w4a8_switch.py KQ_CHECKPOINT --out result.json

SGLang's FusedMoE layer built with kq's config (the checkpoint's INT4 group says dynamic FP8 input
activations), filled by its own weight loader, then kq's apply() at a step below and at one above the
W4A8 threshold. On the CPU the W4A8 kernel cannot run, so the GPU's load-time step (the scales the kernel
reads) is done here by hand; fused_moe_w4a8 on CPU tensors is its torch reference. Writes verdicts only.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_plugin import _build_layer, _expert_tensors, _load  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    os.environ["KQ_MOE_LAYOUT"] = "lane"          # what the GPU loader picks on Hopper
    os.environ["KQ_W4A8_MIN_TOKENS"] = "6"

    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    import sglang.srt.layers.moe.fused_moe_triton.layer as fl
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    from kq.kernels import fused_moe_w4a16, w4a8
    from compressed_tensors.quantization import QuantizationArgs

    from kq.checkpoint.ct_config import is_dynamic_fp8
    from kq.sglang.config import KqConfig

    qa = {"fp8_dynamic_token": dict(num_bits=8, type="float", strategy="token", dynamic=True),
          "fp8_dynamic_group": dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
          "fp8_static": dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
          "int8_dynamic": dict(num_bits=8, type="int", strategy="token", dynamic=True)}
    predicate = {k: is_dynamic_fp8(QuantizationArgs(**v)) for k, v in qa.items()}
    predicate["none"] = is_dynamic_fp8(None)
    load_plugins()
    publish(ServerArgs(model_path=args.folder, tp_size=1, device="cpu"), role="scheduler")
    fl._is_cpu = False
    cfg = json.loads((Path(args.folder) / "config.json").read_text())
    qc = KqConfig.from_config(cfg["quantization_config"])
    prefix = "model.layers.1.mlp.experts"
    tensors, _ = _expert_tensors(args.folder, prefix)
    e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    layer = _build_layer(qc, prefix, e, h, i, 1, 1, 0, 0, 1.0)
    method = layer.quant_method
    res = {"predicate": predicate, "method": type(method).__name__, "fp8_activations": getattr(method, "fp8_activations", None)}
    _load(layer, tensors, prefix, e)
    method.process_weights_after_loading(layer)
    res["lane"] = layer.kq_moe.lane
    res["scales_on_cpu"] = layer.kq_w4a8_scales is not None
    layer.kq_w4a8_scales = w4a8.block_scales(layer.kq_moe)      # the GPU's load-time step
    torch.manual_seed(0)
    for name, t in (("below", 5), ("above", 6)):
        x = torch.randn(t, h).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e)[:2] for _ in range(t)]).to(torch.int32)
        tw = torch.rand(t, 2)
        disp = StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                      topk_output=StandardTopKOutput(tw, ids, None))
        got = method.apply(layer, disp).hidden_states.double()
        a16 = fused_moe_w4a16(x, layer.kq_moe, tw, ids).double()
        a8 = w4a8.reference(x, layer.kq_moe, tw, ids).double()
        res[name] = {"uses_w4a8": method.uses_w4a8(layer, t),
                     "err_vs_w4a16": ((got - a16).norm() / a16.norm()).item(),
                     "err_vs_w4a8_reference": ((got - a8).norm() / a8.norm()).item(),
                     "w4a8_vs_w4a16": ((a8 - a16).norm() / a16.norm()).item()}
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
