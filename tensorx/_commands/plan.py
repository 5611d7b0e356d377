"""``tensorx plan MODULE:FACTORY``: print the transfer plan of a model.

``FACTORY`` is a callable in ``MODULE`` that returns a ``torch.nn.Module`` (the current
directory is importable, as with ``python -m``). Planning does no I/O and builds no arenas.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tensorx.errors import TensorxError, UsageError

__all__ = ["add_parser", "load_factory", "main", "run"]


def add_parser(subparsers: Any) -> None:
    """Register the ``plan`` command on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "plan", help="print the transfer plan of a model",
        description=__doc__.splitlines()[0] if __doc__ else None)
    _arguments(parser)
    parser.set_defaults(func=run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a callable returning the model, e.g. mypkg.models:resnet50")
    parser.add_argument("--shards", type=int, default=1, help="parameter-server shards")
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20,
                        help="split tensors larger than this (default 4 MiB)")
    parser.add_argument("--alignment", type=int, default=64, help="entry alignment in bytes")
    parser.add_argument("--include-buffers", action="store_true",
                        help="plan buffers (e.g. batch-norm statistics) too")
    parser.add_argument("--sparse-max-rows", type=int, default=None,
                        help="declared maximum rows of a sparse gradient per step")
    parser.add_argument("--summary", action="store_true", help="print only the summary")
    parser.add_argument("--max-rows", type=int, default=None, help="table rows to print")


def load_factory(target: str) -> Callable[[], Any]:
    """Import ``MODULE:FACTORY``; UsageError when it cannot be found."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FACTORY, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def run(args: argparse.Namespace) -> int:
    """Print the plan; return the exit status (2 on a usage error)."""
    from tensorx.graph_analyzer import GraphAnalyzer  # noqa: PLC0415 (imports torch: when the subcommand runs, not on --help)

    try:
        model = load_factory(args.target)()
        plan = GraphAnalyzer(model, num_shards=args.shards, chunk_bytes=args.chunk_bytes,
                             alignment=args.alignment, include_buffers=args.include_buffers,
                             sparse_max_rows=args.sparse_max_rows).plan()
    except TensorxError as exc:
        print(f"tensorx plan: error: {exc}", file=sys.stderr)
        return 2
    print(plan.summary() if args.summary else plan.describe(args.max_rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``plan`` on its own (``python -m tensorx._commands.plan``)."""
    parser = argparse.ArgumentParser(prog="tensorx plan", description=__doc__)
    _arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
