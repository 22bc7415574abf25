"""The ``tierkv`` command line (the front ends): ``tierkv demo``, ``tierkv serve``,
``tierkv replay``, ``tierkv plan``.

Each subcommand lives in its own module of this package (demo.py, serve.py, replay.py, plan.py)
and registers itself here; they use the library, which never imports them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tierkv.cli import demo, plan, replay, serve
from tierkv.errors import TierKVError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="tierkv", description="tierkv: a tiered paged KV cache for LLM inference servers"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    plan.add_parser(sub)
    replay.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2: bad arguments, with a message and
    no traceback; a typed error no subcommand caught is printed alike)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TierKVError as exc:  # typed: its message is for the user (no traceback)
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
