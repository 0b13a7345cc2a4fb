"""Load a kq checkpoint's FP8 KV-cache scales with SGLang 0.5.23's own code (run in the side venv).

    python check_kv_scales.py FOLDER --out result.json

SGLang's CompressedTensorsConfig is built from the folder's quantization_config; for every layer a
real RadixAttention is constructed as DeepseekV2AttentionMLA builds its `attn_mqa` (prefix
`model.layers.L.self_attn.attn_mqa`, the config passed in), which asks the config for its quant
method (CompressedTensorsKVCacheMethod -> BaseKVCacheMethod.create_weights). Each tensor of the
checkpoint is then loaded into the parameter of that full name with the parameter's weight_loader
(SGLang's default_weight_loader otherwise) and process_weights_after_loading runs, as the model
loader does; the result lists the k_scale_float/v_scale_float SGLang would attend with.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    from safetensors.torch import load_file
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    folder = Path(args.folder)
    cfg = json.loads((folder / "config.json").read_text())
    qc = CompressedTensorsConfig.from_config(cfg["quantization_config"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted({f for n, f in index.items() if n.endswith(("k_scale", "v_scale"))})
    tensors = {}
    for f in files:
        tensors.update(load_file(str(folder / f)))
    res = {"kv_cache_quant_algo": qc.kv_cache_quant_algo, "layers": {}}
    n_layers = cfg["num_hidden_layers"]
    head = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    for i in range(n_layers):
        prefix = f"model.layers.{i}.self_attn"
        attn = RadixAttention(cfg["num_attention_heads"], head, 1.0, num_kv_heads=1, layer_id=i,
                              v_head_dim=cfg["kv_lora_rank"], quant_config=qc, prefix=f"{prefix}.attn_mqa")
        params = {f"{prefix}.attn_mqa.{k}": p for k, p in attn.named_parameters()}
        loaded = []
        for name, t in tensors.items():
            if name in params:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, t)
                loaded.append(name)
        attn.quant_method.process_weights_after_loading(attn)
        res["layers"][str(i)] = {"method": type(attn.quant_method).__name__, "loaded": sorted(loaded),
                                 "k_scale_float": attn.k_scale_float, "v_scale_float": attn.v_scale_float}
    res["unused"] = sorted(set(tensors) - {n for v in res["layers"].values() for n in v["loaded"]})
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
