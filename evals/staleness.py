"""PipeDream's asynchronous pipelines: steady-state throughput, and what staleness costs in training.

Two experiments (registered in :mod:`graphpipe.evals.experiments`):

* ``async-throughput``: for the sequential transformer and CANDLE-Uno, the
  PipeDream plan at each device count, simulated under ``1f1b``
  (PipeDream-Flush), ``1f1b-async`` and ``2bw``: steady-state throughput
  (no flush bubble) and peak memory with the stashed weight versions; beside
  it, the same schedules measured on CPU ranks (small presets; the async
  figure is the median gap between consecutive mini-batches of the stream,
  the flush figure the median step).
* ``staleness``: a small branchy zoo model cut into a 4-stage pipeline on 4
  CPU ranks, trained for a few hundred steps with a fixed seed under
  ``1f1b``, ``1f1b-async`` (stashing), ``1f1b-async`` without stashing and
  ``2bw``; loss against step and against measured wall-clock time
  (PipeDream's Fig. 10 style), and the stashed weight bytes each needed.

The task is the zoo's: minimise the mean square of the model's output on
fresh N(0, 1) inputs every step (learnable: the loss falls as the output
layer shrinks; a teacher-student regression would need targets the zoo's
loss does not take). Wall-clock on a shared host is inflated and noisy;
times are medians, ratios are taken side by side in one run.
"""

from __future__ import annotations

from typing import Any

from graphpipe.cluster import preset

__all__ = ["async_throughput_config", "run_async_throughput", "staleness_config", "run_staleness"]

SCHEDULES = ("1f1b", "1f1b-async", "2bw")


def async_throughput_config(quick: bool) -> dict[str, Any]:
    return {"models": ["transformer", "candle-uno"], "devices": [4] if quick else [4, 8, 16],
            "samples_per_device": 16, "measured_models": ["transformer:small"] if quick else
            ["transformer:small", "candle-uno:small"], "measured_devices": 4, "measured_batch_size": 16,
            "measured_steps": 3 if quick else 10}


def _pipedream_plan(model: str, devices: int, batch_size: int):
    from graphpipe.frontend import zoo
    from graphpipe.search.planner import make_plan

    return make_plan(model, zoo.load_graph(model), preset("v100", devices), batch_size, "pipedream", schedule="1f1b")


def _as(plan, name: str):
    from graphpipe.sched.async_pipe import async_spec_for, with_async

    return plan if name == "1f1b" else with_async(plan, async_spec_for(name, plan.stage_graph))


def run_async_throughput(config: dict[str, Any], progress) -> tuple[list, dict]:
    from graphpipe.runtime import RunOptions, run_plans

    rows = []
    for model in config["models"]:
        for n in config["devices"]:
            base = _pipedream_plan(model, n, config["samples_per_device"] * n)
            flush = None
            for name in SCHEDULES:
                plan = _as(base, name)
                p = plan.predicted
                flush = flush or p["throughput"]
                rows.append({"source": "simulated", "model": model, "devices": n, "schedule": name,
                             "throughput": p["throughput"], "x_1f1b": p["throughput"] / flush,
                             "peak_memory_gb": max(p["peak_memory_bytes"]) / 1e9,
                             "stashed_gb": max(p.get("stashed_weight_bytes", [0.0])) / 1e9,
                             "replicated": any(st.num_replicas > 1 for st in plan.stage_graph.stages)})
            progress.step(f"{model} {n}")
    jobs, keys = [], []
    for model in config["measured_models"]:
        base = _pipedream_plan(model, config["measured_devices"], config["measured_batch_size"])
        for name in SCHEDULES:
            jobs.append((_as(base, name), RunOptions(steps=config["measured_steps"], warmup_steps=1)))
            keys.append((model, name))
    results = run_plans(jobs)
    flush_of = {}
    for (model, name), raw in zip(keys, results):
        m = raw.measured
        flush_of.setdefault(model, m.throughput)
        rows.append({"source": "measured (4 CPU ranks)", "model": model, "devices": config["measured_devices"],
                     "schedule": name, "throughput": m.throughput, "x_1f1b": m.throughput / flush_of[model],
                     "peak_memory_gb": None,
                     "stashed_gb": max(m.stashed_weight_bytes or [0.0]) / 1e9, "replicated": None})
    progress.step("measured")
    sim = [r for r in rows if r["source"] == "simulated" and r["schedule"] == "1f1b-async"]
    return rows, {"min_async_over_flush_simulated": min(r["x_1f1b"] for r in sim),
                  "async_over_flush_measured": {r["model"]: r["x_1f1b"] for r in rows
                                                if r["source"] != "simulated" and r["schedule"] == "1f1b-async"}}


def staleness_config(quick: bool) -> dict[str, Any]:
    return {"model": "candle-uno:small,branches=2,layers=2", "devices": 4, "batch_size": 16, "micro_batch_size": 2,
            "steps": 6 if quick else 300, "lr": 0.05, "seed": 0,
            "variants": [["1f1b", True], ["1f1b-async", True], ["1f1b-async", False], ["2bw", True]]}


def _pipeline(config: dict[str, Any]):
    """The model's op order cut into ``devices`` contiguous stages of near-equal time, one per rank."""
    from graphpipe.frontend import zoo
    from graphpipe.plan import Plan
    from graphpipe.sched import make_schedule, predicted_figures, simulate
    from graphpipe.sched.generators import round_robin_chain

    graph = zoo.load_graph(config["model"])
    cluster = preset("v100", config["devices"])
    sg = round_robin_chain(graph, config["devices"], 1, config["batch_size"], config["micro_batch_size"])
    schedule = make_schedule("1f1b", sg, cluster)
    return Plan(model=config["model"], stage_graph=sg, cluster=cluster, strategy="custom", schedule=schedule,
                predicted=predicted_figures(simulate(sg, schedule, cluster)))


def run_staleness(config: dict[str, Any], progress) -> tuple[list, dict]:
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.sched.async_pipe import async_spec_for, with_async

    base = _pipeline(config)
    jobs, labels = [], []
    for name, stash in config["variants"]:
        plan = base if name == "1f1b" else with_async(base, async_spec_for(name, base.stage_graph, stash=stash))
        jobs.append((plan, RunOptions(steps=config["steps"], warmup_steps=0 if name == "1f1b" else 1,
                                      lr=config["lr"], seed=config["seed"], timeout_s=300.0)))
        labels.append((name if stash else f"{name} (no stashing)", plan))
    results = run_plans(jobs)
    rows = []
    for (label, plan), raw in zip(labels, results):
        m = raw.measured
        if m.stream_time_s is not None:
            clock = _window_ends(raw.records, plan.stage_graph.num_micro_batches(0), config["steps"])
        else:  # flushing: one step after another (the optimizer steps between them are not timed)
            clock, t = [], 0.0
            for s in m.step_times_s:
                t += s
                clock.append(t)
        losses = raw.losses
        tail = max(1, len(losses) // 10)
        rows.append({"schedule": label, "final_loss": sum(losses[-tail:]) / tail, "first_loss": losses[0],
                     "wall_clock_s": clock[-1], "steady_iteration_ms": m.iteration_time_s * 1e3,
                     "stashed_weight_bytes": max(m.stashed_weight_bytes or [0.0]),
                     "peak_memory_bytes_predicted": max(plan.predicted["peak_memory_bytes"]),
                     "losses": losses, "clock_s": clock})
        progress.step(label)
    flush = rows[0]
    return rows, {"final_loss": {r["schedule"]: r["final_loss"] for r in rows},
                  "speed_vs_flush": {r["schedule"]: flush["wall_clock_s"] / r["wall_clock_s"] for r in rows}}


def _window_ends(records, per_window: int, steps: int) -> list[float]:
    """Seconds from the stream's start to the end of each mini-batch's last backward (any rank)."""
    ends = [0.0] * steps
    for r in records:
        if r["kind"] == "B":
            w = r["mb_id"] // per_window
            ends[w] = max(ends[w], r["end"])
    start = min(r["start"] for r in records)
    return [e - start for e in ends]
