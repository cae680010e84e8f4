"""A run's start-up: ranks spawned afresh, forked by a preloaded forkserver, and given the launcher's capture.

    python -m graphpipe.evals.bench_launch [--spec twobranch:small] [--ranks 3] [--repeat 5] [--out evals]

One plan of a small model is made once; then, in turn, three ways of
starting its ranks:

* ``spawn``: ``GRAPHPIPE_START_METHOD=spawn GRAPHPIPE_SHIP_CAPTURE=off``:
  every rank imports torch, the runtime and export, and captures the model,
  itself, as under ``torchrun``;
* ``forkserver``: ``GRAPHPIPE_SHIP_CAPTURE=off``: a server imports them
  once and forks the ranks, each of which still captures the model;
* ``shipped``: the default on a CPU: forked, and each rank rebuilds the
  capture the launcher made in its preflight instead of exporting
  (:mod:`graphpipe.runtime.shipping`).

Each is timed two ways:

* ``command``: ``graphpipe run PLAN --steps 2`` as a fresh command (the
  server starts with it);
* ``repeated``: one Python process runs the plan twice through
  ``graphpipe.runtime.run_plans`` and times the second launch (the server is
  already up, as for every launch after the first in a test session, an
  evaluation or a script).

The figures are each contestant's median wall time and the ratios to
``shipped``; on a small model a run is almost all start-up. Benchmarks are
not tests; with ``--out`` it writes ``OUT/results/bench_launch.json`` for
the report.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

WAYS_TO_START = {"spawn": {"GRAPHPIPE_START_METHOD": "spawn", "GRAPHPIPE_SHIP_CAPTURE": "off"},
                 "forkserver": {"GRAPHPIPE_START_METHOD": "forkserver", "GRAPHPIPE_SHIP_CAPTURE": "off"},
                 "shipped": {"GRAPHPIPE_START_METHOD": "forkserver", "GRAPHPIPE_SHIP_CAPTURE": "on"}}
METHODS = tuple(WAYS_TO_START)


_REPEATED = """
import sys, time
from graphpipe.plan import read_plan
from graphpipe.runtime import RunOptions, run_plans
plan = read_plan(sys.argv[1])
run_plans([(plan, RunOptions(steps=2))])
t0 = time.perf_counter()
run_plans([(plan, RunOptions(steps=2))])
print(time.perf_counter() - t0)
"""


def _timed(argv: list[str], env: dict[str, str], prints_time: bool) -> float:
    """Wall seconds of the command, or, with ``prints_time``, the seconds it prints last."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return float(proc.stdout.split()[-1]) if prints_time else elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="twobranch:small")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None, help="write OUT/results/bench_launch.json")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "graphpipe"]
    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "plan.json")
        subprocess.run(cmd + ["plan", args.spec, "--devices", str(args.ranks), "--batch-size", str(4 * args.ranks),
                              "--micro-batch-size", "4", "--out", plan], check=True, capture_output=True)
        ways = {"command": cmd + ["--progress", "off", "run", plan, "--steps", "2"],
                "repeated": [sys.executable, "-c", _REPEATED, plan]}
        times: dict[tuple[str, str], list[float]] = {(w, m): [] for w in ways for m in METHODS}
        for i in range(args.repeat + 1):  # the first round warms the page cache and is dropped
            for way, argv in ways.items():
                for method in METHODS:
                    t = _timed(argv, {**os.environ, **WAYS_TO_START[method], "GRAPHPIPE_PROGRESS": "off"},
                               prints_time=way == "repeated")
                    if i:
                        times[(way, method)].append(t)
    rows = [{"launch": w, "start_method": m, "ranks": args.ranks, "median_s": statistics.median(t),
             "range_s": f"{min(t):.2f}-{max(t):.2f}", "runs": len(t)} for (w, m), t in times.items()]
    ratios = {f"{w}_{m}_over_shipped": statistics.median(times[(w, m)]) / statistics.median(times[(w, "shipped")])
              for w in ways for m in METHODS if m != "shipped"}
    for r in rows:
        print(f"{r['launch']:<9} {r['start_method']:<11} {r['ranks']} ranks  median {r['median_s']:.2f} s  "
              f"({r['range_s']})")
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    if args.out:
        from graphpipe.evals.common import write_result

        config = {"spec": args.spec, "ranks": args.ranks, "repeat": args.repeat, "steps": 2}
        print("wrote", write_result(args.out, "bench_launch", config, rows, ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
