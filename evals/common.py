"""Shared plumbing for the evaluations: result files, environment, timing, progress.

Every experiment writes ``<out>/results/<name>.json``::

    {"experiment": name, "config": {...resolved config...}, "environment": {...versions, git SHA...},
     "rows": [...one dict per measured point...], "summary": {...}}

Plot and report scripts read only these files.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from graphpipe.graph import write_json_atomic
from graphpipe.progress import Progress as _Progress

__all__ = ["environment", "write_result", "read_result", "Progress", "median_time", "results_dir", "DATA_DIR",
           "chosen_cases"]

#: The repository's data folder (real PipeDream profiles, synthetic graphs; see its READMEs). evals/ sits
#: beside it in a checkout, and an editable install keeps that layout.
DATA_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "data"))


def results_dir(out: str) -> str:
    return os.path.join(out, "results")


def _git_sha() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is just "not installed"
        return None


def environment() -> dict[str, Any]:
    """Versions, machine and git SHA recorded beside every result."""
    import graphpipe

    return {
        "graphpipe": graphpipe.__version__,
        "git_sha": _git_sha(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "ortools": _version("ortools"),
        "networkx": _version("networkx"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(out: str, name: str, config: dict[str, Any], rows: list[dict[str, Any]],
                 summary: dict[str, Any] | None = None) -> str:
    path = os.path.join(results_dir(out), f"{name}.json")
    write_json_atomic(path, {"experiment": name, "config": config, "environment": environment(),
                             "rows": rows, "summary": summary or {}})
    return path


def read_result(out: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(results_dir(out), f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


class Progress(_Progress):
    """An experiment's points on stderr (:class:`graphpipe.progress.Progress`: a bar at a terminal, periodic lines
    elsewhere), named ``eval NAME``, with the current point's label beside the count."""

    def __init__(self, name: str, total: int, stream=None):
        # heartbeat: a line at once and every 10 s, though a paper-size point can take minutes
        super().__init__(f"eval {name}", total=max(total, 1), unit="point", stream=stream, heartbeat=True)

    def step(self, label: str = "") -> None:
        self.update(postfix=label[:60])

    def iterate(self, items: Sequence, label: Callable[[Any], str] = str) -> Iterable:
        for item in items:
            yield item
            self.step(label(item))
        self.close()


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls of ``fn`` and the last call's result."""
    times = []
    result = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def chosen_cases(only: str | None, known) -> list[str] | None:
    """The cases a ``--only a,b`` option names (all of ``known`` without it), or None after printing the
    unknown ones and the known ones to stderr (the script then exits 2)."""
    import sys

    cases = [c for c in only.split(",") if c] if only else list(known)
    unknown = [c for c in cases if c not in known]
    if unknown:
        print(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return None
    return cases
