"""`kq quantize`: argument handling only; the work is in kq.quantize.run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kq.cli.common import default_out, human_bytes, open_any, require
from kq.cli.progress import ShardProgress, stderr
from kq.errors import KqError


def quantize(
    src: str = typer.Argument(..., help="A local FP8 checkpoint folder, a recipe alias (glm-5.2, glm-4.7, kimi-k2, …), "
                                        "a Hub repo id (org/name), or `demo` (a generated tiny GLM-5.2-layout checkpoint)."),
    to: str = typer.Option("int4", "--to", help="Target format. Only int4 (W4A16 routed experts) for now."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (new or empty; an unfinished run of the "
                                                                   "same options is resumed). Default: ./<name>-kq-int4"),
    group_size: Optional[int] = typer.Option(None, "--group-size", "-g", help="INT4 group size: 32, 64 or 128. "
                                             "Default: the family's (valid at TP 8)."),
    method: str = typer.Option("rtn", "--method", help="rtn (data-free, fast); gptq, awq or awq+gptq (calibrated, layer by layer; "
                                   "awq: activation-aware down-projection scales folded into up_proj, then an "
                                   "activation-weighted clip search; awq+gptq: the same scales, then GPTQ)."),
    clip: str = typer.Option("mse", "--clip", help="RTN clipping: mse (per-group search, default) or absmax."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Refuse up front unless the result loads at this tensor-parallel degree."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Refuse up front unless the experts split over this expert-parallel degree."),
    calib: Optional[str] = typer.Option(None, "--calib", help="GPTQ calibration text: a local .txt/.jsonl(.gz) file "
                                        "(jsonl: \"text\" or pre-tokenized \"input_ids\"), or a Hub dataset "
                                        "org/name[@rev][:path/in/repo] (without :path, all its .txt/.jsonl(.gz) "
                                        "files in sorted order; no Parquet)."),
    calib_samples: int = typer.Option(512, "--calib-samples", help="GPTQ: number of calibration sequences (512 x 512 "
                                       "tokens by default: 4x fewer cost the tiny model's benchmark about 8% more KL)."),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen", help="GPTQ: tokens per calibration sequence."),
    calib_policy: str = typer.Option("all", "--calib-policy", help="GPTQ, MoE experts: which calibration tokens "
                                     "shape an expert's Hessian. all (default): every token through every expert "
                                     "(no expert goes uncalibrated); routed: only the tokens the router sends it (what "
                                     "it sees when served; experts with < 32 routed tokens fall back to RTN); weighted: "
                                     "routed, each token weighted by its routing weight squared."),
    gptq_damp: Optional[float] = typer.Option(None, "--gptq-damp", help="GPTQ dampening: this fraction of the Hessian's "
                                              "mean diagonal is added to it (more: closer to RTN, steadier with few "
                                              "calibration tokens). Default: 0.01 at group 32/64, 0.001 at group 128 "
                                              "(measured; docs/eval-gptq.md)."),
    gptq_clip: str = typer.Option("mse", "--gptq-clip", help="GPTQ: how each group's scale is chosen when the solver "
                                  "reaches it. mse: least squared weight error over a grid of clipping divisors; "
                                  "search: the divisor whose play-through of the group's GPTQ steps leaves the least "
                                  "output error (slower solver); absmax: no clipping."),
    gptq_asym: bool = typer.Option(False, "--gptq-asym", help="GPTQ: solve the down projection against the "
                                   "full-precision gate/up path's output rather than the quantized one's own."),
    gptq_refit: bool = typer.Option(False, "--gptq-refit-scales", help="GPTQ: after the codes are chosen, refit each "
                                    "output row's group scales by least squares on the Hessian-weighted error "
                                    "(kept per row only where the error drops). Codes unchanged; a little slower."),
    stream: bool = typer.Option(False, "--stream", help="Hub sources: delete each downloaded shard once used "
                                                          "(disk need: the output plus about two source shards)."),
    staging: Optional[Path] = typer.Option(None, "--staging", help="Where Hub shards are downloaded (default: OUT/.kq-work/download)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    device: str = typer.Option("auto", "--device", help="auto (GPU when present), cuda or cpu. Same output bytes per device type."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Output shards written at once. Default: 8 on a GPU, 1 on the CPU. "
                                       "Memory grows with it (a few expert tensors per job)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout (progress stays on stderr)."),
) -> None:
    """Quantize the routed experts of an FP8 MoE checkpoint to group-wise INT4; every other tensor is kept byte for byte.

    Examples:\n
      kq quantize demo --out /tmp/demo\n
      kq quantize glm-5.2 --out ./GLM-5.2-INT4 --stream\n
      kq quantize ./Kimi-K2-Instruct --group-size 32 --tp 8 --out ./k2-int4\n
      kq quantize glm-5.2 --method awq+gptq --calib calib.txt --out ./GLM-5.2-INT4-AWQ
    """
    import torch

    from kq.quantize.plan import make_plan
    from kq.quantize.run import Options, check_tuning_env, preflight, run_quantize

    require(to == "int4", f"--to {to}: only int4 is supported")
    require(method in ("rtn", "gptq", "awq", "awq+gptq"), f"--method {method}: use rtn, gptq, awq or awq+gptq")
    require(clip in ("mse", "absmax"), f"--clip {clip}: use mse or absmax")
    require(device in ("auto", "cpu", "cuda"), f"--device {device}: use auto, cpu or cuda")
    check_tuning_env()
    if device == "cuda" and not torch.cuda.is_available():
        raise KqError("--device cuda: no CUDA GPU is visible")
    if method == "awq":
        given = [o for o, v in (("--gptq-damp", gptq_damp is not None), ("--gptq-clip", gptq_clip != "mse"),
                                ("--gptq-asym", gptq_asym), ("--gptq-refit-scales", gptq_refit)) if v]
        require(not given, f"{', '.join(given)}: GPTQ options; use them with --method gptq or awq+gptq")
    if method != "rtn":
        require(calib is not None, f"--method {method} needs --calib FILE (calibration text, or a Hub dataset org/name)")
        from kq.quantize.calibration import resolve_calib
        resolve_calib(calib)  # fail (or download) before any model work
    out = out or default_out(src)
    staging = staging or (out / ".kq-work" / "download")
    source = open_any(src, staging=staging, stream=stream, revision=revision)
    plan = make_plan(source, group_size=group_size, tp=tp, ep=ep)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    require(jobs is None or jobs >= 1, f"--jobs {jobs}: use 1 or more")
    opts = Options(method=method, group_size=plan.group_size, clip=clip, stream=stream,
                   jobs=jobs or (8 if dev.type == "cuda" else 1))
    codes = None
    if method != "rtn":
        from kq.quantize.layerwise import POLICIES, GptqConfig, gptq_expert_codes
        require(calib_policy in POLICIES, f"--calib-policy {calib_policy}: use one of {', '.join(POLICIES)}")
        gptq_opts = dict(damp=gptq_damp, refit=gptq_refit, clip=gptq_clip, asym=gptq_asym)
        if method == "gptq":
            cfg = GptqConfig(group=plan.group_size, policy=calib_policy, **gptq_opts)
        else:
            from kq.quantize.awq import AwqConfig
            # only the GPTQ options given go into the config (and so into the resume fingerprint)
            given = {k: v for k, v in gptq_opts.items() if v not in (None, False, "mse")}
            cfg = AwqConfig(method=method, group=plan.group_size, policy=calib_policy,
                            gptq=given if method == "awq+gptq" else {})
        codes = gptq_expert_codes(source, plan, out, calib=calib, samples=calib_samples, seqlen=calib_seqlen, device=dev,
                                  cfg=cfg)
    if preflight(source, plan, out, opts) == "done":
        if as_json:
            typer.echo(json.dumps({"status": "already complete", "out": str(out)}))
        else:
            stderr.print(f"{out}: already complete (same source and options); nothing to do")
        return
    if not as_json:
        stderr.print(f"[bold]{source.name}[/] ({plan.recipe.title}) -> {out}: {plan.classes.get('routed expert -> int4', {}).get('tensors', 0)} "
                     f"expert weights to INT4 g{plan.group_size} ({method}{'/' + clip if method == 'rtn' else ''}) on {dev.type}, "
                     f"{human_bytes(plan.source_bytes)} -> {human_bytes(plan.output_bytes)}")
    with ShardProgress(plan.source_bytes, len(plan.shards), enabled=not as_json) as prog:
        summary = run_quantize(source, plan, out, opts, device=dev, progress=prog, expert_codes=codes)
    calib_summary = getattr(codes, "summary", None)
    if calib_summary is not None:
        summary["calibration"] = calib_summary
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        if calib_summary and calib_summary.get("under_calibrated"):
            n = sum(len(v) for v in calib_summary["under_calibrated"].values())
            stderr.print(f"[yellow]{n} expert(s) saw fewer than {calib_summary.get('min_tokens')} routed calibration tokens; "
                         f"per layer: {json.dumps(calib_summary['under_calibrated'])}")
        stderr.print(f"done in {summary['seconds']:.1f} s: {out} ({human_bytes(summary['output_bytes'])}); "
                     f"check it with `kq verify {out}`")
