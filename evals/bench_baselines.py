"""Search time of the baselines gpp ranks (PipeDream, Piper) and of gpp, side by side with an earlier checkout.

gpp ranks PipeDream's and Piper's plans as candidates up to 32 devices, so
their searches are part of its own; on branchy graphs they were the slow part.
Each case is planned with the code under ``--before`` and with this
checkout, alternately, ``--repeat`` times, in fresh processes; the table gives
both medians, their ratio and whether the plans' predicted throughputs are
equal (they must be: the changes are to how the same DPs are evaluated).

Run: ``python -m graphpipe.evals.bench_baselines --before /path/to/old/checkout``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from .bench_gpp import plan_in_checkout
from .common import DATA_DIR

__all__ = ["CASES", "main"]

PROFILES = os.path.join(DATA_DIR, "pipedream-profiles")

CASES = {  # name -> (model spec or profile name, devices, batch size, strategy)
    "gnmt gpp": ("profile:gnmt", 8, 64, "gpp"),
    "gnmt piper": ("profile:gnmt", 8, 64, "piper"),
    "candle-uno 4 branches gpp": ("candle-uno:branches=4", 8, 128, "gpp"),
    "candle-uno 4 branches pipedream": ("candle-uno:branches=4", 8, 128, "pipedream"),
}


def _spec(spec: str) -> str:
    if spec.startswith("profile:"):
        return os.path.join(PROFILES, spec.split(":", 1)[1], "graph.txt")
    return spec


def _run(root: str, name: str) -> dict:
    spec, n, batch, strategy = CASES[name]
    return plan_in_checkout(root, _spec(spec), n, batch, strategy)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="root of a checkout of earlier code")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if not os.path.isdir(os.path.join(args.before, "graphpipe")):
        ap.error(f"--before {args.before!r} holds no graphpipe package")
    names = args.cases.split(",")
    for name in names:
        if name not in CASES:
            ap.error(f"unknown case {name!r}; one of {', '.join(CASES)}")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in names:
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.repeat):
            for label, root in (("before", args.before), ("after", here)):
                runs[label].append(_run(root, name))
        before = statistics.median(r["time_s"] for r in runs["before"])
        after = statistics.median(r["time_s"] for r in runs["after"])
        same = runs["before"][-1]["throughput"] == runs["after"][-1]["throughput"]
        print(f"{name:32s} before {before:6.2f} s  after {after:6.2f} s  x{before / after:.2f}  "
              f"same plan throughput: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
