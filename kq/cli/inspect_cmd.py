"""`kq inspect`: the plan, printed; nothing is written."""
from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kq.cli.common import human_bytes, open_any


def inspect(
    src: str = typer.Argument(..., help="A local checkpoint folder, a recipe alias, a Hub repo id, or `demo`."),
    group_size: Optional[int] = typer.Option(None, "--group-size", "-g", help="INT4 group size to plan for (default: the family's)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Also refuse, as quantize would, if the result cannot load at this TP."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision."),
    kv: bool = typer.Option(False, "--kv", help="Also the KV-cache tokens per GPU SGLang would allocate on an H200 "
                            "at --tp (default 8), BF16 and FP8 KV, at SGLang's default memory fraction, for the "
                            "source and the output."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable plan on stdout."),
) -> None:
    """Show what `kq quantize` would do: tensors per class, source and output bytes, per-GPU weight memory
    and the TP verdict at TP 1/2/4/8, and the disk needed. Reads only config and shard headers.

    Offline (or with the Hub unreachable), a known model is planned from the layout kq ships for it
    (its published config and every tensor's name, dtype, shape and shard), and the output says so.

    Examples:\n
      kq inspect glm-5.2 --tp 8\n
      kq inspect kimi-k2 --group-size 128 --json\n
      kq inspect glm-5.2 --kv            # KV-cache tokens per H200 at TP 8, source vs INT4\n
      kq inspect ./GLM-5.2-FP8
    """
    from kq.quantize.plan import make_plan

    source, offline_note = _open_for_inspect(src, revision)
    plan = make_plan(source, group_size=group_size, tp=tp)
    data = {
        "source": source.name, "planned_from": "bundled layout" if offline_note else "checkpoint",
        "family": plan.recipe.family, "title": plan.recipe.title,
        "group_size": plan.group_size, "routed_experts": plan.experts,
        "expert_intermediate": plan.expert_intermediate, "hidden": plan.hidden,
        "classes": plan.classes, "source_bytes": plan.source_bytes, "output_bytes": plan.output_bytes,
        "output_ratio": round(plan.output_bytes / plan.source_bytes, 4),
        "disk_needed_bytes": plan.output_bytes + sum(source.extra_files.values()),
        "mtp_experts": plan.recipe.mtp_experts,
        "tp": [{"tp": v.tp, "ok": v.ok, "reason": v.reason, "per_gpu_bytes": plan.per_gpu_bytes(v.tp)} for v in plan.tp],
    }
    if kv:
        from kq.sglang.kv_capacity import as_dicts, kv_tokens, mem_fraction_static
        t = tp or 8
        cfg = source.config.get("text_config") or source.config
        data["kv"] = {"tp": t, "gpu": "H200 (143771 MiB)", "mem_fraction_static": mem_fraction_static(t),
                      "capacity": as_dicts(kv_tokens(cfg, -(-plan.source_bytes // t), tp=t, checkpoint="source")
                                           + kv_tokens(cfg, plan.per_gpu_bytes(t), tp=t, checkpoint="output"))}
    if as_json:
        typer.echo(json.dumps(data, indent=1))
        return
    con = Console()
    if offline_note:
        con.print(f"[yellow]{offline_note}")
    con.print(f"[bold]{source.name}[/]: {plan.recipe.title}; {plan.experts} routed experts, expert intermediate "
              f"{plan.expert_intermediate}, hidden {plan.hidden}; INT4 group {plan.group_size}")
    t = Table("class", "tensors", "source", "output")
    for k, v in plan.classes.items():
        t.add_row(k, str(v["tensors"]), human_bytes(v["source_bytes"]), human_bytes(v["output_bytes"]))
    t.add_row("[bold]total", "", human_bytes(plan.source_bytes),
              f"{human_bytes(plan.output_bytes)} ({plan.output_bytes / plan.source_bytes:.3f}x)")
    con.print(t)
    t = Table("TP", "weights per GPU", "SGLang loads it?", "why")
    for v in data["tp"]:
        t.add_row(str(v["tp"]), human_bytes(v["per_gpu_bytes"]), "[green]yes" if v["ok"] else "[red]no", v["reason"])
    con.print(t)
    con.print(f"disk needed for the output: {human_bytes(data['disk_needed_bytes'])}"
              f"{' plus the tokenizer files' if offline_note else ''}; MTP layer experts: {plan.recipe.mtp_experts}")
    if kv:
        k = data["kv"]
        t = Table("checkpoint", "KV dtype", "weights per GPU", "KV pool per GPU", "bytes per token", "tokens per GPU",
                  title=f"KV cache on an H200 at TP {k['tp']}, SGLang's default mem_fraction_static "
                        f"{k['mem_fraction_static']}")
        for c in k["capacity"]:
            t.add_row(c["checkpoint"], c["kv_dtype"], human_bytes(c["weights_per_gpu"]), human_bytes(c["pool_bytes"]),
                      f"{c['bytes_per_token']:,}", f"{c['tokens']:,}")
        con.print(t)


def _open_for_inspect(src: str, revision: str | None):
    """(source, note): the checkpoint itself, or, when the Hub cannot be asked about a model whose
    layout kq bundles, that layout (note says so; None otherwise)."""
    from kq.checkpoint.hub import HubUnreachable
    from kq.synth.real_layouts import LayoutSource, bundled_layout
    from kq.recipes import resolve_alias

    try:
        return open_any(src, revision=revision), None
    except HubUnreachable as err:
        repo = resolve_alias(src) or src
        layout = bundled_layout(repo) if revision is None else None
        if layout is None:
            raise
        return LayoutSource.open(layout, name=src), (
            f"{err} -- so planned from kq's bundled layout of {repo} (its published config.json and every "
            "tensor's name, dtype, shape and shard); nothing was downloaded")
