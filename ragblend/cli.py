"""Command line: ``ragblend demo | bench | warmup | cache | serve``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each subcommand lives in its own module exposing add_parser(subparsers).
COMMANDS = {
    "demo": "ragblend.demo",
    "bench": "ragblend.bench.command",
    "warmup": "ragblend.warmup.command",
    "cache": "ragblend.store.command",
    "serve": "ragblend.serving.command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragblend", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    from ragblend.errors import RagblendError

    try:
        return int(args.func(args) or 0)
    except RagblendError as exc:
        print(f"ragblend: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
