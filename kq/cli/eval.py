"""`kq eval`: argument handling and the table; the work is in kq.eval.run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kq.errors import KqError


def eval_cmd(
    out: Path = typer.Argument(..., help="The quantized checkpoint folder (a kq output)."),
    against: str = typer.Option(..., "--against", help="The source it was made from: a folder, a recipe alias "
                                "(glm-5.2) or a Hub repo id (downloaded once into kq's cache, reused after)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision of --against (branch, tag or commit)."),
    text: Optional[Path] = typer.Option(None, "--text", help="Evaluation text: .txt or .jsonl (\"text\" field), "
                                        "gz ok. Never the calibration text."),
    seqs: int = typer.Option(48, "--seqs", help="Number of token windows."),
    seqlen: int = typer.Option(256, "--seqlen", help="Tokens per window."),
    batch: int = typer.Option(8, "--batch", help="Windows per forward call (memory vs speed)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 (exact reference) or bfloat16 (half the memory)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    activations: str = typer.Option("auto", "--activations", help="fp8: also run the routed experts with FP8 "
                                    "(e4m3) input activations, per-token and per-tensor dynamic scales, as a W4A8 "
                                    "kernel computes them, beside the W4A16 figures. none: W4A16 only. auto "
                                    "(default): fp8 when the checkpoint's config asks for FP8 activations."),
    pair: bool = typer.Option(False, "--pair", help="Also score the disaggregated pair: the source prefills the "
                              "first --prompt tokens of each window (its KV cache), the quantized model decodes the "
                              "rest on that cache; KL/top-1 on the continuation beside the quantized model alone."),
    prompt: Optional[int] = typer.Option(None, "--prompt", help="Prompt tokens per window for --pair (default: half "
                                         "the window)."),
    mtp: bool = typer.Option(False, "--mtp", help="Also the MTP draft's first-token acceptance (greedy, as SGLang's "
                             "EAGLE-style MTP verifies it), source and quantized, each against its own target."),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="fp8: also the quantized model reading an "
                                           "emulated e4m3 KV cache (MLA latent): scale 1.0, the checkpoint's "
                                           "calibrated scales (kq quantize --kv-cache fp8), and SGLang's per-128 "
                                           "dynamic scales (its DSA pool on Hopper)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """KL(source||quantized) per token, top-1 agreement and perplexity of both, layer by layer.

    Both models run one decoder layer at a time, side by side, so checkpoints larger than
    memory can be evaluated. The result is also written to OUT/kq-eval.json.

    Example:\n
      kq eval ./GLM-5.2-INT4 --against ./GLM-5.2-FP8 --text eval.txt.gz\n
      kq eval ./GLM-5.2-INT4 --against glm-5.2 --text eval.txt.gz   # the Hub source, downloaded once\n
      kq eval ./GLM-5.2-INT4 --against ./GLM-5.2-FP8 --text eval.txt.gz --activations fp8   # W4AFP8 cost\n
      kq eval ./GLM-5.2-INT4 --against glm-5.2 --text eval.txt.gz --pair --prompt 192   # FP8 prefill, INT4 decode\n
      kq eval ./GLM-5.2-INT4 --against glm-5.2 --text eval.txt.gz --mtp   # speculative draft acceptance
    """
    from kq.eval.run import evaluate

    if text is None:
        raise KqError("kq eval needs --text FILE (held-out text, .txt or .jsonl, gz ok)")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise KqError("--device cuda: no CUDA GPU is visible")
    elif device != "cpu":
        raise KqError(f"--device {device}: use cpu or cuda")
    from kq.cli.common import checkpoint_folder
    from kq.eval.run import check_inputs
    if activations == "auto":
        import json as _json
        from kq.checkpoint.ct_config import experts_fp8_activations
        try:
            qc = _json.loads((out / "config.json").read_text()).get("quantization_config")
        except (OSError, ValueError):
            qc = None  # check_inputs says what is wrong with the folder
        activations = "fp8" if experts_fp8_activations(qc) else "none"
    out_reader = check_inputs(out, dtype, activations)  # before --against, which may be a download
    if kv_cache:
        from kq.quantize.kv_scales import check_mla
        check_mla(out_reader.config)
    if kv_cache not in (None, "fp8"):
        raise KqError(f"--kv-cache {kv_cache}: only fp8 is supported")
    if prompt is not None and not pair:
        raise KqError("--prompt is the prompt length of --pair; add --pair")
    pair_prompt = (seqlen // 2 if prompt is None else prompt) if pair else None
    if pair_prompt is not None and not 0 <= pair_prompt < seqlen:
        raise KqError(f"--prompt {pair_prompt}: must be at least 0 and below --seqlen {seqlen}")
    label = against
    against = checkpoint_folder(against, revision=revision)
    if as_json:
        rec = evaluate(out, against, text, seqs=seqs, seqlen=seqlen, batch=batch, dtype=dtype, device=device,
                       source_name=label, activations=activations, pair_prompt=pair_prompt, mtp=mtp,
                       kv_cache=kv_cache)
        typer.echo(json.dumps(rec, indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    err = Console(stderr=True)
    with err.status("layer 0") as status:
        rec = evaluate(out, against, text, seqs=seqs, seqlen=seqlen, batch=batch, dtype=dtype, device=device,
                       source_name=label, activations=activations, pair_prompt=pair_prompt, mtp=mtp,
                       kv_cache=kv_cache, on_layer=lambda i, n: status.update(f"layer {i}/{n} of both models"))
    t = Table(title=f"{out} vs {label}: {rec['seqs']} x {rec['seqlen']} tokens of {text.name}")
    acts = rec.get("activations")
    cols = (["expert activations"] if acts else []) + ["KL (nats/token)", "top-1 agreement", "ppl source",
                                                       "ppl quantized"] + (["KL / W4A16"] if acts else []) + ["seconds"]
    for col in cols:
        t.add_column(col, justify="right")
    rows = [("W4A16 (exact)", rec, None)]
    if acts:
        rows += [(f"FP8 per-{acts[k]['scale']}", acts[k], acts[k]["kl_vs_w4a16"]) for k in ("fp8_token", "fp8_tensor")]
    for label_, r, ratio in rows:
        cells = [f"{r['kl']:.4f}", f"{r['top1'] * 100:.1f}%", f"{r['ppl_source']:.2f}", f"{r['ppl_quantized']:.2f}"]
        if acts:
            cells = [label_] + cells + ["" if ratio is None else f"{ratio:.3f}x"]
        t.add_row(*cells, f"{rec['seconds']:.0f}")
    Console().print(t)
    if "pair" in rec:
        _print_pair(rec["pair"])
    if "kv_cache" in rec:
        kv = rec["kv_cache"]
        t = Table(title="quantized model on an emulated FP8 (e4m3) KV cache, against the source")
        for col in ("KV cache", "KL (nats/token)", "top-1 agreement"):
            t.add_column(col, justify="right")
        t.add_row("as computed (no FP8)", f"{rec['kl']:.4f}", f"{rec['top1'] * 100:.1f}%")
        for mode in ("scale-1", "calibrated", "block-128"):
            if mode in kv:
                t.add_row(f"fp8 {mode}", f"{kv[mode]['kl']:.4f}", f"{kv[mode]['top1'] * 100:.1f}%")
        Console().print(t)
    if "mtp" in rec:
        m = rec["mtp"]
        Console().print(f"MTP draft acceptance (layer {m['mtp_layer']}, first draft token, greedy): source "
                        f"{m['source']['acceptance'] * 100:.1f}%, quantized {m['quantized']['acceptance'] * 100:.1f}%; "
                        f"quantized draft = source draft at {m['draft_agreement'] * 100:.1f}% of positions")


def _print_pair(p: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"continuation tokens {p['prompt']}.. of each window ({p['continuation']} per window), "
                    "against the source alone")
    for col in ("decode", "KL (nats/token)", "top-1 agreement", "ppl"):
        t.add_column(col, justify="right")
    for label, key in (("quantized alone", "alone"), ("source prefill + quantized decode", "pair")):
        r = p[key]
        t.add_row(label, f"{r['kl']:.4f}", f"{r['top1'] * 100:.1f}%", f"{r['ppl_quantized']:.2f}")
    Console().print(t)
