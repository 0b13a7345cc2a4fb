"""kq's import graph, read from the sources with ast: every package imports only from the floors below
it, and no module imports itself back through others (no cycle), so each stage can be read and
tested on its own. Imports inside functions count too (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

from kq_testutil import REPO

KQ = REPO / "kq"
# Each package may import from its own floor's neighbours listed here and from every lower floor.
FLOORS = [
    {"kq", "errors", "profile", "format"},         # the ground floor: kq/__init__, kq/errors.py, kq/format.py
    {"recipes", "kernels"},
    {"checkpoint"},
    {"model", "synth"},
    {"quantize", "eval", "publish", "sglang"},
    {"cli", "__main__"},
]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kq"


def _floor(package: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if package in names)


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _is_module(name: str) -> bool:
    p = KQ.parent / Path(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path, module: str) -> set[str]:
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kq"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                   # relative: resolve against this module
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "kq":
                # `from kq.x import y` imports the submodule kq.x.y when there is one, else a name of kq.x
                subs = {f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")}
                found |= subs
                if len(subs) < len(node.names):
                    found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = {_module_name(p): p for p in KQ.rglob("*.py")}
    return {m: {t for t in _imports(p, m) if t in mods and t != m} for m, p in mods.items()}


def test_every_package_is_on_a_floor():
    packages = {p.stem if p.is_file() else p.name for p in KQ.iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert packages - {"__pycache__"} <= set().union(*FLOORS)


def test_no_upward_import():
    upward = sorted(f"{m} -> {t}" for m, ts in _graph().items() for t in ts
                    if _floor(_package(t)) > _floor(_package(m)))
    assert not upward, upward


def test_checkpoint_and_kernels_stand_on_the_ground_floor_only():
    # the two lowest working floors: no quantize / cli / sglang / eval / publish / model in them
    low = {"checkpoint", "kernels", "recipes"}
    bad = sorted(f"{m} -> {t}" for m, ts in _graph().items() if _package(m) in low for t in ts
                 if _package(t) in {"quantize", "cli", "sglang", "eval", "publish", "model", "synth"})
    assert not bad, bad


def test_format_imports_nothing_from_kq():
    assert _graph()["kq.format"] == set()


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
