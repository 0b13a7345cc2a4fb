"""Synthetic checkpoints with the real names, dtypes, config keys and index layout of
each supported family, at small sizes (or full-size layers for benchmarks).

    from kq.synth import generate, FAMILIES
    path = generate("glm5", tmp_path / "ckpt", seed=0, num_layers=4, split_scale=True)

Families (FAMILIES lists each one's options, defaults and one-line help):
  glm5      GLM-5.x block FP8 (weight_scale_inv), MLA + DSA indexer with GLM-5.2 sharing, MTP
  glm4_moe  GLM-4.5/4.6/4.7 compressed-tensors per-channel FP8, GQA with q/k/v bias, MTP
  kimi_k2   Kimi K2 block FP8, no modules_to_not_convert, model-1-of-N shards, tiktoken.model,
            auto_map remote-code placeholders (they raise if ever executed)
  kimi_k25  Kimi K2.5+ already INT4 (pack-quantized g32) under language_model.: for refusals
Odd cases, as options: split_scale, prefix="language_model.", dims not divisible by 128
(hidden=200, ...), fp8="channel", mtp, shard_names="unpadded", single_file, real_ratio.

Values are N(0, 0.02)-like weights stored the way the real checkpoint stores them (block
FP8 with amax/448 block scales, per-channel FP8, BF16, or pre-packed INT4), drawn per
128-row block from a torch.Generator seeded by (seed, tensor name): the same seed and
options give the same bytes, whatever the shard layout or worker count.
"""

from __future__ import annotations

from pathlib import Path

from .families import FAMILIES, Family, Option, build

__all__ = ["FAMILIES", "Family", "Option", "generate", "generate_layer_shapes"]


def generate(family: str, out_dir: str | Path, *, seed: int = 0, **options) -> Path:
    """Write a complete checkpoint folder for `family` into out_dir and return its path.

    Options are listed in FAMILIES[family].options (each with default and description);
    an unknown option raises TypeError. out_dir may be absent or empty; a non-empty one
    is replaced only with overwrite=True.
    """
    from .assemble import write_folder

    plan = build(family, seed, options)
    return write_folder(Path(out_dir), plan.layout, plan.assignment, plan.files,
                        index=plan.index, overwrite=plan.overwrite, threads=plan.threads, workers=plan.workers)


def generate_layer_shapes(family: str, out_dir: str | Path, *, seed: int = 0, num_layers: int = 1,
                          max_shard_bytes: int = 2 << 30, **options) -> Path:
    """Full-size layer shapes (e.g. GLM-5.2: hidden 6144, 256 experts of 2048) with few
    layers and a small vocab, for benchmarks. Streams group by group to disk: peak
    memory is about one expert's float32 draw, whatever the layer size."""
    return generate(family, out_dir, seed=seed, size="full", num_layers=num_layers,
                    max_shard_bytes=max_shard_bytes, **options)
