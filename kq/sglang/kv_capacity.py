"""KV-cache tokens per GPU that SGLang 0.5.23 would allocate, from config.json and the weight bytes.

SGLang sizes its KV pool after loading the weights (model_executor/pool_configurator.py):
    pool bytes = total memory x mem_fraction_static - weights per GPU     (activations, CUDA graphs:
                                                                           the 1 - mem_fraction part)
    tokens     = pool bytes // bytes per token
Bytes per token per rank (pool_configurator._compute_cell_size, kv_cache_configurator):
- MLA (GLM-5.x, Kimi K2): every layer caches the latent, kv_lora_rank + qk_rope_head_dim values,
  replicated on every TP rank (one latent head, not split), so a rank's pool holds the server's
  tokens and TP does not multiply them. BF16: 2 bytes each. FP8 without DSA: 1 byte each.
- DSA (GLM-5.x) FP8, Hopper's default kernels: kv_lora_rank FP8 bytes + one FP32 scale per 128 +
  the rope key in BF16 (calculate_mla_kv_cache_dim). Plus, BF16 or FP8, the indexer's key cache,
  index_head_dim FP8 bytes + one FP32 scale per 128, on the layers with their own indexer only
  (shared-indexer layers get no rows: _compute_dsa_indexer_cell_size).
- GQA (GLM-4.x): K and V, num_key_value_heads / TP heads per rank (at least one) x head_dim.
Layers: the causal decoder layers; an MTP draft, when speculative decoding is on, has a pool of
its own (not counted).
mem_fraction_static: SGLang's default rule (arg_groups/memory_hook.py) for a 143771 MiB H200
(what nvidia-smi reports and SGLang reads): chunked prefill 8192, decode CUDA-graph batch 512 at
TP >= 4 (256 below), reserved = 512 + 1.5 x max(8192, 2048) + TP/8 x 1024 + 2 x batch MiB, at least
10240 MiB; TP 8: 0.897. A decode pool (--disaggregation-mode decode) sizes activations for
max(batch, 2048) tokens instead: 0.929. (tests/sglang/test_kv_capacity.py checks both against
SGLang's own resolution.) The CUDA context and NCCL buffers are not subtracted: real pools come
out somewhat smaller.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

H200_MIB = 143771            # nvidia-smi memory.total of an H200 SXM
MIB = 1 << 20
DSA_BLOCK = 128              # DSATokenToKVPool.quant_block_size


def mem_fraction_static(tp: int, gpu_mib: float = H200_MIB, decode_pool: bool = False) -> float:
    """SGLang 0.5.23's default mem_fraction_static for a 96-160 GiB GPU (H20, H200), MLA or not."""
    if not 90 * 1024 <= gpu_mib < 160 * 1024:
        raise ValueError("kq reproduces SGLang's default for 90-160 GiB GPUs (H200) only")
    batch = 256 if tp < 4 else 512
    tokens = max(batch, 2048) if decode_pool else max(8192, 2048)
    reserved = 512 + tokens * 1.5 + tp / 8 * 1024 + batch * 2
    reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def _dsa(config: dict) -> bool:
    return config.get("index_topk") is not None and bool(config.get("kv_lora_rank"))


def indexer_layers(config: dict) -> int:
    n = config["num_hidden_layers"]
    types = config.get("indexer_types")
    return sum(1 for i in range(n) if not types or types[i] != "shared")


def bytes_per_token(config: dict, kv_dtype: str, tp: int) -> int:
    """One rank's KV bytes per token over all causal layers; kv_dtype: bf16 | fp8."""
    n = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        lora, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
        if _dsa(config):
            per = (lora + rope) * 2 if kv_dtype == "bf16" else lora + lora // DSA_BLOCK * 4 + rope * 2
            d = config["index_head_dim"]
            return per * n + (d + d // DSA_BLOCK * 4) * indexer_layers(config)
        return (lora + rope) * (2 if kv_dtype == "bf16" else 1) * n
    heads = max(1, config["num_key_value_heads"] // tp)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * heads * head_dim * (2 if kv_dtype == "bf16" else 1) * n


@dataclass
class Capacity:
    checkpoint: str
    kv_dtype: str
    weights_per_gpu: int
    bytes_per_token: int
    pool_bytes: int
    tokens: int


def kv_tokens(config: dict, weights_per_gpu: int, *, tp: int = 8, gpu_mib: float = H200_MIB,
              mem_fraction: float | None = None, checkpoint: str = "") -> list[Capacity]:
    """Tokens per GPU (= per server for MLA) for BF16 and FP8 KV at SGLang's default memory fraction."""
    frac = mem_fraction if mem_fraction is not None else mem_fraction_static(tp, gpu_mib)
    pool = max(int(gpu_mib * MIB * frac) - weights_per_gpu, 0)
    out = []
    for dt in ("bf16", "fp8"):
        per = bytes_per_token(config, dt, tp)
        out.append(Capacity(checkpoint, dt, weights_per_gpu, per, pool, pool // per))
    return out


def as_dicts(caps: list[Capacity]) -> list[dict]:
    return [asdict(c) for c in caps]
