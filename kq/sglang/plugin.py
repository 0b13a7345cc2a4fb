"""SGLang plugin entry point (`sglang.srt.plugins` group, `kq = kq.sglang.plugin:register`).

SGLang calls `register()` early in every process (before argument parsing and in every
worker). It:
1. adds quantization method `kq` (KqConfig) to SGLang's QUANTIZATION_METHODS — first, so its
   `override_quantization_method` is asked before any other — and to the `--quantization`
   choices, so `--quantization kq` parses;
2. lets KqConfig take over compressed-tensors checkpoints written by kq (plain launch line);
   `--quantization compressed-tensors` or KQ_SGLANG_DISABLE=1 keeps SGLang's own path;
3. makes GLM-4.x's shared-expert fusion rule consult the config's `can_fuse_shared_expert`
   hook as the DeepSeek/GLM-5 rule already does (SGLang 0.5.23's Glm4Moe rule does not), so
   kq's FP8 shared expert is kept apart from the INT4 routed experts for every family;
4. filters SGLang's safetensors iterator so that, when `kq shard` per-rank files exist for
   the running layout, the full checkpoint's routed-expert tensors are not read.

Idempotent: a second call changes nothing.
"""
from __future__ import annotations

import functools


def register() -> None:
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers import quantization as q

    from kq.sglang.config import NAME, KqConfig

    methods = q.QUANTIZATION_METHODS
    if methods.get(NAME) is not KqConfig:
        # In place (other modules hold this dict), with kq first in iteration order.
        rest = [(k, v) for k, v in methods.items() if k != NAME]
        methods.clear()
        methods[NAME] = KqConfig
        methods.update(rest)
    if NAME not in QUANTIZATION_CHOICES:
        QUANTIZATION_CHOICES.append(NAME)
    _keep_glm4_shared_expert_apart()
    _filter_weight_iterator()


def _keep_glm4_shared_expert_apart() -> None:
    from sglang.srt.models import glm4_moe
    from sglang.srt.models.deepseek_common.utils import quant_blocks_shared_experts_fusion

    cls = glm4_moe.Glm4MoeForCausalLM  # Glm4MoeForCausalLMNextN inherits it
    original = cls.__dict__["shared_experts_fusion_disable_reason"].__func__
    if getattr(original, "_kq_wrapped", False):
        return

    def reason(klass, hf_config, quant_config):
        if quant_blocks_shared_experts_fusion(quant_config):
            return ("Quantization keeps shared experts at a higher precision than the routed "
                    "experts (kq: FP8 shared expert, INT4 routed experts).")
        return original(klass, hf_config, quant_config)

    reason._kq_wrapped = True
    cls.shared_experts_fusion_disable_reason = classmethod(reason)


def _filter_weight_iterator() -> None:
    """Wrap SGLang's two safetensors iterators (single-threaded, and the multi-threaded default)."""
    from sglang.srt.model_loader import loader, weight_utils

    for fn_name, threaded in (("safetensors_weights_iterator", False),
                              ("buffered_multi_thread_safetensors_weights_iterator", True)):
        original = getattr(weight_utils, fn_name)
        if getattr(original, "_kq_filtered", False):
            continue
        wrapped = _wrap_iterator(original, threaded)
        setattr(weight_utils, fn_name, wrapped)
        setattr(loader, fn_name, wrapped)


def _wrap_iterator(original, threaded: bool):
    @functools.wraps(original)
    def iterator(hf_weights_files, *args, **kwargs):
        from kq.sglang.rank_loader import skip_predicate

        files = list(hf_weights_files)
        skip = skip_predicate(files)
        # No kq per-rank files, or a reading mode kq does not reproduce (no mmap, prefetch,
        # cache dropping): SGLang's own iterator, unchanged.
        if skip is None or args or any(kwargs.get(k) for k in ("disable_mmap", "prefetch", "drop_cache_after_load")):
            yield from original(files, *args, **kwargs)
            return
        workers = int(kwargs.get("max_workers") or 1) if threaded else 1
        yield from _filtered(files, skip, workers)

    iterator._kq_filtered = True
    return iterator


def _filtered(files, skip, workers: int):
    """(name, tensor) of every tensor `skip` keeps, file by file in order; names are decided
    before any byte of a tensor is read. With workers > 1, up to workers+1 files in flight
    (SGLang's own bound for its threaded loader)."""
    import collections
    import concurrent.futures

    from safetensors import safe_open

    def load(path):
        with safe_open(path, framework="pt", device="cpu") as f:
            return [(n, f.get_tensor(n)) for n in f.keys() if not skip(n)]

    if workers <= 1:
        for path in files:
            yield from load(path)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
        pending = collections.deque(ex.submit(load, p) for p in files[: workers + 1])
        nxt = workers + 1
        while pending:
            items = pending.popleft().result()
            if nxt < len(files):
                pending.append(ex.submit(load, files[nxt]))
                nxt += 1
            yield from items
