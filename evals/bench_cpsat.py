"""Benchmark of the CP-SAT co-optimiser: 8 stages x 32 micro-batches, 30 s on 2 workers.

Usage::

    python -m graphpipe.evals.bench_cpsat                       # the benchmark, one JSON object on stdout
    python -m graphpipe.evals.bench_cpsat --time-limit 60 --workers 4
    python -m graphpipe.evals.bench_cpsat --paper               # paper configs at 8 devices (gpp plans), see below
    python -m graphpipe.evals.bench_cpsat --out out             # also writes out/results/bench_cpsat[_paper].json

Benchmark cases (V100 preset, 16 GB, one device per stage, batch 128 at
micro-batch 4 = 32 micro-batches per stage, micro-batch sizes kept: the
solver chooses the order of 512 F/B tasks under the memory limit):

* ``transformer-chain``: the zoo's paper-size GPT-style ``transformer`` cut
  into 8 contiguous stages of equal compute;
* ``candle-uno-branches``: the ``candle-uno`` stage graph gpp plans at 8
  devices (7 branch stages feeding one head stage), re-sized to micro-batch 4;
* ``transformer-chain-sizes``: the first case with per-stage micro-batch
  sizes free (every divisor of 128: 255 optional micro-batches per stage,
  before :func:`graphpipe.search.cpsat_model.prune_sizes` leaves out the
  sizes that cannot beat the first phase's schedule; ``pruned_sizes`` lists
  them per stage).

For each: graph-1F1B's simulated makespan, CP-SAT's, its proven lower
bound, the gap reached within the limit, when the last improvement came,
and the (best, bound) trajectory from the progress callback.

``--paper`` measures, for mmt, dlrm, candle-uno, twobranch (gpp) and
transformer (pipedream, micro-batch 4) at 8 devices and batch 128 (the
evals' 16 samples per device): graph-1F1B's makespan over CP-SAT's lower
bound, and CP-SAT's makespan keeping gpp's sizes, with one size chosen for
all stages, and with per-stage sizes (the gain from per-stage sizes).

Timings depend on the machine; the JSON carries the environment beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from .common import environment, write_result
from graphpipe.frontend import zoo
from graphpipe.cluster import Cluster, preset
from graphpipe.search.common import SearchOptions
from graphpipe.search.cpsat import solve
from graphpipe.search.planner import make_plan
from graphpipe.stages import Stage, StageGraph

__all__ = ["main", "run", "run_paper", "benchmark_cases"]

BATCH_SIZE = 128
MICRO_BATCH = 4
NUM_DEVICES = 8


def _balanced_chain(graph, num_stages: int, batch_size: int, micro_batch: int) -> StageGraph:
    """Contiguous stages of about equal forward+backward time (the graph must be a chain)."""
    cost = [graph.fwd_time((i,), micro_batch) + graph.bwd_time((i,), micro_batch) for i in range(graph.num_ops)]
    total = sum(cost)
    stages, current, acc = [], [], 0.0
    for i, c in enumerate(cost):
        current.append(i)
        acc += c
        left_ops, left_stages = graph.num_ops - i - 1, num_stages - len(stages) - 1
        if left_stages > 0 and (acc >= total * (len(stages) + 1) / num_stages or left_ops == left_stages):
            stages.append(tuple(current))
            current = []
    stages.append(tuple(current))
    return StageGraph.build(graph, [Stage(k, ops, (k,), micro_batch) for k, ops in enumerate(stages)],
                            batch_size, num_stages)


def benchmark_cases(cluster: Cluster) -> dict[str, StageGraph]:
    chain = _balanced_chain(zoo.load_graph("transformer"), NUM_DEVICES, BATCH_SIZE, MICRO_BATCH)
    plan = make_plan("candle-uno", zoo.load_graph("candle-uno"), cluster, BATCH_SIZE, "gpp")
    sg = plan.stage_graph
    branches = replace(sg, stages=tuple(replace(s, micro_batch_size=MICRO_BATCH) for s in sg.stages))
    return {"transformer-chain": chain, "candle-uno-branches": branches}


def _solve_row(sg: StageGraph, cluster: Cluster, time_limit_s: float, workers: int, seed: int,
               **kwargs: Any) -> dict[str, Any]:
    trajectory: list[list[float]] = []
    started = time.monotonic()

    def progress(best_s: float, bound_s: float) -> None:
        point = [round(time.monotonic() - started, 3), best_s if best_s < float("inf") else None, bound_s]
        if not trajectory or trajectory[-1][1:] != point[1:]:
            trajectory.append(point)

    res = solve(sg, cluster, time_limit_s=time_limit_s, num_workers=workers, seed=seed, progress=progress, **kwargs)
    improved = [t for t, best, _ in trajectory if best is not None]
    last_improvement = None
    if improved:
        final = min(best for _, best, _ in trajectory if best is not None)
        last_improvement = next(t for t, best, _ in trajectory if best == final)
    return {
        "status": res.status,
        "heuristic_makespan_s": res.heuristic_makespan_s,
        "makespan_s": res.makespan_s,
        "lower_bound_s": res.lower_bound_s,
        "gap": res.gap,
        "speedup_vs_heuristic": res.heuristic_makespan_s / res.makespan_s,
        "heuristic_over_bound": res.heuristic_makespan_s / res.lower_bound_s if res.lower_bound_s > 0 else None,
        "solve_time_s": res.solve_time_s,
        "last_improvement_s": last_improvement,
        "used_heuristic": res.used_heuristic,
        "micro_batch_sizes": [s.micro_batch_size for s in res.stage_graph.stages],
        "pruned_sizes": [list(sizes) for sizes in res.pruned_sizes],
        "num_tasks": sum(2 * res.stage_graph.num_micro_batches(s) for s in range(res.stage_graph.num_stages)),
        "time_unit_s": res.time_unit_s,
        "rounding_slack_s": res.rounding_slack_s,
        "trajectory": trajectory if len(trajectory) <= 60 else trajectory[:: len(trajectory) // 60 + 1] + trajectory[-1:],
        "message": res.message,
    }


def run(time_limit_s: float = 30.0, workers: int = 2, seed: int = 0) -> dict[str, Any]:
    cluster = preset("v100", NUM_DEVICES)
    rows = []
    cases = benchmark_cases(cluster)
    runs = [(name, sg, False) for name, sg in cases.items()] + [("transformer-chain-sizes", cases["transformer-chain"], True)]
    for name, sg, free_sizes in runs:
        row = _solve_row(sg, cluster, time_limit_s, workers, seed, per_stage_micro_batch=free_sizes)
        rows.append({"case": name, "num_stages": sg.num_stages, "sizes_free": free_sizes,
                     "num_micro_batches": [sg.num_micro_batches(s) for s in range(sg.num_stages)], **row})
    config = {"time_limit_s": time_limit_s, "workers": workers, "seed": seed, "cluster": "v100",
              "num_devices": NUM_DEVICES, "batch_size": BATCH_SIZE, "micro_batch_size": MICRO_BATCH}
    return {"benchmark": "bench_cpsat", "config": config, "rows": rows}


PAPER_MODELS = (("mmt", "gpp", None), ("dlrm", "gpp", None), ("candle-uno", "gpp", None),
                ("twobranch", "gpp", None), ("transformer", "pipedream", 4))


def run_paper(time_limit_s: float = 30.0, workers: int = 2, seed: int = 0) -> dict[str, Any]:
    cluster = preset("v100", NUM_DEVICES)
    rows = []
    for spec, strategy, micro in PAPER_MODELS:
        plan = make_plan(spec, zoo.load_graph(spec), cluster, BATCH_SIZE, strategy,
                         SearchOptions(micro_batch_size=micro))
        sg = plan.stage_graph
        base = {"model": spec, "strategy": strategy, "num_stages": sg.num_stages, "depth": sg.depth(),
                "planned_sizes": [s.micro_batch_size for s in sg.stages]}
        for mode, kwargs in (("keep", {"per_stage_micro_batch": False}), ("uniform", {"uniform_size": True}),
                             ("per-stage", {})):
            row = _solve_row(sg, cluster, time_limit_s, workers, seed, **kwargs)
            row.pop("trajectory")
            rows.append({**base, "mode": mode, **row})
    summary = []
    for spec, _, _ in PAPER_MODELS:
        by = {r["mode"]: r for r in rows if r["model"] == spec}
        summary.append({
            "model": spec,
            "graph_1f1b_s": by["keep"]["heuristic_makespan_s"],
            "cpsat_keep_s": by["keep"]["makespan_s"],
            "graph_1f1b_over_keep_bound": by["keep"]["heuristic_over_bound"],
            "cpsat_uniform_s": by["uniform"]["makespan_s"],
            "cpsat_per_stage_s": by["per-stage"]["makespan_s"],
            "per_stage_gain_vs_uniform": by["uniform"]["makespan_s"] / by["per-stage"]["makespan_s"],
            "per_stage_bound_s": by["per-stage"]["lower_bound_s"],
        })
    config = {"time_limit_s": time_limit_s, "workers": workers, "seed": seed, "cluster": "v100",
              "num_devices": NUM_DEVICES, "batch_size": BATCH_SIZE, "models": [list(m) for m in PAPER_MODELS]}
    return {"benchmark": "bench_cpsat_paper", "config": config, "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.evals.bench_cpsat", description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0, help="CP-SAT seconds per solve (default 30)")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT workers (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paper", action="store_true", help="paper configs at 8 devices instead of the benchmark")
    parser.add_argument("--out", help="also write OUT/results/bench_cpsat[_paper].json")
    args = parser.parse_args(argv)
    runner = run_paper if args.paper else run
    doc = runner(args.time_limit, args.workers, args.seed)
    doc["environment"] = environment()
    if args.out:
        write_result(args.out, doc["benchmark"], doc["config"], doc["rows"],
                     summary={"models": doc["summary"]} if "summary" in doc else None)
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
