"""A run's start-up: CPU ranks forked by a preloaded forkserver against ranks spawned afresh.

    python -m graphpipe.evals.bench_launch [--spec twobranch:small] [--ranks 3] [--repeat 5] [--out evals]

One plan of a small model is made once; ``graphpipe run PLAN --steps 2`` then
runs as a fresh command, alternately with ``GRAPHPIPE_START_METHOD=spawn``
(every rank imports torch, the runtime and export itself, as under
``torchrun``) and ``forkserver`` (the default on a CPU: the server imports
them once and forks the ranks). The figure is each contestant's median wall
time of the whole command, and their ratio; on a small model the command is
almost all start-up. Benchmarks are not tests; with ``--out`` it writes
``OUT/results/bench_launch.json`` for the report.
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

METHODS = ("spawn", "forkserver")


def _timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return elapsed


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
        run = cmd + ["run", plan, "--steps", "2", "--progress", "off"]
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for i in range(args.repeat + 1):  # the first round warms the page cache and is dropped
            for method in METHODS:
                t = _timed(run, {**os.environ, "GRAPHPIPE_START_METHOD": method})
                if i:
                    times[method].append(t)
    rows = [{"start_method": m, "ranks": args.ranks, "median_s": statistics.median(times[m]),
             "range_s": f"{min(times[m]):.2f}-{max(times[m]):.2f}", "runs": len(times[m])} for m in METHODS]
    ratio = rows[0]["median_s"] / rows[1]["median_s"]
    for r in rows:
        print(f"{r['start_method']:<11} {r['ranks']} ranks  median {r['median_s']:.2f} s  ({r['range_s']})")
    print(f"spawn / forkserver: {ratio:.2f}x")
    if args.out:
        from graphpipe.evals.common import write_result

        config = {"spec": args.spec, "ranks": args.ranks, "repeat": args.repeat, "steps": 2}
        print("wrote", write_result(args.out, "bench_launch", config, rows, {"spawn_over_forkserver": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
