"""The ``graphpipe`` command line (argparse).

Verbs: ``models``, ``inspect``, ``profile``, ``plan``, ``simulate``, ``run``,
``eval``. Each lives in its own module here with a ``register(subparsers)``
function. Bad input raises :class:`graphpipe.errors.GraphpipeError`, which
``main`` prints as one line ``graphpipe: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from graphpipe import __version__
from graphpipe.errors import GraphpipeError

__all__ = ["main", "build_parser"]

VERBS = ("models", "inspect", "profile", "plan", "simulate", "run", "eval")


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2 without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"graphpipe: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphpipe", description="Graph pipeline parallelism toolkit (GraphPipe, ASPLOS'25).")
    parser.add_argument("--version", action="version", version=f"graphpipe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level on stderr")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for verb in VERBS:
        try:
            module = importlib.import_module(f"graphpipe.cli.{verb.replace('-', '_')}_cmd")
        except ModuleNotFoundError as exc:
            if exc.name == f"graphpipe.cli.{verb}_cmd":
                continue  # verb not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except GraphpipeError as exc:
        sys.stderr.write(f"graphpipe: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("graphpipe: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
