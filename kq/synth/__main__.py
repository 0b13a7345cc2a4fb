"""`python -m kq.synth FAMILY OUT_DIR [key=value ...]` — generate a synthetic checkpoint;
`python -m kq.synth --list` prints the families and their options.

Values are parsed as JSON where they parse (3, true, ["full","shared"]), else taken as
strings: `python -m kq.synth glm5 /tmp/g52 size=full num_layers=2 max_shard_bytes=4294967296`.
"""

from __future__ import annotations

import json
import sys

from . import FAMILIES, generate


def describe() -> str:
    lines = []
    for fam in FAMILIES.values():
        lines.append(f"{fam.name}: {fam.description}")
        for key, opt in fam.options.items():
            lines.append(f"    {key} = {opt.default!r}: {opt.help}")
    return "\n".join(lines)


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.strip() + "\n\n" + describe())
        return 0
    if len(argv) < 2:
        print("usage: python -m kq.synth FAMILY OUT_DIR [key=value ...]", file=sys.stderr)
        return 2
    options = {}
    for arg in argv[2:]:
        key, sep, value = arg.partition("=")
        if not sep:
            print(f"option {arg!r} is not key=value", file=sys.stderr)
            return 2
        options[key] = parse_value(value)
    seed = options.pop("seed", 0)
    try:
        path = generate(argv[0], argv[1], seed=seed, **options)
    except (ValueError, TypeError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
