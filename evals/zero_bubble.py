"""Zero bubble on graph pipelines: graph-ZB vs graph-1F1B on gpp's plans; ZB-H1, ZB-V and DualPipeV vs 1F1B on a chain.

Each point plans the model once with gpp (on the sequential transformer
its stages form a chain) and re-schedules that same stage graph with every schedule of
the comparison, so the gain is the schedule's alone: same stages, devices
and micro-batch sizes. ``cpsat`` is the CP-SAT co-optimiser with split
backward (I/W) at the plan's micro-batch sizes (order only, a fixed time
limit per point; its status and optimality gap are in the rows). Figures are simulated on the ``v100`` preset with the
cost model's I/W split (analytical costs, so no measured W: half of each parameterised op's backward,
:data:`graphpipe.costs.WEIGHT_GRAD_SHARE`). Peak memory is the fullest
device's (model state + buffers + activations, which live until their W).
ZB-V and DualPipeV need their V layout (``2K`` stages on ``K`` devices), so
their rows cut the chain model anew at the plan's micro-batch size and
devices (column ``layout``); DualPipeV needs at least ``2K`` micro-batches.

    graphpipe eval zero-bubble --out evals
"""

from __future__ import annotations

from typing import Any

from .common import Progress
from graphpipe.errors import GraphpipeError

__all__ = ["zero_bubble_config", "run_zero_bubble", "num_points"]


def zero_bubble_config(quick: bool) -> dict[str, Any]:
    """Graph models with gpp at 8/16/32 devices; the sequential transformer with PipeDream's chain."""
    return {
        "graph_models": ["mmt:layers=2", "candle-uno:branches=3"] if quick else ["mmt", "dlrm", "candle-uno"],
        "devices": [4] if quick else [8, 16, 32],
        "graph_schedules": ["graph-1f1b", "graph-zb", "cpsat"],
        "cpsat_time_limit_s": 2.0 if quick else 10.0,  # per point; micro-batch sizes kept (order and I/W only)
        "chain_model": "transformer:layers=6" if quick else "transformer",  # a V on 4 devices: 8 ops
        "chain_strategy": "gpp",  # on a chain gpp's plan is a sequential pipeline (its stages are a chain)
        "chain_schedules": ["1f1b", "zb-h1", *V_SCHEDULES],
        "samples_per_device": 16,
        "cluster": "v100",
        # the Gantt figure: one small case where all four chain schedules fit, the same ops per device
        "gantt": {"model": "transformer:layers=6", "devices": 4, "batch_size": 8, "micro_batch_size": 1,
                  "schedules": ["1f1b", "zb-h1", *V_SCHEDULES]},
    }


def num_points(config: dict[str, Any]) -> int:
    return (len(config["graph_models"]) + 1) * len(config["devices"])


V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules of the V layout (2K stages of the chain on K devices, :func:`graphpipe.sched.v_shape_chain`): they
re-cut the model, at the plan's micro-batch size, instead of re-scheduling the plan's stages."""


def _schedule(name: str, plan, time_limit_s: float):
    """``(stage graph, schedule, extra row fields)``; ``cpsat`` is CP-SAT with split backward at the plan's
    sizes; ZB-V and DualPipeV run on the V layout of the plan's devices at the plan's micro-batch size."""
    from graphpipe.sched import make_schedule, v_shape_chain

    sg = plan.stage_graph
    if name in V_SCHEDULES:
        v = v_shape_chain(sg.graph, len(sg.devices_used()), sg.batch_size, sg.stages[0].micro_batch_size)
        return v, make_schedule(name, v, plan.cluster), {"layout": f"V: {v.num_stages} stages"}
    if name != "cpsat":
        return sg, make_schedule(name, sg, plan.cluster), {}
    from graphpipe.search.cpsat import optimize_plan

    solved = optimize_plan(plan, time_limit_s=time_limit_s, num_workers=2, seed=0, per_stage_micro_batch=False)
    return sg, solved.schedule, {"cpsat_status": solved.search["cpsat_status"], "cpsat_gap": solved.search["gap"],
                                 "split_backward": solved.search["cpsat_split_backward"]}


def _rows_for(model: str, n: int, batch: int, strategy: str, schedules: list[str], plan_fn,
              time_limit_s: float = 10.0) -> list[dict[str, Any]]:
    from graphpipe.sched import simulate

    base = {"model": model, "devices": n, "batch_size": batch, "strategy": strategy}
    try:
        plan = plan_fn(model, n, batch, strategy)
    except GraphpipeError as exc:
        return [{**base, "schedule": s, "feasible": False, "throughput": None, "error": str(exc)} for s in schedules]
    cluster = plan.cluster
    rows = []
    for name in schedules:
        try:
            stages, schedule, extra = _schedule(name, plan, time_limit_s)
            tl = simulate(stages, schedule, cluster)
        except GraphpipeError as exc:
            rows.append({**base, "schedule": name, "feasible": False, "throughput": None, "error": str(exc)})
            continue
        used = stages.devices_used()
        rows.append({**base, "schedule": name, "feasible": True, "throughput": tl.throughput,
                     "iteration_time_s": tl.iteration_time_s, "num_stages": stages.num_stages,
                     "depth": stages.depth(), "micro_batch_sizes": sorted({s.micro_batch_size for s in stages.stages}),
                     "peak_memory_bytes": max(tl.peak_memory_bytes),
                     "peak_memory_gb": max(tl.peak_memory_bytes) / 1e9,
                     "mean_bubble_fraction": sum(tl.bubble_fraction[d] for d in used) / len(used),
                     "max_in_flight": max(tl.in_flight), "error": None, **extra})
    reference = rows[0]
    for r in rows:
        ok = r["feasible"] and reference["feasible"]
        r["gain"] = r["throughput"] / reference["throughput"] if ok else None
        r["memory_ratio"] = r["peak_memory_bytes"] / reference["peak_memory_bytes"] if ok else None
    return rows


def gantt_plans(gantt: dict[str, Any], cluster_name: str) -> dict[str, Any]:
    """Schedule name -> plan of the Gantt figure's case: the chain schedules on an even chain of one stage per
    device, ZB-V and DualPipeV on the V of twice as many stages (each device holds the same ops' work)."""
    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.plan import Plan
    from graphpipe.sched import make_schedule, round_robin_chain, v_shape_chain

    spec, k = gantt["model"], gantt["devices"]
    graph, cluster = zoo.load_graph(spec), preset(cluster_name, k)
    chain = round_robin_chain(graph, k, 1, gantt["batch_size"], gantt["micro_batch_size"])
    v = v_shape_chain(graph, k, gantt["batch_size"], gantt["micro_batch_size"])
    return {name: Plan(model=zoo.canonical_spec(spec), stage_graph=v if name in V_SCHEDULES else chain,
                       cluster=cluster, strategy="custom",
                       schedule=make_schedule(name, v if name in V_SCHEDULES else chain, cluster))
            for name in gantt["schedules"]}


def run_zero_bubble(config: dict[str, Any], progress: Progress, plan_fn, out: str | None = None) -> tuple[list, dict]:
    """``plan_fn(model, devices, batch, strategy)`` makes the plan each point re-schedules; with ``out``, the
    Gantt figure's plans are written to ``out/results/zero-bubble-gantt-<schedule>.plan.json``."""
    rows = []
    for model in config["graph_models"]:
        for n in config["devices"]:
            batch = config["samples_per_device"] * n
            rows += _rows_for(model, n, batch, "gpp", config["graph_schedules"], plan_fn,
                              config["cpsat_time_limit_s"])
            progress.step(f"{model} {n}")
    for n in config["devices"]:
        batch = config["samples_per_device"] * n
        rows += _rows_for(config["chain_model"], n, batch, config["chain_strategy"], config["chain_schedules"], plan_fn)
        progress.step(f"{config['chain_model']} {n}")
    gains = [{"model": r["model"], "devices": r["devices"], "schedule": r["schedule"], "gain": r["gain"],
              "memory_ratio": r["memory_ratio"]}
             for r in rows if r["schedule"] not in (config["graph_schedules"][0], config["chain_schedules"][0])]
    summary: dict[str, Any] = {"gain_over_reference": gains}
    if out is not None and config.get("gantt"):
        import os

        from graphpipe.plan import write_plan

        summary["gantt_plans"] = {}
        for name, plan in gantt_plans(config["gantt"], config["cluster"]).items():
            path = os.path.join(out, "results", f"zero-bubble-gantt-{name}.plan.json")
            write_plan(path, plan)
            summary["gantt_plans"][name] = os.path.relpath(path, out)
    return rows, summary
