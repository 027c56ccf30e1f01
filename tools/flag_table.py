"""A CLI subcommand's flags as a Markdown table, generated from its argparse parser.

Usage: ``python tools/flag_table.py serve`` prints the table; ``python tools/flag_table.py
serve --write docs/serving.md`` replaces the block between ``<!-- flags:serve -->`` and
``<!-- /flags:serve -->`` in that file. ``tests/test_serving_docs.py`` fails when the
documented table differs from the parser.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ragblend.cli import build_parser


def subparser(name: str) -> argparse.ArgumentParser:
    """The parser of ``ragblend <name>``."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def table(name: str) -> str:
    """One row per flag: its spellings (with the value's name), its default, its help."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in subparser(name)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(action.option_strings)
        if action.nargs != 0:
            flags += f" {action.metavar or action.dest.upper()}"
        if isinstance(action, argparse._AppendAction):
            flags += " (repeatable)"
        if action.choices:
            flags += " (" + " / ".join(str(c) for c in action.choices) + ")"
        default = "" if action.default in (None, [], False) else f"`{action.default}`"
        text = " ".join((action.help or "").split()).replace("|", "\\|")
        rows.append(f"| `{flags}` | {default} | {text} |")
    return "\n".join(rows) + "\n"


def block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- flags:{name} -->\n)(.*?)(<!-- /flags:{name} -->)", re.S)


def documented(name: str, path: Path) -> str | None:
    """The table documented in ``path`` for ``name`` (None without the markers)."""
    found = block(name).search(path.read_text())
    return found.group(2) if found else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", help="the subcommand, e.g. serve")
    ap.add_argument("--write", type=Path, help="replace the marked block in this file")
    args = ap.parse_args(argv)
    generated = table(args.command)
    if args.write is None:
        sys.stdout.write(generated)
        return 0
    text = args.write.read_text()
    if not block(args.command).search(text):
        print(f"no <!-- flags:{args.command} --> block in {args.write}", file=sys.stderr)
        return 1
    args.write.write_text(block(args.command).sub(lambda m: m[1] + generated + m[3], text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
