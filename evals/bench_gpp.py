"""gpp's search time (issue 16): the in-process ``plan.search["time_s"]``, median of ``--repeat`` runs.

    python -m graphpipe.evals.bench_gpp [--repeat 5] [--cases mmt,dlrm,...] [--out evals] [--piper]

Cases (v100 preset): mmt, dlrm, candle-uno at 32 devices and batch 16 per
device; the MMT-shaped graphs of ``../shared/data/synthetic`` at 32 devices
and batch 256; ``candle-uno:branches=16`` on 1024 devices (batch 16 per
device). Each row gives the median and the spread of the full ``make_plan``
(device-count loop and sequential candidates included), the throughput, and
how the time splits: how many device counts were searched
(``device_counts_tried``) and which space won. ``--piper`` adds Piper's time
beside gpp's on mmt at 8, 16 and 32 devices (one run each: it is slow).

Timings are of the machine it runs on; the figures in REPORT.md say which.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .common import write_result
from graphpipe.cluster import preset
from graphpipe.models import load_model
from graphpipe.search.planner import make_plan

__all__ = ["main", "CASES"]

SYNTHETIC = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "synthetic")
if not os.path.isdir(SYNTHETIC):  # run from the checkout: ../shared beside it
    SYNTHETIC = os.path.join(os.getcwd(), "..", "shared", "data", "synthetic")

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
    args = ap.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            ap.error(f"unknown case {name!r}; one of {', '.join(CASES)}")
        row = bench(name, args.repeat)
        rows.append(row)
        print(f"{name:22s} {row['devices']:5d} dev  median {row['median_s']:7.2f} s  [{row['min_s']:.2f}, "
              f"{row['max_s']:.2f}]  {row['throughput']:10.1f}/s  space {row['space']}  "
              f"counts {row['device_counts_tried']}", flush=True)
    if args.piper:
        for row in piper_vs_gpp():
            rows.append(row)
            print(row, flush=True)
    path = write_result(args.out, "bench_gpp", {"repeat": args.repeat, "cases": args.cases, "cpus": os.cpu_count()},
                        rows)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
