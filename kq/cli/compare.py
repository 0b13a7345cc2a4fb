"""`kq compare`: argument handling, progress and tables; the work is in kq.eval.endpoints / kq.eval.harness."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kq.errors import KqError


def _encoder(tokenizer: str):
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:
        raise KqError(f"--tokenizer {tokenizer}: cannot load it ({e.__class__.__name__}: {str(e)[:200]})")
    return lambda s: tok(s, add_special_tokens=False)["input_ids"]


def compare_cmd(
    url_a: str = typer.Argument(..., help="Reference server, e.g. http://127.0.0.1:30000 (the FP8 model)."),
    url_b: str = typer.Argument(..., help="Server compared with it, e.g. http://127.0.0.1:30001 (the INT4 model)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompts: .txt (one per line) or .jsonl "
                                           "(\"prompt\" or \"text\" field)."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Greedy tokens generated per prompt by each server."),
    top_k: int = typer.Option(20, "--top-k", help="Top logprobs asked per position (servers cap it: OpenAI 20, "
                              "vLLM --max-logprobs, SGLang none)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts / lm-eval documents."),
    text_only: bool = typer.Option(False, "--text-only", help="Servers without logprobs: compare the greedy texts "
                                   "(re-encoded with --tokenizer); flip rate only, no KL."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer folder or Hub id (--text-only, "
                                            "--lm-eval)."),
    lm_eval_tasks: Optional[str] = typer.Option(None, "--lm-eval", help="Comma-separated lm-evaluation-harness "
                                                "tasks run against both servers (needs kq[eval])."),
    lm_eval_include: Optional[Path] = typer.Option(None, "--lm-eval-include", help="Folder of task YAMLs of your "
                                                   "own for --lm-eval."),
    max_gen_toks: int = typer.Option(256, "--max-gen-toks", help="lm-eval's generation limit for tasks that set "
                                     "none (its default, 256), the same for both servers."),
    model_a: Optional[str] = typer.Option(None, "--model-a", help="Model name sent to A (default: /v1/models)."),
    model_b: Optional[str] = typer.Option(None, "--model-b", help="Model name sent to B (default: /v1/models)."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds per request before it counts as failed."),
    retries: int = typer.Option(2, "--retries", help="Retries of a request after a connection error or HTTP 5xx."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Compare two running OpenAI-compatible servers (e.g. FP8 and INT4 SGLang) token by token.

    Both generate greedily from every prompt. On the tokens before their first difference both
    saw the same context: there kq reports KL(A||B) from the top-k logprobs (a lower bound on
    the full-vocabulary KL, see docs/compare.md) and the flip rate (flips / positions compared).
    --lm-eval runs lm-evaluation-harness's local-completions model against both and prints the
    scores side by side.

    Example:\n
      kq compare http://127.0.0.1:30000 http://127.0.0.1:30001 --prompts prompts.txt\n
      kq compare URL_A URL_B --prompts p.txt --text-only --tokenizer ./GLM-5.2-INT4   # no logprobs\n
      kq compare URL_A URL_B --lm-eval gsm8k --limit 200 --tokenizer ./GLM-5.2-INT4 --max-gen-toks 512
    """
    from kq.eval.endpoints import Endpoint, compare_endpoints, read_prompts

    if prompts is None and not lm_eval_tasks:
        raise KqError("kq compare needs --prompts FILE and/or --lm-eval TASKS")
    if (text_only or lm_eval_tasks) and not tokenizer:
        raise KqError("--text-only and --lm-eval need --tokenizer (the checkpoint folder or its Hub id)")
    for name, v in (("--max-tokens", max_tokens), ("--top-k", top_k), ("--max-gen-toks", max_gen_toks)):
        if v < 1:
            raise KqError(f"{name} must be at least 1")
    tasks = [t.strip() for t in (lm_eval_tasks or "").split(",") if t.strip()]
    if lm_eval_tasks:
        from kq.eval.harness import _lm_eval
        _lm_eval()  # the missing extra is reported before any request
    texts = read_prompts(prompts, limit) if prompts is not None else []
    encode = _encoder(tokenizer) if text_only else None
    a = Endpoint(url_a, model=model_a, timeout=timeout, retries=retries)
    b = Endpoint(url_b, model=model_b, timeout=timeout, retries=retries)
    rec: dict = {"a": url_a, "b": url_b}
    if texts:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from kq.cli.progress import stderr
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=stderr,
                      disable=as_json) as p:
            task = p.add_task("prompts", total=len(texts), rate="")
            state = {"pos": 0}

            def step(positions: int) -> None:
                state["pos"] += positions
                el = p.tasks[0].elapsed or 1e-9
                p.update(task, advance=1, rate=f"{p.tasks[0].completed / el:.2f} prompts/s, {state['pos']} "
                                               "positions compared")
            rep = compare_endpoints(a, b, texts, max_tokens=max_tokens, top_k=top_k, encode=encode, on_prompt=step)
        rec["tokens"] = {**rep.as_dict(), "max_tokens": max_tokens, "top_k": None if text_only else top_k}
    if tasks:
        from kq.eval.harness import run_tasks
        rec["lm_eval"] = {"tasks": tasks, "limit": limit, "max_gen_toks": max_gen_toks}
        for side, ep in (("a", a), ("b", b)):
            rec["lm_eval"][side] = run_tasks(ep.base, tasks, tokenizer=tokenizer, model=ep.served_model(),
                                             limit=limit, max_gen_toks=max_gen_toks, include_path=lm_eval_include,
                                             timeout=timeout, retries=retries)
    a.close()
    b.close()
    if as_json:
        typer.echo(json.dumps(rec, indent=2))
        return
    _print(rec)


def _print(rec: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    out = Console()
    if "tokens" in rec:
        r = rec["tokens"]
        t = Table(title=f"{rec['b']} against {rec['a']}: {r['prompts']} prompts, {r['max_tokens']} greedy tokens each")
        cols = ["positions compared", "flip rate", "identical continuations"]
        if not r["text_only"]:
            cols += [f"KL top-{r['top_k']} (nats, mean)", "KL max"]
        for c in cols:
            t.add_column(c, justify="right")
        row = [str(r["positions"]), f"{r['flip_rate'] * 100:.2f}%" if r["flip_rate"] is not None else "-",
               f"{r['identical_continuations'] * 100:.1f}%"]
        if not r["text_only"]:
            row += [f"{r['kl_topk_mean']:.4f}", f"{r['kl_topk_max']:.4f}"]
        t.add_row(*row)
        out.print(t)
    if "lm_eval" in rec:
        le = rec["lm_eval"]
        t = Table(title=f"lm-eval (local-completions, max_gen_toks {le['max_gen_toks']}"
                        + (f", limit {le['limit']}" if le["limit"] else "") + ")")
        for c in ("task", "metric", "A", "B", "B - A"):
            t.add_column(c, justify="left" if c in ("task", "metric") else "right")
        for task in sorted(set(le["a"]) | set(le["b"])):
            for m in sorted(set(le["a"].get(task, {})) | set(le["b"].get(task, {}))):
                va, vb = le["a"].get(task, {}).get(m), le["b"].get(task, {}).get(m)
                d = f"{vb - va:+.4f}" if va is not None and vb is not None else "-"
                t.add_row(task, m, "-" if va is None else f"{va:.4f}", "-" if vb is None else f"{vb:.4f}", d)
        out.print(t)
