"""The plan: every source tensor classified, every output tensor named and sized,
and everything that would fail later refused now.

Built from the source's config and shard headers alone (no weight is read), so
`kq inspect` and the checks before a run cost seconds even for a 750 GB model.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kq.checkpoint.safetensors_io import nbytes_of
from kq.checkpoint.source import Source
from kq.errors import KqError
from kq.format import GROUP_SIZES, MARLIN_TILE, TP_DEGREES, expert_match, split_failures  # noqa: F401  (MARLIN_TILE: also kq.quantize.plan.MARLIN_TILE)
from kq.recipes import Recipe, recipe_for_config

FP8 = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    action: str            # copy | packed | scale | shape
    src: str               # source tensor this comes from (the weight, for the three INT4 parts)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


@dataclass
class ShardPlan:
    name: str                     # output shard file name (= the source shard's)
    tensors: list[OutTensor]
    needs: list[str]              # source shards that must be present to write it

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class TPVerdict:
    tp: int
    ok: bool
    reason: str


@dataclass
class Plan:
    recipe: Recipe
    group_size: int
    shards: list[ShardPlan]
    classes: dict[str, dict]      # class -> {"tensors": n, "source_bytes": b, "output_bytes": b}
    experts: int
    expert_intermediate: int
    hidden: int
    source_bytes: int
    output_bytes: int
    tp: list[TPVerdict] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)   # expert scales folded into the INT4 parts
    # --keep-mtp: the MTP layer (index num_hidden_layers) keeps its experts as they came.
    mtp_layer: int | None = None

    @property
    def mtp_experts(self) -> str:
        return "kept as in the source (--keep-mtp)" if self.mtp_layer is not None else self.recipe.mtp_experts

    def per_gpu_bytes(self, tp: int) -> int:
        # Experts and attention/MLP linears are split TP ways in SGLang; norms, routers
        # and the tiny replicated projections are a rounding error at this scale.
        return math.ceil(self.output_bytes / tp)


def int4_expert(name: str, mtp_layer: int | None = None):
    """The expert regex match of a routed expert weight kq quantizes (not the kept MTP layer's)."""
    m = expert_match(name)
    return m if m and (mtp_layer is None or int(m.group("layer")) < mtp_layer) else None


def classify(name: str, dtype: str, mtp_layer: int | None = None) -> str:
    if int4_expert(name, mtp_layer):
        return "routed expert -> int4"
    if name.endswith((".weight_scale_inv", ".weight_scale")):
        return "fp8 scale (kept)"
    if dtype in FP8:
        return "fp8 weight (kept)"
    return f"{dtype.lower()} (kept)"


def tp_verdicts(intermediate: int, experts: int, group: int, degrees=TP_DEGREES) -> list[TPVerdict]:
    out = []
    for tp in degrees:
        failed = split_failures(intermediate, tp, group)
        if failed is None:
            out.append(TPVerdict(tp, False, f"expert intermediate {intermediate} does not split {tp} ways"))
            continue
        per = intermediate // tp
        bad = [f"I/TP = {per} is {why}" for why in failed]
        out.append(TPVerdict(tp, not bad, "; ".join(bad) or f"I/TP = {per}"))
    return out


def check_group(group: int) -> None:
    if group not in GROUP_SIZES:
        raise KqError(f"--group-size {group} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")


def working_groups(intermediate: int, tp: int) -> list[int]:
    return [g for g in GROUP_SIZES if intermediate and split_failures(intermediate, tp, g) == []]


def make_plan(source: Source, *, group_size: int | None = None, tp: int | None = None,
              ep: int | None = None, keep_mtp: bool = False) -> Plan:
    cfg = source.config
    recipe = recipe_for_config(cfg)
    if recipe.source_format == "refuse":
        raise KqError(f"{source.name}: {recipe.refuse}")
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") == "compressed-tensors" and qc.get("format") in ("pack-quantized", "mixed-precision"):
        raise KqError(f"{source.name}: already INT4 (compressed-tensors {qc.get('format')}); kq quantizes FP8 or BF16 checkpoints")
    if qc and qc.get("quant_method") not in ("fp8", "compressed-tensors"):
        raise KqError(f"{source.name}: unsupported source quantization {qc.get('quant_method')!r}; kq reads block FP8, "
                      "compressed-tensors per-channel FP8 and BF16")
    group = group_size or recipe.default_group_size
    check_group(group)

    wm = source.index.weight_map
    if any(n.endswith(".weight_packed") for n in wm):
        raise KqError(f"{source.name}: already holds INT4 packed weights (*.weight_packed); kq will not quantize twice")
    hidden = int(cfg.get(recipe.hidden_key) or cfg.get("text_config", {}).get(recipe.hidden_key, 0))
    inter = int(cfg.get(recipe.intermediate_key) or cfg.get("text_config", {}).get(recipe.intermediate_key, 0))
    n_exp = int(cfg.get(recipe.experts_key) or cfg.get("text_config", {}).get(recipe.experts_key, 0))

    mtp_layer = None
    if keep_mtp:
        n_layers = int(cfg.get("num_hidden_layers") or cfg.get("text_config", {}).get("num_hidden_layers", 0))
        nextn = int(cfg.get("num_nextn_predict_layers") or cfg.get("text_config", {}).get("num_nextn_predict_layers", 0))
        if not nextn or not any((m := expert_match(n)) and int(m.group("layer")) >= n_layers for n in wm):
            raise KqError(f"--keep-mtp: {source.name} has no MTP layer with routed experts (no expert of layer "
                          f"{n_layers} or later)")
        mtp_layer = n_layers
    # Which source tensors are expert weights, and which scales go with them.
    expert_weights = {n for n in wm if int4_expert(n, mtp_layer)}
    if not expert_weights:
        raise KqError(f"{source.name}: no routed expert weights (…mlp.experts.E.*_proj.weight) found")
    expert_scales = {}
    for n in expert_weights:
        base = n[: -len(".weight")]
        for s in (base + ".weight_scale_inv", base + ".weight_scale"):
            if s in wm:
                expert_scales[s] = n
    for n in expert_weights:
        e = source.entry(n)
        if len(e.shape) != 2:
            raise KqError(f"{n}: expected a 2-D weight, found shape {list(e.shape)}")
        if e.dtype in FP8 and not any(s in wm for s in (n + "_scale_inv", n + "_scale")):
            raise KqError(f"{n}: FP8 weight without a scale tensor in the index")
        if e.dtype not in FP8 + ("BF16", "F16", "F32"):
            raise KqError(f"{n}: unsupported dtype {e.dtype} for a routed expert")
        if e.shape[1] % group:
            ok = [g for g in GROUP_SIZES if e.shape[1] % g == 0]
            raise KqError(f"group size {group} does not divide {n.rsplit('.', 2)[-2]}'s input dim {e.shape[1]} ({n}); "
                          f"use --group-size {' or '.join(map(str, ok)) if ok else '(none fits)'}")

    verdicts = tp_verdicts(inter, n_exp, group) if inter else []
    if tp:
        v = tp_verdicts(inter, n_exp, group, [tp])[0]
        if not v.ok:
            works = working_groups(inter, tp)
            hint = f"use --group-size {' or '.join(map(str, works))}" if works else f"no group size works at TP {tp}; use a smaller --tp or --ep"
            raise KqError(f"at TP {tp}: {v.reason}; SGLang would fail to load it; {hint}")
    if ep and n_exp % ep:
        raise KqError(f"--ep {ep} does not divide the {n_exp} routed experts; use a divisor of {n_exp}")

    renamed = {}
    if recipe.source_format == "fp8_block":
        renamed = {n: n[: -len("_inv")] for n in wm if n.endswith(".weight_scale_inv") and n not in expert_scales}
        for old, new in renamed.items():
            if new in wm:
                raise KqError(f"{source.name}: both {old} and {new} exist; cannot rename the block scale")

    classes: dict[str, dict] = {}
    shards = []
    for shard in source.index.shards:
        outs: list[OutTensor] = []
        needs = {shard}
        for name in sorted(source.index.tensors_in(shard)):
            e = source.headers[shard][name]
            cls = classify(name, e.dtype, mtp_layer)
            c = classes.setdefault(cls, {"tensors": 0, "source_bytes": 0, "output_bytes": 0})
            c["tensors"] += 1
            c["source_bytes"] += e.nbytes
            if name in expert_scales:
                c["tensors"] -= 1
                classes["routed expert -> int4"] = classes.get("routed expert -> int4", {"tensors": 0, "source_bytes": 0, "output_bytes": 0})
                classes["routed expert -> int4"]["source_bytes"] += e.nbytes
                c["source_bytes"] -= e.nbytes
                continue
            if name in expert_weights:
                out_f, in_f = e.shape
                base = name[: -len(".weight")]
                parts = [OutTensor(base + ".weight_packed", "I32", (out_f, in_f // 8), "packed", name),
                         OutTensor(base + ".weight_scale", "BF16", (out_f, in_f // group), "scale", name),
                         OutTensor(base + ".weight_shape", "I64", (2,), "shape", name)]
                outs += parts
                c["output_bytes"] += sum(p.nbytes for p in parts)
                for s in (name + "_scale_inv", name + "_scale"):
                    if s in wm:
                        needs.add(wm[s])
                continue
            out_name = renamed.get(name, name)
            outs.append(OutTensor(out_name, e.dtype, e.shape, "copy", name))
            c["output_bytes"] += e.nbytes
        shards.append(ShardPlan(shard, sorted(outs, key=lambda t: t.name), sorted(needs)))
    # Drop empty classes left by moving expert scales into the expert class.
    classes = {k: v for k, v in classes.items() if v["tensors"] or v["source_bytes"]}
    src_b = sum(source.shard_bytes(s) for s in source.index.shards)
    out_b = sum(s.nbytes for s in shards)
    return Plan(recipe, group, shards, classes, n_exp, inter, hidden, src_b, out_b, verdicts,
                sorted(expert_scales), mtp_layer)
