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
    from sglang.srt.model_loader import loader, weight_utils

    original = weight_utils.safetensors_weights_iterator
    if getattr(original, "_kq_filtered", False):
        return

    @functools.wraps(original)
    def iterator(hf_weights_files, *args, **kwargs):
        from kq.sglang.rank_loader import skip_predicate

        skip = skip_predicate(list(hf_weights_files))
        if skip is None or args or any(kwargs.values()):
            # No kq per-rank files (or a non-default reading mode): SGLang's own iterator.
            yield from original(hf_weights_files, *args, **kwargs)
            return
        from safetensors import safe_open

        for path in hf_weights_files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if not skip(name):  # decided before any byte of the tensor is read
                        yield name, f.get_tensor(name)

    iterator._kq_filtered = True
    weight_utils.safetensors_weights_iterator = iterator
    loader.safetensors_weights_iterator = iterator
