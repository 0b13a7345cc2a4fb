"""The `kq` command line: one small module per command, wiring only.

A KqError (anything the user can fix) prints one line and exits 2; anything else is
a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import sys

import typer

from kq.errors import KqError, QuietExit

app = typer.Typer(
    name="kq",
    help="Quantize FP8 mixture-of-experts checkpoints (GLM-5.x, GLM-4.x, Kimi K2) to INT4 experts "
         "that SGLang serves. Start with `kq inspect SRC`, then `kq quantize SRC --out DIR`.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _register() -> None:
    from kq.cli import inspect_cmd, quantize, verify
    app.command("quantize")(quantize.quantize)
    app.command("inspect")(inspect_cmd.inspect)
    app.command("verify")(verify.verify)
    # Commands whose modules may be absent in a partial install register themselves here.
    for mod, name, fn in (("kq.cli.eval", "eval", "eval_cmd"), ("kq.cli.shard", "shard", "shard"),
                          ("kq.cli.publish", "publish", "publish"), ("kq.cli.card", "card", "card"),
                          ("kq.cli.config_cmd", "config", "config"), ("kq.cli.compare", "compare", "compare_cmd")):
        try:
            m = __import__(mod, fromlist=[fn])
        except ImportError:
            continue
        if hasattr(m, fn):
            app.command(name)(getattr(m, fn))


_register()


def main() -> None:
    code = _run()
    if _torchrun_rank() is not None:
        # A torchrun rank has written and flushed all it writes by now. Interpreter shutdown would
        # still destroy torch's and gloo's C++ objects beside Python's daemon threads in no fixed
        # order, and once in a CI run a rank died there (SIGABRT, "terminate called without an
        # active exception") after a complete, correct run, failing the whole launch. A rank skips
        # that shutdown: nothing is left for it to do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _torchrun_rank() -> str | None:
    """This process's RANK when launched as one of several ranks (torchrun sets WORLD_SIZE), else None."""
    return os.environ.get("RANK", "0") if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else None


def _run() -> int:
    """The command's exit code: 0, click's own, 2 for a user mistake (one line), 130 on Ctrl-C."""
    try:
        app()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        typer.echo(str(e.code), err=True)
        return 1
    except QuietExit:
        return 2   # torchrun: the lowest failing rank printed the line
    except KqError as e:
        rank = _torchrun_rank()
        typer.echo(f"kq: error: {'' if rank in (None, '0') else f'rank {rank}: '}{e}", err=True)
        return 2
    except KeyboardInterrupt:
        typer.echo("kq: interrupted; rerun the same command to resume", err=True)
        return 130
    return 0
