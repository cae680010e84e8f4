"""Activation memory measured on real runs against the cost model (issue 15).

For every small zoo model x strategy {gpp, pipedream, gpipe} x schedule
{gpipe, 1f1b, graph-1f1b} x re-materialization {none, all} on ``--ranks``
CPU ranks (gloo): ``graphpipe run --check`` semantics, then per device the
peak bytes of tensors saved for backward (measured with
``saved_tensors_hooks``, :class:`graphpipe.runtime.measure.SavedBytesMeter`)
beside the simulator's ``peak_activation_bytes``, and the iteration-time
error beside it. Prints one row per run and the worst memory error; writes
``eval-out/memory_runtime.json``.

    python -m graphpipe.evals.memory_runtime --ranks 4            # the full matrix (90 runs)
    python -m graphpipe.evals.memory_runtime --ranks 3 --quick    # two models
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["matrix_plans", "memory_rows", "main"]

SMALL = ("mmt:small", "dlrm:small", "candle-uno:small", "transformer:small", "twobranch:small")
STRATEGIES = ("gpp", "pipedream", "gpipe")
SCHEDULES = ("gpipe", "1f1b", "graph-1f1b")
BATCH = 8


def matrix_plans(models, strategies, schedules, num_devices: int, recompute=("none", "all")) -> dict[str, Any]:
    """``{"model/strategy/schedule/recompute": Plan}``: micro-batch 2, batch 8, each schedule on the strategy's stages."""
    from dataclasses import replace

    from graphpipe import zoo
    from graphpipe.cluster import preset
    from graphpipe.errors import GraphpipeError
    from graphpipe.sched import make_schedule, predicted_figures, simulate
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    plans = {}
    for spec in models:
        graph = zoo.load_graph(spec)
        for strategy in strategies:
            for rc in recompute:
                try:
                    plan = make_plan(zoo.canonical_spec(spec), graph, preset("v100", num_devices), BATCH, strategy,
                                     SearchOptions(micro_batch_size=2, recompute=rc))
                except GraphpipeError as exc:
                    print(f"skip {spec}/{strategy}/{rc}: {exc}", file=sys.stderr)
                    continue
                for schedule in schedules:
                    p = plan
                    if schedule != p.schedule.name:
                        sched = make_schedule(schedule, p.stage_graph, p.cluster)
                        p = replace(p, schedule=sched, predicted=predicted_figures(simulate(p.stage_graph, sched,
                                                                                             p.cluster)))
                    plans[f"{spec}/{strategy}/{schedule}/{rc}"] = p
    return plans


def memory_rows(plans: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: check, per-device measured / predicted activation bytes, worst memory and time errors."""
    rows = []
    for (name, plan), result in zip(plans.items(), results):
        used = plan.stage_graph.devices_used()
        measured = result["measured"]["peak_activation_bytes"]
        predicted = plan.predicted["peak_activation_bytes"]
        errors = [abs(measured[d] - predicted[d]) / predicted[d] for d in used if predicted[d] > 0]
        t_pred, t_meas = plan.predicted["iteration_time_s"], result["measured"]["iteration_time_s"]
        rows.append({"run": name, "check": bool(result["check"]["passed"]),
                     "measured_bytes": [measured[d] for d in used], "predicted_bytes": [predicted[d] for d in used],
                     "memory_error": max(errors, default=0.0), "time_error": abs(t_pred - t_meas) / t_meas})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="mmt:small and candle-uno:small only")
    parser.add_argument("--out", default=os.path.join("eval-out", "memory_runtime.json"))
    args = parser.parse_args(argv)
    from graphpipe.runtime import RunOptions, run_plans

    models = ("mmt:small", "candle-uno:small") if args.quick else SMALL
    plans = matrix_plans(models, STRATEGIES, SCHEDULES, args.ranks)
    results = run_plans([(p, RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=300)) for p in plans.values()],
                        args.ranks)
    rows = memory_rows(plans, results)
    for r in rows:
        print(f"{r['run']:<48} check={'ok' if r['check'] else 'FAIL'}  memory error {r['memory_error'] * 100:5.1f}%"
              f"  time error {r['time_error'] * 100:5.1f}%  measured/predicted MB "
              + " ".join(f"{m / 1e6:.3g}/{p / 1e6:.3g}" for m, p in zip(r["measured_bytes"], r["predicted_bytes"])))
    worst = max(rows, key=lambda r: r["memory_error"])
    print(f"worst memory error {worst['memory_error'] * 100:.1f}% ({worst['run']}); "
          f"{sum(r['check'] for r in rows)}/{len(rows)} checks passed")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)
    return 0 if all(r["check"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
