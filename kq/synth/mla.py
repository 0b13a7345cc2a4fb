"""Building blocks shared by the DeepSeek-layout families (GLM-5.x, Kimi K2).

Shapes, with H heads (module.weight is [out, in]):
  q_a_proj [q_lora, hidden]   q_b_proj [H*(nope+rope), q_lora]
  kv_a_proj_with_mqa [kv_lora+rope, hidden]   kv_b_proj [H*(nope+v), kv_lora]
  o_proj [hidden, H*v]
  DSA indexer: wq_b [heads_i*dim_i, q_lora], wk [dim_i, hidden] (block FP8),
               weights_proj [heads_i, hidden] and k_norm.{weight,bias} [dim_i] (BF16).
"""

from __future__ import annotations

from .layout import Layout


def linear(layout: Layout, module: str, out: int, inn: int, o: dict) -> None:
    """A Linear in the family's storage: o['fp8'] is 'block' (default), 'channel', or
    'bf16' (unquantized, as in the already-INT4 Kimi K2.5 release)."""
    kind = o.get("fp8", "block")
    if kind == "bf16":
        layout.dense(f"{module}.weight", (out, inn))
    elif kind == "channel":
        layout.fp8_channel_linear(module, out, inn, o.get("scale_dtype", "BF16"))
    else:
        layout.fp8_block_linear(module, out, inn)


def add_mla(layout: Layout, p: str, o: dict, indexer: bool) -> None:
    h, nh = o["hidden"], o["heads"]
    a = f"{p}.self_attn"
    linear(layout, f"{a}.q_a_proj", o["q_lora"], h, o)
    layout.norm(f"{a}.q_a_layernorm.weight", o["q_lora"])
    linear(layout, f"{a}.q_b_proj", nh * (o["qk_nope"] + o["qk_rope"]), o["q_lora"], o)
    linear(layout, f"{a}.kv_a_proj_with_mqa", o["kv_lora"] + o["qk_rope"], h, o)
    layout.norm(f"{a}.kv_a_layernorm.weight", o["kv_lora"])
    linear(layout, f"{a}.kv_b_proj", nh * (o["qk_nope"] + o["v_head"]), o["kv_lora"], o)
    linear(layout, f"{a}.o_proj", h, nh * o["v_head"], o)
    if indexer:
        d = o["index_head_dim"]
        linear(layout, f"{a}.indexer.wq_b", o["index_heads"] * d, o["q_lora"], o)
        linear(layout, f"{a}.indexer.wk", d, h, o)
        layout.dense(f"{a}.indexer.weights_proj.weight", (o["index_heads"], h))
        layout.norm(f"{a}.indexer.k_norm.weight", d)
        layout.dense(f"{a}.indexer.k_norm.bias", (d,))


def add_dense_mlp(layout: Layout, p: str, hidden: int, inter: int, o: dict | None = None) -> None:
    o = o or {}
    linear(layout, f"{p}.mlp.gate_proj", inter, hidden, o)
    linear(layout, f"{p}.mlp.up_proj", inter, hidden, o)
    linear(layout, f"{p}.mlp.down_proj", hidden, inter, o)


def add_moe_mlp(layout: Layout, p: str, o: dict) -> None:
    """Router (BF16 weight, F32 correction bias), shared expert(s), routed experts
    (INT4 pack-quantized when o['experts_int4'] holds a group size)."""
    h, e, mi = o["hidden"], o["n_experts"], o["moe_intermediate"]
    layout.dense(f"{p}.mlp.gate.weight", (e, h))
    layout.dense(f"{p}.mlp.gate.e_score_correction_bias", (e,), dtype="F32", std=0.1)
    s = f"{p}.mlp.shared_experts"
    linear(layout, f"{s}.gate_proj", mi * o["n_shared"], h, o)
    linear(layout, f"{s}.up_proj", mi * o["n_shared"], h, o)
    linear(layout, f"{s}.down_proj", h, mi * o["n_shared"], o)
    group = o.get("experts_int4")
    for j in range(e):
        x = f"{p}.mlp.experts.{j}"
        for name, out, inn in (("gate_proj", mi, h), ("up_proj", mi, h), ("down_proj", h, mi)):
            if group:
                layout.int4_linear(f"{x}.{name}", out, inn, group)
            else:
                linear(layout, f"{x}.{name}", out, inn, o)


def add_mtp_extras(layout: Layout, p: str, hidden: int) -> None:
    """The MTP layer's own parts beyond a decoder layer: all BF16, never quantized."""
    layout.dense(f"{p}.eh_proj.weight", (hidden, 2 * hidden))
    layout.norm(f"{p}.enorm.weight", hidden)
    layout.norm(f"{p}.hnorm.weight", hidden)
    layout.norm(f"{p}.shared_head.norm.weight", hidden)
