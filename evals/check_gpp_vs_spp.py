"""Sweep: is gpp ever worse than the best sequential baseline? (the full grid)

The test suite samples this grid (tests/test_planner.py); this script runs all of it:
every zoo model (paper config) and every PipeDream profile in data/ at 2, 4, 8, 16 and 32
devices, v100 preset, batch 16 x devices, all four strategies through the one simulator.

    python -m graphpipe.evals.check_gpp_vs_spp [--out evals] [--jobs 2]
    python -m graphpipe.evals.check_gpp_vs_spp --recheck [--out evals]

Prints one line per point and a summary (the worst gpp / best-SPP ratio); exits 1 if
gpp loses anywhere or the sequential transformer is more than 2% below pipedream.

``--recheck`` re-plans only gpp (with its sequential candidates) at every point of the
committed ``results/gpp_vs_spp.json`` and compares its throughput with the recorded one:
after a change that should not move any plan, this says whether the sweep still holds
without re-running the baselines (minutes instead of hours). Exits 1 if any point moved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys

from .common import DATA_DIR, write_result
from graphpipe.models import load_model
from graphpipe.cluster import preset
from graphpipe.search.planner import compare, make_plan

__all__ = ["main"]

ZOO = ("mmt", "dlrm", "candle-uno", "transformer", "twobranch")
PROFILES = ("alexnet", "vgg16", "resnet18", "resnet50", "inception_v3", "nasnetamobile", "gnmt")
DEVICES = (2, 4, 8, 16, 32)


def _keyed_point(task: tuple[str, int]) -> tuple[tuple[str, int], dict]:
    return task, _point(task)


def _point(task: tuple[str, int]) -> dict:
    """One model at one device count: gpp against the best feasible sequential baseline."""
    model, n = task
    graph = load_model(model, device=preset("v100", 1).device).graph
    name = os.path.basename(model)
    res = {r["strategy"]: r for r in compare(name, graph, preset("v100", n), 16 * n)}
    spp = [r for s, r in res.items() if s != "gpp" and r["feasible"]]
    best = max(spp, key=lambda r: r["throughput"]) if spp else None
    gpp = res["gpp"]
    ratio = gpp["throughput"] / best["throughput"] if gpp["feasible"] and best else None
    lost = best is not None and (not gpp["feasible"] or ratio < 1 - 1e-9)
    print(f"{name:14} {n:3d}  gpp/best-SPP = {ratio if ratio is None else round(ratio, 4)}"
          f"  ({best and best['strategy']})", flush=True)
    return {"model": name, "devices": n, "gpp": gpp["throughput"], "best_spp": best and best["strategy"],
            "best_spp_throughput": best and best["throughput"], "ratio": ratio, "gpp_lost": lost}


def _model_spec(name: str, profiles_dir: str) -> str:
    return name if name in ZOO else os.path.join(profiles_dir, name)


def recheck(out: str, profiles_dir: str) -> int:
    """Re-plan gpp at every committed point; 0 when every throughput is the recorded one."""
    with open(os.path.join(out, "results", "gpp_vs_spp.json")) as f:
        rows = json.load(f)["rows"]
    moved = 0
    for row in rows:
        graph = load_model(_model_spec(row["model"], profiles_dir), device=preset("v100", 1).device).graph
        n = row["devices"]
        got = make_plan(row["model"], graph, preset("v100", n), 16 * n, "gpp").predicted["throughput"]
        same = abs(got - row["gpp"]) <= 1e-9 * row["gpp"]
        moved += not same
        print(f"{row['model']:14} {n:3d}  gpp {got:.6g}  recorded {row['gpp']:.6g}  {'same' if same else 'MOVED'}",
              flush=True)
    print(f"{len(rows)} points, {moved} moved")
    return 1 if moved else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.evals.check_gpp_vs_spp", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__)))
    parser.add_argument("--jobs", type=int, default=1, help="(model, devices) points swept in parallel processes")
    parser.add_argument("--profiles-dir", default=os.path.join(DATA_DIR, "pipedream-profiles"))
    parser.add_argument("--recheck", action="store_true",
                        help="re-plan only gpp at the committed points and compare (module docstring)")
    args = parser.parse_args(argv)
    if args.recheck:
        return recheck(args.out, args.profiles_dir)
    models = list(ZOO) + [os.path.join(args.profiles_dir, p) for p in PROFILES if os.path.isdir(os.path.join(args.profiles_dir, p))]
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    tasks = [(m, n) for m in models for n in DEVICES]
    # Each finished point is appended to a partial file at once: a sweep cut short keeps what it measured.
    partial = os.path.join(args.out, "results", "gpp_vs_spp.partial.jsonl")
    os.makedirs(os.path.dirname(partial), exist_ok=True)
    done: dict[tuple[str, int], dict] = {}
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    with open(partial, "w") as log, pool or contextlib.nullcontext():
        # In parallel one point per task, the most devices (the slowest) first.
        points = (pool.imap_unordered(_keyed_point, sorted(tasks, key=lambda t: -t[1]), chunksize=1) if pool
                  else map(_keyed_point, tasks))
        for task, row in points:
            done[task] = row
            log.write(json.dumps(row) + "\n")
            log.flush()
    rows = [done[t] for t in tasks]  # model, then device order
    ok = not any(r["gpp_lost"] for r in rows)
    transformer = [r for r in rows if r["model"] == "transformer"]
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    summary = {"points": len(rows), "gpp_lost": sum(r["gpp_lost"] for r in rows),
               "min_ratio": min(ratios) if ratios else None,
               "transformer_min_ratio": min((r["ratio"] for r in transformer if r["ratio"]), default=None)}
    ok &= summary["transformer_min_ratio"] is None or summary["transformer_min_ratio"] >= 0.98
    os.remove(partial)
    write_result(args.out, "gpp_vs_spp", {"models": [os.path.basename(m) for m in models], "devices": list(DEVICES),
                                          "samples_per_device": 16, "cluster": "v100"}, rows, summary)
    print(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
