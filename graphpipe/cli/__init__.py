"""The ``graphpipe`` command line (argparse).

Verbs: ``models``, ``inspect``, ``profile``, ``plan``, ``simulate``, ``run``,
``eval``. Each lives in its own module here with a ``register(subparsers)``
function.

:func:`main` is the one boundary between the process and everything below it:

* bad input raises :class:`graphpipe.errors.GraphpipeError` (the user's code
  failing is a :class:`~graphpipe.errors.UserCodeError` naming their file and
  line): one line ``graphpipe: error: ...``, exit 2;
* ``MemoryError`` (the input outgrew the host's memory) is one line naming
  the verb, exit 2: what to change is the input, as for bad input;
* any other exception is our bug: one line ``graphpipe: internal error: ...``
  with the hint to re-run with ``-v``, exit 1; ``-v`` prints the traceback;
* Ctrl-C (exit 130) and SIGTERM (exit 143) unwind the stack like an
  exception, so every ``finally`` runs: temporary output files are removed and
  the ranks of a run are ended (:mod:`graphpipe.runtime.launch`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import traceback

from graphpipe import __version__
from graphpipe.errors import GraphpipeError
from graphpipe.progress import MODES

__all__ = ["main", "build_parser", "Terminated"]

VERBS = ("models", "inspect", "profile", "plan", "simulate", "run", "eval")


class Terminated(BaseException):
    """SIGTERM (or SIGHUP) arrived: raised in the main thread so cleanup code runs; not an error of anyone's."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line and exit 2 without the usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"graphpipe: error: {message}\n")
        sys.exit(2)


class _Formatter(logging.Formatter):
    """Warnings read ``graphpipe: warning: ...``; -v progress ``graphpipe: <module>: ...``."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"graphpipe: warning: {message}"
        return f"graphpipe: {record.name.rpartition('.')[2]}: {message}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="graphpipe", description="Graph pipeline parallelism toolkit (GraphPipe, ASPLOS'25).")
    parser.add_argument("--version", action="version", version=f"graphpipe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress at INFO level on stderr; full tracebacks on failures")
    parser.add_argument("--progress", default=None, choices=MODES,
                        help="progress of run, profile, eval and slow captures on stderr: auto (default: a bar at a "
                             "terminal, a line every 10 s elsewhere), bar, lines or off")
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


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


_UNSET = object()


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    verbose = "-v" in words or "--verbose" in words  # before parsing, for failures while parsing
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # ours for this call only: tests call main() many times
    handler.setFormatter(_Formatter())
    level = root.level
    previous = {}
    previous_progress: object = _UNSET
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, _raise_terminated)
    except ValueError:  # not the main thread (tests calling main()): leave signals alone
        previous = {}
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        verbose = args.verbose
        root.setLevel(logging.INFO if args.verbose else logging.WARNING)
        root.addHandler(handler)
        if args.progress is not None:  # the environment carries it to a run's ranks
            previous_progress = os.environ.get("GRAPHPIPE_PROGRESS")
            os.environ["GRAPHPIPE_PROGRESS"] = args.progress
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return 2
        return int(args.func(args) or 0)
    except GraphpipeError as exc:
        if verbose and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        sys.stderr.write(f"graphpipe: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("graphpipe: interrupted\n")
        return 130
    except Terminated as exc:
        sys.stderr.write(f"graphpipe: {exc}\n")
        return 128 + exc.signum
    except BrokenPipeError:
        return 0
    except SystemExit:
        raise
    except RecursionError:
        if verbose:
            traceback.print_exc(file=sys.stderr)
        sys.stderr.write("graphpipe: error: input nested too deeply to process (RecursionError); "
                         "re-run with -v for the traceback\n")
        return 1
    except MemoryError:  # the input is too large for this host: the user's to change, so exit 2 like bad input
        verb = next((w for w in words if w in VERBS), "graphpipe")
        sys.stderr.write(f"graphpipe: error: {verb} ran out of memory (MemoryError): this host cannot hold the work; "
                         f"use a smaller model, batch or device count, or a host with more memory\n")
        return 2
    except Exception as exc:  # noqa: BLE001 - the one place that turns our bugs into one line
        if verbose:
            traceback.print_exc(file=sys.stderr)
            sys.stderr.write(f"graphpipe: internal error: {type(exc).__name__}: {_one_line(exc)}\n")
        else:
            sys.stderr.write(f"graphpipe: internal error: {type(exc).__name__}: {_one_line(exc)} "
                             "(a bug in graphpipe; re-run with -v for the traceback and report it)\n")
        return 1
    finally:
        if previous_progress is not _UNSET:
            os.environ.pop("GRAPHPIPE_PROGRESS", None)
            if previous_progress is not None:
                os.environ["GRAPHPIPE_PROGRESS"] = previous_progress
        root.removeHandler(handler)
        root.setLevel(level)
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


# Verbs that only compute and write files: every file is written atomically and closed and every child process
# joined before main() returns, so nothing is left for the interpreter's teardown to release.
_FAST_EXIT_VERBS = frozenset({"models", "inspect", "plan", "simulate"})


def console_main() -> None:
    """The ``graphpipe`` command: :func:`main`, then for the verbs in ``_FAST_EXIT_VERBS`` an immediate exit.

    Python's orderly teardown after ``import torch`` (module dicts, weak
    finalizers, torch's own exit hooks) is a fixed cost paid after the answer
    is printed; for a planning command it is a large part of the wall time
    the user waits (evals/REPORT.md, bench_scale). ``main()`` itself, which
    tests call in-process, never exits.
    """
    code = main()
    verb = next((w for w in sys.argv[1:] if not w.startswith("-")), None)
    if verb in _FAST_EXIT_VERBS:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, OSError):  # a reader that went away: the answer is lost either way
                pass
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
