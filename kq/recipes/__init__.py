"""Family recipes: what each model family looks like and what kq does to it.

A recipe (YAML beside this file) names the family's model types, its FP8 storage,
its Hub aliases, its default group size (valid at TP 8) and what happens to the MTP
layer's experts. Which tensors are routed experts is the same rule for every family
(`EXPERT_RE`): `…layers.L.mlp.experts.E.{gate,up,down}_proj.weight`; everything else
is kept byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import yaml

from kq.errors import KqError
from kq.format import EXPERT_RE, expert_match  # noqa: F401  (kq.recipes' API)


@dataclass(frozen=True)
class Recipe:
    family: str
    title: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    source_format: str                 # fp8_block | fp8_channel | refuse
    aliases: dict[str, str] = field(default_factory=dict)
    default_group_size: int = 128
    hidden_key: str = "hidden_size"
    intermediate_key: str = "moe_intermediate_size"
    experts_key: str = "n_routed_experts"
    mtp_experts: str = "int4"
    refuse: str | None = None
    tiktoken_pattern: str | None = None  # split regex for a tiktoken.model tokenizer (Kimi)


@cache
def all_recipes() -> dict[str, Recipe]:
    out = {}
    for f in sorted(resources.files(__name__).iterdir(), key=lambda p: p.name):
        if f.name.endswith(".yaml"):
            d = yaml.safe_load(f.read_text())
            d["model_types"] = tuple(d["model_types"])
            d["architectures"] = tuple(d["architectures"])
            out[d["family"]] = Recipe(**d)
    return out


def resolve_alias(name: str) -> str | None:
    """A recipe alias (`glm-5.2`) -> its Hub repo id, else None."""
    for r in all_recipes().values():
        if name.lower() in r.aliases:
            return r.aliases[name.lower()]
    return None


def recipe_for_config(config: dict) -> Recipe:
    """The recipe matching a config.json, by model_type first, then architectures."""
    mt = config.get("model_type")
    archs = config.get("architectures") or []
    for r in all_recipes().values():
        if mt in r.model_types:
            return r
    for r in all_recipes().values():
        if any(a in r.architectures for a in archs):
            return r
    known = ", ".join(sorted(t for r in all_recipes().values() for t in r.model_types))
    raise KqError(f"unknown model family: model_type {mt!r}, architectures {archs}; kq knows {known}")
