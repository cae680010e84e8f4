"""gpp's search time: the in-process ``plan.search["time_s"]``, median of ``--repeat`` runs.

    python -m graphpipe.evals.bench_gpp [--repeat 5] [--cases mmt,dlrm,...] [--out evals] [--piper]
                                        [--before DIR] [--calls]

Cases (v100 preset): mmt, dlrm, candle-uno at 32 devices and batch 16 per
device; the MMT-shaped graphs of ``data/synthetic`` at 32 devices
and batch 256; ``candle-uno:branches=16`` on 1024 devices (batch 16 per
device). Each row gives the median and the spread of the full ``make_plan``
(device-count loop and sequential candidates included), the throughput, and
how the time splits: how many device counts were searched
(``device_counts_tried``) and which space won. ``--piper`` adds Piper's time
beside gpp's on mmt at 8, 16 and 32 devices (one run each: it is slow).

``--before DIR`` (a checkout's root, e.g. ``git worktree add /tmp/old REV``
or ``git archive REV graphpipe | tar -x -C DIR``): every repetition runs the
same ``make_plan`` once with that code and once with this one, alternately,
each in a fresh process, so both see the same load; the row gains the
before median, the ratio of medians and whether the two plans' throughputs
are equal. ``--calls`` adds the Python function calls of one run (cProfile;
with ``--before``, of both): a measure of work that other jobs on the
machine do not change.

Timings are of the machine it runs on; the figures in REPORT.md say which.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from .common import DATA_DIR, write_result
from graphpipe.cluster import preset
from graphpipe.models import load_model
from graphpipe.search.planner import make_plan

__all__ = ["main", "CASES"]

SYNTHETIC = os.path.join(DATA_DIR, "synthetic")

CASES = {  # name -> (model spec, devices, batch size)
    "mmt": ("mmt", 32, 512),
    "dlrm": ("dlrm", 32, 512),
    "candle-uno": ("candle-uno", 32, 512),
    "mmt-shaped-4x8": ("mmt-shaped-4x8.json", 32, 256),
    "mmt-shaped-4x16": ("mmt-shaped-4x16.json", 32, 256),
    "mmt-shaped-7x4": ("mmt-shaped-7x4.json", 32, 256),
    "mmt-shaped-16x4": ("mmt-shaped-16x4.json", 32, 256),
    "candle-uno-16br-1024": ("candle-uno:branches=16", 1024, 16 * 1024),
}


def _spec(spec: str) -> str:
    return os.path.join(SYNTHETIC, spec) if spec.endswith(".json") else spec


def bench(name: str, repeat: int) -> dict:
    spec, n, batch = CASES[name]
    cluster = preset("v100", n)
    graph = load_model(_spec(spec), cluster.device).graph
    times, plan = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        plan = make_plan(name, graph, cluster, batch, "gpp")
        times.append(plan.search.get("time_s", time.perf_counter() - started))
    return {"case": name, "devices": n, "batch_size": batch, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "repeat": repeat,
            "throughput": plan.predicted["throughput"], "space": plan.search.get("space"),
            "device_counts_tried": plan.search.get("device_counts_tried"),
            "devices_used": len(plan.stage_graph.devices_used())}


_ONE_RUN = """
import cProfile, json, pstats, sys
sys.path.insert(0, sys.argv[1])
from graphpipe.cluster import preset
from graphpipe.models import load_model
from graphpipe.search.planner import make_plan
spec, n, batch, strategy, calls = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1"
cluster = preset("v100", n)
graph = load_model(spec, cluster.device).graph
profile = cProfile.Profile() if calls else None
if calls:
    profile.enable()
plan = make_plan("bench", graph, cluster, batch, strategy)
if calls:
    profile.disable()
print(json.dumps({"time_s": plan.search["time_s"], "throughput": plan.predicted["throughput"],
                  "calls": pstats.Stats(profile).total_calls if calls else None}))
"""


def plan_in_checkout(root: str, spec: str, n: int, batch: int, strategy: str = "gpp", calls: bool = False) -> dict:
    """One ``make_plan`` of ``spec`` on ``n`` v100s with the graphpipe package under ``root``, in a fresh process:
    its search seconds, predicted throughput and (``calls``) function-call count."""
    out = subprocess.run([sys.executable, "-c", _ONE_RUN, os.path.abspath(root), spec, str(n), str(batch), strategy,
                          "1" if calls else "0"], capture_output=True, text=True, check=True, cwd=os.path.dirname(
                              os.path.abspath(root)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(root: str, name: str, calls: bool = False) -> dict:
    """One ``make_plan`` of case ``name`` with the graphpipe package under ``root``, in a fresh process."""
    spec, n, batch = CASES[name]
    return plan_in_checkout(root, _spec(spec), n, batch, calls=calls)


def side_by_side(name: str, repeat: int, before: str, calls: bool = False) -> dict:
    """Case ``name`` with the code under ``before`` and with this checkout, alternately (module docstring)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec, n, batch = CASES[name]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(repeat):
        for label, root in (("before", before), ("after", here)):
            runs[label].append(_run(root, name))
    row = {"case": name, "devices": n, "batch_size": batch, "repeat": repeat}
    for label in ("before", "after"):
        times = [r["time_s"] for r in runs[label]]
        row.update({f"{label}_median_s": statistics.median(times), f"{label}_min_s": min(times),
                    f"{label}_max_s": max(times), f"{label}_throughput": runs[label][-1]["throughput"]})
        if calls:
            row[f"{label}_calls"] = _run(before if label == "before" else here, name, calls=True)["calls"]
    row["speedup"] = row["before_median_s"] / row["after_median_s"]
    row["same_throughput"] = row["before_throughput"] == row["after_throughput"]
    return row


def piper_vs_gpp(counts=(8, 16, 32)) -> list[dict]:
    rows = []
    for n in counts:
        cluster = preset("v100", n)
        graph = load_model("mmt", cluster.device).graph
        row = {"case": f"mmt piper/gpp at {n}", "devices": n, "batch_size": 16 * n}
        for strategy in ("gpp", "piper"):
            started = time.perf_counter()
            try:
                plan = make_plan("mmt", graph, cluster, 16 * n, strategy)
                row[f"{strategy}_s"] = plan.search["time_s"]
                row[f"{strategy}_throughput"] = plan.predicted["throughput"]
            except Exception as exc:  # noqa: BLE001 -- a refusal is a figure too
                row[f"{strategy}_s"] = time.perf_counter() - started
                row[f"{strategy}_error"] = str(exc)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default="evals")
    ap.add_argument("--piper", action="store_true")
    ap.add_argument("--before", help="root of a checkout of earlier code to time side by side")
    ap.add_argument("--calls", action="store_true", help="also count function calls (cProfile) of one run")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.before is not None and not os.path.isdir(os.path.join(args.before, "graphpipe")):
        ap.error(f"--before {args.before!r} holds no graphpipe package")
    names = args.cases.split(",")
    for name in names:
        if name not in CASES:
            ap.error(f"unknown case {name!r}; one of {', '.join(CASES)}")
    rows = []
    for name in names:
        if args.before is not None:
            row = side_by_side(name, args.repeat, args.before, args.calls)
            print(f"{name:22s} {row['devices']:5d} dev  before {row['before_median_s']:7.2f} s  after "
                  f"{row['after_median_s']:7.2f} s  [{row['after_min_s']:.2f}, {row['after_max_s']:.2f}]  "
                  f"x{row['speedup']:.2f}  same plan throughput: {row['same_throughput']}"
                  + (f"  calls {row['before_calls']:,} -> {row['after_calls']:,}" if args.calls else ""), flush=True)
        else:
            row = bench(name, args.repeat)
            print(f"{name:22s} {row['devices']:5d} dev  median {row['median_s']:7.2f} s  [{row['min_s']:.2f}, "
                  f"{row['max_s']:.2f}]  {row['throughput']:10.1f}/s  space {row['space']}  "
                  f"counts {row['device_counts_tried']}", flush=True)
        rows.append(row)
    if args.piper:
        for row in piper_vs_gpp():
            rows.append(row)
            print(row, flush=True)
    path = write_result(args.out, "bench_gpp", {"repeat": args.repeat, "cases": args.cases, "cpus": os.cpu_count(),
                                                "before": args.before, "load_average": os.getloadavg()}, rows)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
