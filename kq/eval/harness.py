"""lm-evaluation-harness's `local-completions` model run against one server (the optional `eval` extra).

kq only chooses the arguments; the harness does the requests, the task logic and the scoring.
Choices that matter for comparing two servers:
- `max_gen_toks`: the harness's default generation limit (256 tokens) applies to every
  generate_until task that does not set its own; kq passes the limit explicitly, the same to both.
- `tokenized_requests=False`: prompts go as text, so servers that do not take token ids work;
  the tokenizer is still needed by the harness (context lengths of loglikelihood tasks).
- loglikelihood (multiple-choice) tasks need `echo` + `logprobs` on /v1/completions; servers
  that do not return prompt logprobs (transformers serve) can only run generate_until tasks.
"""
from __future__ import annotations

from pathlib import Path

from kq.errors import KqError


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise KqError("--lm-eval needs lm-evaluation-harness: pip install 'kq[eval]'")
    return lm_eval, TaskManager


def run_tasks(base: str, tasks: list[str], *, tokenizer: str, model: str | None = None, limit: float | None = None,
              max_gen_toks: int = 256, include_path: Path | None = None, timeout: float = 120.0,
              retries: int = 2) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} for one server at BASE (its .../v1 URL)."""
    lm_eval, TaskManager = _lm_eval()
    args = {"base_url": base + "/completions", "tokenizer": tokenizer, "tokenized_requests": False,
            "max_gen_toks": max_gen_toks, "timeout": int(timeout), "max_retries": retries + 1, "num_concurrent": 1}
    if model:
        args["model"] = model
    tm = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise KqError(f"--lm-eval: unknown task(s) {', '.join(unknown)} (lm_eval --tasks list shows them; "
                      "a task of your own: --lm-eval-include DIR)")
    try:
        res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=tasks, limit=limit,
                                      task_manager=tm, log_samples=False, bootstrap_iters=0)
    except KqError:
        raise
    except Exception as e:  # the harness's own error types are many; the message is what the user needs
        raise KqError(f"lm-eval against {base}: {e.__class__.__name__}: {str(e)[:300]}")
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {k.split(",")[0]: float(v) for k, v in metrics.items()
                     if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
    return out
