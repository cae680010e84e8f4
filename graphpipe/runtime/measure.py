"""A real run as a :class:`graphpipe.sched.Timeline`, so traces and Gantt charts work for it.

The executor times every action on every rank (seconds from the iteration's
shared start). :func:`measured_timeline` turns those records into the
simulator's :class:`~graphpipe.sched.Timeline` through
:func:`graphpipe.sched.build_timeline`, so ``write_trace``, ``plot_gantt``
and ``plot_gantt_pair`` (simulated beside measured) take either.

An action record spans compute only: from the moment its inputs were in
(``start``) to the moment its outputs were posted (``end``); waiting for
inputs is bubble, as in the simulator. A gradient all-reduce record spans
issue to observed completion. The iteration time is the measured one
(max over ranks, all-reduces included).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from graphpipe.actions import Action
from graphpipe.plan import Plan

__all__ = ["measured_timeline", "summarize", "format_summary"]


def measured_timeline(plan: Plan, records: Iterable[Mapping[str, Any]], iteration_time_s: float | None = None):
    """Timeline of one measured iteration from the executor's per-rank records (dicts of ``TimedAction``)."""
    from graphpipe.sched import ActionRecord, AllReduceRecord, build_timeline

    sg = plan.stage_graph
    actions, allreduces = [], []
    seen_ar = {}
    for r in records:
        if r["kind"] == "AR":
            stage = sg.stages[r["stage_id"]]
            # One record per replica; the stage's all-reduce ends when its last replica is done.
            prev = seen_ar.get(stage.id)
            start = r["start"] if prev is None else min(prev[0], r["start"])
            end = r["end"] if prev is None else max(prev[1], r["end"])
            seen_ar[stage.id] = (start, end)
        else:
            actions.append(ActionRecord(r["rank"], Action(r["stage_id"], r["kind"], r["mb_id"]), r["start"], r["end"]))
    for stage_id, (start, end) in sorted(seen_ar.items()):
        stage = sg.stages[stage_id]
        allreduces.append(AllReduceRecord(stage_id, stage.devices, start, end, sg.param_bytes(stage_id)))
    return build_timeline(sg, plan.cluster, plan.schedule.name, actions, (), allreduces, source="measured",
                          iteration_time_s=iteration_time_s)


def summarize(plan: Plan, result: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--json`` object: measured figures, the plan's predicted figures, the check."""
    predicted = dict(plan.predicted)
    if not predicted:
        from graphpipe.sched import predicted_figures, simulate

        predicted = predicted_figures(simulate(plan.stage_graph, plan.schedule, plan.cluster))
    measured = dict(result["measured"])
    doc: dict[str, Any] = {
        "plan": {"model": plan.model, "strategy": plan.strategy, "schedule": plan.schedule.name,
                 "num_devices": plan.cluster.num_devices, "batch_size": plan.batch_size,
                 "num_stages": plan.stage_graph.num_stages},
        "measured": measured,
        "predicted": {k: predicted[k] for k in ("iteration_time_s", "throughput", "bubble_fraction",
                                                "peak_memory_bytes") if k in predicted},
        "losses": result.get("losses", []),
        "backend": result.get("backend"),
    }
    if result.get("rank_cpus"):
        doc["rank_cpus"] = result["rank_cpus"]
    if "iteration_time_s" in predicted and measured.get("iteration_time_s"):
        doc["prediction_error"] = abs(predicted["iteration_time_s"] - measured["iteration_time_s"]) / measured["iteration_time_s"]
    if "check" in result:
        doc["check"] = result["check"]
    if "baseline" in result:
        doc["baseline"] = result["baseline"]
    return doc


def format_summary(summary: dict) -> str:
    """The human-readable lines of a run's summary (:func:`summarize`): measured, predicted, losses, check."""
    m, p = summary["measured"], summary.get("predicted", {})
    lines = [f"plan: {summary['plan']['model']} strategy={summary['plan']['strategy']} "
             f"schedule={summary['plan']['schedule']} devices={summary['plan']['num_devices']} "
             f"batch={summary['plan']['batch_size']} backend={summary.get('backend')}"
             + (f" baseline={summary['baseline']}" if summary.get("baseline") else ""),
             f"measured:  iteration {m['iteration_time_s'] * 1e3:.3f} ms  throughput {m['throughput']:.1f} samples/s"
             f"  (median of {len(m['step_times_s'])} steps after {m['warmup_steps']} warm-up)"]
    if "iteration_time_s" in p:
        lines.append(f"predicted: iteration {p['iteration_time_s'] * 1e3:.3f} ms  throughput {p['throughput']:.1f} samples/s"
                     f"  (error {summary.get('prediction_error', float('nan')) * 100:.1f}% of measured)")
    if summary.get("losses"):
        lines.append("loss per step: " + " ".join(f"{x:.6g}" for x in summary["losses"]))
    if "check" in summary:
        c = summary["check"]
        lines.append(f"check: {'PASSED' if c['passed'] else 'FAILED'}  max_abs_diff {c['max_abs_diff']:.3g}  "
                     f"loss {c['loss']:.6g} vs {c['reference_loss']:.6g}  params {c['num_params_checked']}/{c['num_params']}"
                     f"  mismatches {c['num_mismatches']} (rtol {c['rtol']:g}, atol {c['atol']:g})")
    return "\n".join(lines) + "\n"
