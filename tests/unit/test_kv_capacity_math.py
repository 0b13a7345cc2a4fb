"""`kq inspect --kv`: KV-cache tokens per GPU, against hand computations."""
from __future__ import annotations

import json

from kq.sglang.kv_capacity import H200_MIB, bytes_per_token, kv_tokens, mem_fraction_static
from kq_testutil import TINY_MODEL, run_kq


def test_tiny_glm52_by_hand():
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    # 4 layers; latent 128 + rope 32; DSA indexer (head dim 64) on layers 0, 1, 3 (layer 2 shares).
    assert bytes_per_token(cfg, "bf16", 8) == 4 * (128 + 32) * 2 + 3 * 64 == 1472
    # FP8: 128 latent bytes + one F32 scale per 128 + the rope key in BF16.
    assert bytes_per_token(cfg, "fp8", 8) == 4 * (128 + 4 + 32 * 2) + 3 * 64 == 976
    assert bytes_per_token(cfg, "fp8", 1) == 976          # MLA: the latent is not split by TP


def test_gqa_and_plain_mla_by_hand():
    glm47 = {"num_hidden_layers": 92, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
             "num_attention_heads": 96}
    assert bytes_per_token(glm47, "bf16", 8) == 92 * 2 * 1 * 128 * 2       # one KV head per rank at TP 8
    assert bytes_per_token(glm47, "fp8", 4) == 92 * 2 * 2 * 128
    kimi = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert bytes_per_token(kimi, "fp8", 8) == 61 * 576


def test_memory_fraction_and_tokens():
    assert mem_fraction_static(8) == 0.897 and mem_fraction_static(8, decode_pool=True) == 0.929
    assert mem_fraction_static(2) == round((H200_MIB - (512 + 8192 * 1.5 + 256 + 512)) / H200_MIB, 3)
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    w = 50 * 10**9
    bf16, fp8 = kv_tokens(cfg, w, tp=8)
    pool = int(H200_MIB * 2**20 * 0.897) - w
    assert bf16.pool_bytes == fp8.pool_bytes == pool
    assert (bf16.tokens, fp8.tokens) == (pool // 1472, pool // 976)


def test_inspect_kv_json():
    r = run_kq("inspect", TINY_MODEL, "--kv", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    kv = d["kv"]
    assert kv["tp"] == 8 and kv["mem_fraction_static"] == 0.897
    rows = {(c["checkpoint"], c["kv_dtype"]): c for c in kv["capacity"]}
    out8 = [t["per_gpu_bytes"] for t in d["tp"] if t["tp"] == 8][0]
    assert rows[("output", "fp8")]["weights_per_gpu"] == out8
    assert rows[("source", "bf16")]["weights_per_gpu"] == -(-d["source_bytes"] // 8)
    assert rows[("output", "fp8")]["tokens"] == (int(H200_MIB * 2**20 * 0.897) - out8) // 976
