"""The ``tensorx`` command: ``tensorx info``, ``tensorx plan``, ``tensorx ps``.

Each subcommand lives in ``tensorx/_commands/<name>.py`` and exposes ``add_parser``, which
registers its arguments and sets ``func`` (called with the parsed arguments, returns an
exit status).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

COMMANDS = ("info", "plan", "ps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorx", description="One-sided tensor exchange for parameter-server training.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-v: INFO, -vv: DEBUG)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"tensorx._commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
