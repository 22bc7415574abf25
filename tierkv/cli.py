"""The ``tierkv`` command line: ``tierkv replay``, ``tierkv demo``, ...

Each subcommand lives in its own module and registers itself here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tierkv import demo_cli, plan_cli, replay_cli, serve_cli


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="tierkv", description="tierkv: a tiered paged KV cache for LLM inference servers"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    replay_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
