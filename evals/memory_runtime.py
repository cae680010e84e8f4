"""Activation memory measured on real runs against the cost model.

For every small zoo model x strategy {gpp, pipedream, gpipe} x schedule
{gpipe, 1f1b, graph-1f1b} x re-materialization {none, all} on ``--ranks``
CPU ranks (gloo): ``graphpipe run --check`` semantics, then per device the
peak bytes of tensors saved for backward (measured with
``saved_tensors_hooks``, :class:`graphpipe.runtime.measure.SavedBytesMeter`)
beside the simulator's ``peak_activation_bytes``, and the iteration-time
error beside it. Prints one row per run and the worst memory error; writes
``OUT/results/memory-runtime.json`` (``graphpipe eval memory-runtime`` runs the same and adds the
REPORT section).

    python -m graphpipe.evals.memory_runtime --out evals          # the full matrix (90 runs, 4 ranks; ~1.5 min)
    python -m graphpipe.evals.memory_runtime --quick              # one model, 2 ranks
    python -m graphpipe.evals.memory_runtime --precision bf16 --out evals   # the same under bf16 autocast
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graphpipe.runtime.results import RunResult

__all__ = ["matrix_plans", "memory_rows", "summary", "config", "run", "main"]

SMALL = ("mmt:small", "dlrm:small", "candle-uno:small", "transformer:small", "twobranch:small")
STRATEGIES = ("gpp", "pipedream", "gpipe")
SCHEDULES = ("gpipe", "1f1b", "graph-1f1b")
BATCH = 8


def matrix_plans(models, strategies, schedules, num_devices: int, recompute=("none", "all"),
                 precision: str = "fp32") -> dict[str, Any]:
    """``{"model/strategy/schedule/recompute": Plan}``: micro-batch 2, batch 8, each schedule on the strategy's stages.

    ``models`` are zoo specs or ``file.py:factory`` specs; activation bytes are captured at ``precision``.
    """
    from dataclasses import replace

    from graphpipe.cluster import preset
    from graphpipe.errors import GraphpipeError
    from graphpipe.models import load_model
    from graphpipe.sched import make_schedule, predicted_figures, simulate
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    plans = {}
    cluster = preset("v100", num_devices)
    if precision == "bf16":  # autocast's weight copies: 2 more bytes per parameter (as graphpipe plan does)
        cluster = replace(cluster, bytes_per_param=cluster.bytes_per_param + 2.0)
    for spec in models:
        source = load_model(spec, cluster.device, precision=precision)
        graph = source.graph
        for strategy in strategies:
            for rc in recompute:
                try:
                    plan = make_plan(source.model_id, graph, cluster, BATCH, strategy,
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
                    if precision != "fp32":
                        p = replace(p, search={**p.search, "precision": precision, "precision_from": "capture"})
                    plans[f"{_short(spec)}/{strategy}/{schedule}/{rc}"] = p
    return plans


def _short(spec: str) -> str:
    """A run name's model part: ``hf_models.py:clip`` for a factory (no slashes), the zoo spec otherwise."""
    return spec.rsplit("/", 1)[-1] if ".py:" in spec else spec


def memory_rows(plans: dict[str, Any], results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per run: check, per-device measured / predicted activation bytes, worst memory and time errors.

    ``time_error`` compares the measured iteration with the plan's simulation on the ``v100`` preset it was
    planned for (not calibrated to this host: ``graphpipe eval fidelity`` is the calibrated time error).
    """
    rows = []
    for (name, plan), result in zip(plans.items(), results):
        used = plan.stage_graph.devices_used()
        measured = result.measured.peak_activation_bytes
        predicted = plan.predicted["peak_activation_bytes"]
        errors = [abs(measured[d] - predicted[d]) / predicted[d] for d in used if predicted[d] > 0]
        t_pred, t_meas = plan.predicted["iteration_time_s"], result.measured.iteration_time_s
        model, strategy, schedule, recompute = name.split("/")
        rows.append({"run": name, "model": model, "strategy": strategy, "schedule": schedule, "recompute": recompute,
                     "check": bool(result.check.passed),
                     "measured_bytes": [measured[d] for d in used], "predicted_bytes": [predicted[d] for d in used],
                     "peak_measured_bytes": max(measured[d] for d in used),
                     "peak_predicted_bytes": max(predicted[d] for d in used),
                     "in_flight": list(plan.predicted.get("in_flight", [])),
                     "memory_error": max(errors, default=0.0), "time_error": abs(t_pred - t_meas) / t_meas})
    none = {r["run"][: -len("/none")]: r for r in rows if r["recompute"] == "none"}
    for r in rows:  # re-materialization against the same plan without it, on the fullest device
        other = none.get(r["run"][: -len("/all")]) if r["recompute"] == "all" else None
        r["below_none"] = None if other is None else r["peak_measured_bytes"] < other["peak_measured_bytes"]
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks passed, runs within 10%, the worst memory error, and where recompute all is not below none."""
    worst = max(rows, key=lambda r: r["memory_error"], default=None)
    pairs = [r for r in rows if r["below_none"] is not None]
    return {"runs": len(rows), "checks_passed": sum(r["check"] for r in rows),
            "within_10pct": sum(r["memory_error"] <= 0.10 for r in rows),
            "worst_memory_error": worst["memory_error"] if worst else None, "worst_run": worst["run"] if worst else None,
            "pairs": len(pairs), "all_below_none": sum(r["below_none"] for r in pairs),
            "not_below": [r["run"] for r in pairs if not r["below_none"]]}


def config(quick: bool) -> dict[str, Any]:
    """The matrix (quick: one model, strategy and schedule on 2 ranks)."""
    if quick:
        return {"models": ["mmt:small"], "strategies": ["gpp"], "schedules": ["graph-1f1b"], "ranks": 2,
                "batch_size": BATCH, "micro_batch_size": 2}
    return {"models": list(SMALL), "strategies": list(STRATEGIES), "schedules": list(SCHEDULES), "ranks": 4,
            "batch_size": BATCH, "micro_batch_size": 2}


def run(config: dict[str, Any], progress=None) -> tuple[list, dict]:
    """Plan the matrix, run every plan once on ``ranks`` CPU ranks (``--check``), return rows and summary."""
    precision = config.get("precision", "fp32")
    plans = matrix_plans(config["models"], config["strategies"], config["schedules"], config["ranks"],
                         tuple(config.get("recompute", ("none", "all"))), precision)
    return run_planned(plans, config["ranks"], precision, progress)


def run_planned(plans: dict[str, Any], ranks: int, precision: str = "fp32", progress=None) -> tuple[list, dict]:
    """:func:`run` on plans already made (``{"model/strategy/schedule/recompute": Plan}``, as :func:`matrix_plans`
    names them): one world of ``ranks`` CPU ranks runs them all."""
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.runtime.flags import BF16_CHECK_TOLERANCE

    tolerance = BF16_CHECK_TOLERANCE if precision == "bf16" else {}
    results = run_plans([(p, RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=300, precision=precision,
                                        **tolerance)) for p in plans.values()], ranks)
    rows = memory_rows(plans, results)
    if progress is not None:
        for r in rows:
            progress.step(r["run"])
    return rows, summary(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="CPU ranks (default 4; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="one model, strategy and schedule")
    parser.add_argument("--out", default="eval-out", help="writes OUT/results/memory-runtime.json")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="capture activation bytes and train at this precision (bf16: torch.autocast)")
    parser.add_argument("--models", default=None, help="comma-separated zoo or file.py:factory specs (default: the "
                                                        "small zoo models)")
    args = parser.parse_args(argv)
    from .common import write_result

    cfg = dict(config(args.quick), quick=args.quick, precision=args.precision)
    if args.models:
        cfg["models"] = [m for m in args.models.split(",") if m]
    if args.ranks is not None:
        cfg["ranks"] = args.ranks
    name = "memory-runtime" if args.precision == "fp32" else f"memory-runtime-{args.precision}"
    rows, summ = run(cfg)
    for r in rows:
        print(f"{r['run']:<48} check={'ok' if r['check'] else 'FAIL'}  memory error {r['memory_error'] * 100:5.1f}%"
              f"  time error {r['time_error'] * 100:5.1f}%  measured/predicted MB "
              + " ".join(f"{m / 1e6:.3g}/{p / 1e6:.3g}" for m, p in zip(r["measured_bytes"], r["predicted_bytes"])))
    print(f"worst memory error {summ['worst_memory_error'] * 100:.1f}% ({summ['worst_run']}); "
          f"{summ['within_10pct']}/{summ['runs']} within 10%; {summ['checks_passed']}/{summ['runs']} checks passed; "
          f"recompute all below none on the fullest device in {summ['all_below_none']}/{summ['pairs']} pairs")
    print(f"wrote {write_result(args.out, name, cfg, rows, summ)}")
    return 0 if summ["checks_passed"] == summ["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
