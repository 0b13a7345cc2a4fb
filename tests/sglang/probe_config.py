"""Ask SGLang 0.5.23 itself how it would load a checkpoint folder's quantization config.

Runs inside the sglang side venv (.ci/sglang-venv.sh), never in kq's main venv:

    python probe_config.py FOLDER... --out result.json [--jobs jobs.json] [--plugins]

It goes through SGLang's own code, the path the server's model loader takes:
ServerArgs -> publish -> ModelConfig (main model and MTP draft) -> model class from SGLang's
registry -> `_get_quantization_config` (builds the CompressedTensorsConfig from config.json with
the model class's packed-module mapping and weight-name mapper) -> `get_quant_method(layer,
prefix)` for every module name SGLang gives the model's layers -> `resolve_shared_experts_config`,
the decision the loader makes before building the model.

What is simulated, and why:
- the GPU: `torch.cuda.get_device_capability` answers (9, 0) (H100/H200), and the model modules'
  import-time `_is_cuda` flag reads True while the fusion decision is asked (SGLang computes it
  at import; it is False on this CPU machine, True on the serving machine). ServerArgs gets
  device="cpu" only so that argument resolution does not look for an accelerator.
- the modules: layers are bare instances of SGLang's own classes (no weights allocated); module
  names and classes follow SGLang's model code (deepseek_v2.py, deepseek_nextn.py,
  glm4_moe.py, glm4_moe_nextn.py, layers/attention/dsa/dsa_indexer.py). Modules that SGLang
  builds without a quant_config (MoE router gate, DSA indexer weights_proj, MTP eh_proj) are
  reported as such, and the config is still asked about them ("config_says").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from pathlib import Path


def _simulate_hopper() -> None:
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def _bare(cls):
    """An instance of SGLang's layer class without running its constructor (no weights, no
    process groups): all scheme selection looks at is the class and the prefix."""
    import torch

    inst = cls.__new__(cls)
    torch.nn.Module.__init__(inst)
    return inst


def _module_table(hf_config, draft: bool):
    """(prefix, SGLang class name, built with quant_config?) for every quantizable module."""
    arch = hf_config.architectures[0]
    glm4 = arch.startswith("Glm4Moe")
    n_layers = hf_config.num_hidden_layers
    first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    freq = getattr(hf_config, "moe_layer_freq", 1) or 1
    indexer_types = getattr(hf_config, "indexer_types", None)
    dsa = getattr(hf_config, "index_topk", None) is not None and not glm4

    rows = []
    if draft:
        layers = [("model.decoder", n_layers, True)]  # draft decoder: always a MoE layer
        rows.append(("model.eh_proj", "nn.Linear", False))
        rows.append(("model.shared_head.head", "ParallelLMHead", True))
    else:
        layers = [
            (f"model.layers.{i}", i, i >= first_dense and i % freq == 0) for i in range(n_layers)
        ]
        rows.append(("lm_head", "ParallelLMHead", True))

    for p, idx, is_moe in layers:
        a = f"{p}.self_attn"
        if glm4:
            rows += [(f"{a}.qkv_proj", "QKVParallelLinear", True), (f"{a}.o_proj", "RowParallelLinear", True)]
        else:
            if hf_config.q_lora_rank is not None:
                rows += [
                    (f"{a}.fused_qkv_a_proj_with_mqa", "ReplicatedLinear", True),
                    (f"{a}.q_b_proj", "ColumnParallelLinear", True),
                ]
            else:
                rows += [
                    (f"{a}.q_proj", "ColumnParallelLinear", True),
                    (f"{a}.kv_a_proj_with_mqa", "ReplicatedLinear", True),
                ]
            rows += [(f"{a}.kv_b_proj", "ColumnParallelLinear", True), (f"{a}.o_proj", "RowParallelLinear", True)]
            has_indexer = dsa and (
                indexer_types is None or idx >= len(indexer_types) or indexer_types[idx] != "shared"
            )
            if has_indexer:
                rows += [
                    (f"{a}.indexer.wq_b", "ReplicatedLinear", True),
                    (f"{a}.indexer.wk", "ReplicatedLinear", True),
                    (f"{a}.indexer.weights_proj", "ReplicatedLinear", False),
                ]
        m = f"{p}.mlp"
        if is_moe:
            rows += [
                (f"{m}.experts", "FusedMoE", True),
                (f"{m}.gate", "MoEGate", False),
            ]
            if (getattr(hf_config, "n_shared_experts", 0) or 0) > 0:
                rows += [
                    (f"{m}.shared_experts.gate_up_proj", "MergedColumnParallelLinear", True),
                    (f"{m}.shared_experts.down_proj", "RowParallelLinear", True),
                ]
        else:
            rows += [
                (f"{m}.gate_up_proj", "MergedColumnParallelLinear", True),
                (f"{m}.down_proj", "RowParallelLinear", True),
            ]
    return rows


def _layer_classes():
    from sglang.srt.layers import linear
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    classes = {
        n: getattr(linear, n)
        for n in (
            "ReplicatedLinear",
            "ColumnParallelLinear",
            "RowParallelLinear",
            "MergedColumnParallelLinear",
            "QKVParallelLinear",
        )
    }
    classes["FusedMoE"] = FusedMoE
    classes["ParallelLMHead"] = ParallelLMHead
    # Not LinearBase: SGLang never asks the quant config for these; asked as a
    # ReplicatedLinear they show what the config's ignore list says.
    classes["MoEGate"] = linear.ReplicatedLinear
    classes["nn.Linear"] = linear.ReplicatedLinear
    return classes


def _args(a) -> dict | None:
    if a is None:
        return None
    return {k: (str(getattr(v, "value", v)) if k in ("type", "strategy") else v)
            for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")
            if (v := getattr(a, k, None)) is not None or k == "group_size"}


def _describe(method, layer) -> dict:
    out = {"method": type(method).__name__ if method is not None else None}
    if hasattr(method, "activations"):  # kq's MoE method: what its experts compute
        out["kq_activations"] = method.activations
        out["kq_compute"] = getattr(method, "compute", None)
    scheme = getattr(layer, "scheme", None)
    if scheme is None:
        out["scheme"] = None
        return out
    out["scheme"] = type(scheme).__name__
    wq = getattr(scheme, "weight_quant", None)
    if wq is not None:
        out["strategy"] = str(getattr(wq.strategy, "value", wq.strategy))
        out["block_structure"] = wq.block_structure
        out["num_bits"] = wq.num_bits
    for attr in ("num_bits", "group_size", "strategy"):
        if attr not in out and hasattr(scheme, attr):
            v = getattr(scheme, attr)
            out[attr] = str(getattr(v, "value", v)) if attr == "strategy" else v
    if hasattr(scheme, "weight_quant"):
        out["weight_quant"] = _args(scheme.weight_quant)
    if hasattr(scheme, "input_quant"):
        out["input_quant"] = _args(scheme.input_quant)
    # What the scheme object itself will build weights with (its own attributes, which may
    # come from another config group than the one that matched: W4AFP8MoE reads "Linear"'s).
    out["scheme_attrs"] = {a: getattr(scheme, a) for a in ("num_bits", "group_size", "packed_factor")
                           if isinstance(getattr(scheme, a, None), (int, type(None))) and hasattr(scheme, a)}
    return out


def _try_create_moe_weights(layer, hf_config, tp: int) -> dict:
    """Run the MoE scheme's own create_weights on the bare layer with the model's sizes (CPU
    tensors, nothing loaded): the parameters SGLang would fill from the checkpoint, or the error."""
    import torch

    E = getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_local_experts")
    H, I = hf_config.hidden_size, hf_config.moe_intermediate_size // tp
    try:
        layer.scheme.create_weights(layer, num_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                                    params_dtype=torch.bfloat16)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {n: [list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in layer.named_parameters()}


def _probe_model(sa, draft: bool, create_weights: bool = False) -> dict:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.utils import resolve_shared_experts_config
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.model_loader.utils import get_model_architecture

    mc = ModelConfig.from_server_args(sa, is_draft_model=draft)
    model_class, arch = get_model_architecture(mc)
    qc = _get_quantization_config(mc, LoadConfig())
    res = {
        "model_class": model_class.__name__,
        "quantization": mc.quantization,
        "quant_config_class": type(qc).__name__ if qc is not None else None,
        "weight_block_size": getattr(qc, "weight_block_size", None),
        "modules": {},
    }
    classes = _layer_classes()
    for prefix, cls_name, passes_qc in _module_table(mc.hf_config, draft):
        layer = _bare(classes[cls_name])
        try:
            method = qc.get_quant_method(layer, prefix) if qc is not None else None
            row = _describe(method, layer)
            if create_weights and cls_name == "FusedMoE" and getattr(layer, "scheme", None) is not None:
                row["create_weights"] = _try_create_moe_weights(layer, mc.hf_config, sa.tp_size)
        except Exception as e:  # a config SGLang refuses: report it, the test decides
            row = {"error": f"{type(e).__name__}: {e}"}
        row["class"] = cls_name
        if not passes_qc:
            row = {"class": cls_name, "method": "built without quant_config", "config_says": row}
        res["modules"][prefix] = row

    # The loader's shared-expert fusion decision (_initialize_model), with the GPU simulated.
    mods = {sys.modules[c.__module__] for c in model_class.__mro__ if c.__module__ in sys.modules}
    with contextlib.ExitStack() as stack:
        for m in mods:
            if hasattr(m, "_is_cuda"):
                stack.enter_context(_patched(m, "_is_cuda", True))
        se = resolve_shared_experts_config(model_class, mc.hf_config, qc)
        reason = None
        gate = getattr(model_class, "shared_experts_fusion_disable_reason", None)
        if gate is not None:
            reason = gate(mc.hf_config, qc)
    res["shared_experts"] = {
        "fusion_disabled": bool(se.fusion_disabled),
        "num_fused_shared_experts": int(se.num_fused_shared_experts),
        "reason": reason,
        "can_fuse_shared_expert_hook": (
            qc.can_fuse_shared_expert() if hasattr(qc, "can_fuse_shared_expert") else None
        ),
    }
    return res


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _probe_job(job: dict) -> dict:
    import compressed_tensors
    import sglang
    from compressed_tensors.quantization import QuantizationConfig
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    folder = job["folder"]
    sa = ServerArgs(
        model_path=folder,
        tp_size=job.get("tp", 8),
        device="cpu",
        quantization=job.get("quantization"),
        disable_shared_experts_fusion=job.get("disable_shared_experts_fusion", False),
    )
    # Last publish wins (SGLang's own rule), so one process can probe several folders.
    publish(sa, role="scheduler")

    cfg = json.loads((Path(folder) / "config.json").read_text())
    qcfg = cfg.get("quantization_config") or {}
    result = {
        "job": job,
        "sglang": sglang.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "main": _probe_model(sa, draft=False, create_weights=job.get("create_weights", False)),
    }
    # SGLang's pin of compressed-tensors reads the config back unchanged.
    try:
        parsed = QuantizationConfig.model_validate(qcfg)
        again = QuantizationConfig.model_validate(json.loads(json.dumps(parsed.model_dump())))
        result["ct_roundtrip"] = again == parsed
    except Exception as e:
        result["ct_roundtrip"] = f"{type(e).__name__}: {e}"
    if (cfg.get("num_nextn_predict_layers") or 0) > 0:
        result["draft"] = _probe_model(sa, draft=True, create_weights=job.get("create_weights", False))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", help="checkpoint folders (default options)")
    ap.add_argument("--jobs", help="JSON file: a list of {folder, tp, disable_shared_experts_fusion, quantization, "
                    "create_weights (run the MoE schemes' create_weights with the model's sizes)}")
    ap.add_argument("--out", required=True, help="where to write the JSON list of results")
    ap.add_argument("--plugins", action="store_true", help="load the sglang.srt.plugins entry points first, "
                    "as every SGLang process does")
    args = ap.parse_args(argv)
    jobs = [{"folder": f} for f in args.folders]
    if args.jobs:
        jobs += json.loads(Path(args.jobs).read_text())
    if not jobs:
        ap.error("no folder given")

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # SGLang's registry logs every model it cannot import
    _simulate_hopper()
    if args.plugins:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    results = [_probe_job(job) for job in jobs]
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
