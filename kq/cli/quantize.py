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
    gptq_expert_chunk: int = typer.Option(16, "--gptq-expert-chunk", help="GPTQ: experts solved together in one "
                                          "batched solve (memory: chunk x hidden^2 x 4 bytes of Hessians); under "
                                          "torchrun, the unit split across ranks (256 experts / 16 = 16 chunks). "
                                          "gptq and awq+gptq; awq alone always splits one expert at a time."),
    activations: str = typer.Option("none", "--activations", help="Expert input activations the config asks "
                                    "the server for: none (W4A16, decode) or fp8 (W4AFP8: dynamic per-token FP8, "
                                    "SGLang's CompressedTensorsW4AFP8MoE; group 128 only). Same tensors either way: "
                                    "`kq config` makes the other variant from a finished folder without copying."),
    keep_mtp: bool = typer.Option(False, "--keep-mtp", help="Leave the MTP layer's experts as they came (FP8): the "
                                  "speculative draft keeps the source's acceptance, at the draft's FP8 memory."),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="fp8: also calibrate per-layer FP8 KV-cache "
                                           "scales of the MLA latent on --calib (its --calib-samples x --calib-seqlen "
                                           "tokens) and write them where SGLang reads them (kv_cache_scheme)."),
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
      torchrun --nproc-per-node 8 -m kq quantize ./GLM-5.2-FP8 --method gptq --calib data.jsonl --out ./g52-gptq\n
      kq quantize glm-5.2 --group-size 128 --activations fp8 --out ./GLM-5.2-W4AFP8\n
      kq quantize glm-5.2 --out ./GLM-5.2-INT4-mtp8 --keep-mtp   # FP8 draft experts\n
      kq quantize glm-5.2 --method awq+gptq --calib calib.txt --out ./GLM-5.2-INT4-AWQ
    """
    import torch

    from kq.quantize import distributed
    from kq.quantize.run import run_quantize

    # Under torchrun (docs/distributed.md): join the process group first, so that every check below
    # ends all ranks with one line (distributed.agree); rank 0 alone prints.
    dev0 = torch.device("cuda" if (device == "cuda" or (device == "auto" and torch.cuda.is_available())) else "cpu")
    if dev0.type == "cuda" and not torch.cuda.is_available():
        raise KqError("--device cuda: no CUDA GPU is visible")
    world, dev = distributed.setup(dev0)
    source, plan, opts, codes, done = distributed.agree(lambda: _prepare(
        src, to, out, group_size, method, clip, tp, ep, calib, calib_samples, calib_seqlen, calib_policy, gptq_damp,
        gptq_clip, gptq_asym, gptq_refit, gptq_expert_chunk, activations, keep_mtp, kv_cache, stream, staging, revision, device, jobs,
        dev))
    out = out or default_out(src)
    quiet = as_json or not world.lead
    if done:
        if world.lead:
            if as_json:
                typer.echo(json.dumps({"status": "already complete", "out": str(out)}))
            else:
                stderr.print(f"{out}: already complete (same source and options); nothing to do")
        distributed.teardown()
        return
    if not quiet:
        ranks = f" x {world.size} ranks" if world.on else ""
        stderr.print(f"[bold]{source.name}[/] ({plan.recipe.title}) -> {out}: {plan.classes.get('routed expert -> int4', {}).get('tensors', 0)} "
                     f"expert weights to INT4 g{plan.group_size} ({opts.method}{'/' + opts.clip if opts.method == 'rtn' else ''}) on {dev.type}{ranks}, "
                     f"{human_bytes(plan.source_bytes)} -> {human_bytes(plan.output_bytes)}")
    kv_scales = None
    if opts.kv_cache:
        kv_scales = _calibrate_kv(source, opts.calib, opts.calib_samples, opts.calib_seqlen, dev, quiet=quiet)
    with ShardProgress(plan.source_bytes, len(plan.shards), enabled=not quiet) as prog:
        summary = run_quantize(source, plan, out, opts, device=dev, progress=prog, expert_codes=codes,
                               kv_scales=kv_scales)
    distributed.teardown()
    if not world.lead:
        return
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


def _prepare(src, to, out, group_size, method, clip, tp, ep, calib, calib_samples, calib_seqlen, calib_policy,
             gptq_damp, gptq_clip, gptq_asym, gptq_refit, gptq_expert_chunk, activations, keep_mtp, kv_cache, stream,
             staging, revision, device, jobs, dev):
    """The flags into one validated Options (kq.quantize.run.Options checks them all), then the source, the
    plan and every check of the output folder (the same on every rank) -> (source, plan, opts, codes, done)."""
    from dataclasses import replace

    from kq.quantize.plan import make_plan
    from kq.quantize.run import Options, preflight

    require(to == "int4", f"--to {to}: only int4 is supported")
    require(device in ("auto", "cpu", "cuda"), f"--device {device}: use auto, cpu or cuda")
    opts = Options(method=method, group_size=group_size, clip=clip, stream=stream, activations=activations,
                   jobs=jobs if jobs is not None else (8 if dev.type == "cuda" else 1), keep_mtp=keep_mtp,
                   kv_cache=kv_cache, calib=calib, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                   calib_policy=calib_policy, gptq_damp=gptq_damp, gptq_clip=gptq_clip, gptq_asym=gptq_asym,
                   gptq_refit=gptq_refit, gptq_expert_chunk=gptq_expert_chunk)
    if opts.calib is not None and (opts.method != "rtn" or opts.kv_cache):
        from kq.quantize.calibration import resolve_calib
        resolve_calib(opts.calib)  # fail (or download) before any model work
    out = out or default_out(src)
    staging = staging or (out / ".kq-work" / "download")
    source = open_any(src, staging=staging, stream=opts.stream, revision=revision)
    plan = make_plan(source, group_size=opts.group_size, tp=tp, ep=ep, keep_mtp=opts.keep_mtp)
    opts = replace(opts, group_size=plan.group_size)   # the family's default group when none was given
    if opts.kv_cache:
        from kq.quantize.kv_scales import check_mla
        check_mla(source.config)
    codes = None
    if opts.method != "rtn":
        from kq.quantize.layerwise import gptq_expert_codes
        codes = gptq_expert_codes(source, plan, out, calib=opts.calib, samples=opts.calib_samples,
                                  seqlen=opts.calib_seqlen, device=dev, cfg=opts.method_config())
    done = preflight(source, plan, out, opts) == "done"
    return source, plan, opts, codes, done


def _calibrate_kv(source, calib, samples, seqlen, device, quiet):
    """Per-layer FP8 KV-cache scales from the source model on the calibration text (kq.quantize.kv_scales)."""
    from kq.model import LayerwiseModel
    from kq.quantize.calibration import calibration_ids
    from kq.quantize.kv_scales import calibrate_kv_scales
    from kq.quantize.layerwise import reader_for
    reader = reader_for(source)
    ids = calibration_ids(reader.folder, reader.config, calib, samples, seqlen)
    model = LayerwiseModel(reader, device=device)
    if quiet:
        return calibrate_kv_scales(model, ids)
    with stderr.status("KV-cache scales: layer 0") as st:
        return calibrate_kv_scales(model, ids, on_layer=lambda i, n: st.update(f"KV-cache scales: layer {i}/{n} "
                                                                                f"of {ids.numel()} calibration tokens"))
