"""Simulator fidelity: predicted vs measured iteration time and activation memory of real runtime runs.

One point = (model, strategy, schedule) planned and run on ``devices`` CPU
ranks (gloo, one torch thread per rank). The cost model is calibrated the way
a user would (``graphpipe profile``): op times from
:func:`graphpipe.frontend.profile.profile_model` fitted to ``alpha + beta*b``, a cluster
whose link latency/bandwidth come from gloo between local processes, and the
measured slowdown of the model's training step when several ranks compute at
once (cores, memory bandwidth and cache shared) (see
:mod:`graphpipe.evals.bench_runtime`, whose calibration helpers this reuses). Ranks,
profile and calibration are pinned to CPUs of their own when the host has
enough (:func:`graphpipe.evals.bench_runtime.auto_cpus_per_rank`).

Beside the time error, each point reports the memory error of the same run:
the per-device peak bytes saved for backward, measured
(:class:`graphpipe.runtime.measure.SavedBytesMeter`) against the simulator's
``peak_activation_bytes`` (worst device of the plan).
"""

from __future__ import annotations

import functools
from typing import Any

from . import bench_runtime as br
from graphpipe.cluster import cluster_from_dict

__all__ = ["measure"]


@functools.lru_cache(maxsize=8)
def _graph(model: str, quick: bool, pin: int):
    return br.calibrated_graph(model, batch_sizes=(2, 8) if quick else (1, 2, 4, 8, 16), repeats=3 if quick else 7,
                               cpus_per_rank=pin)


@functools.lru_cache(maxsize=4)
def _link(ranks: int, pin: int) -> dict[str, Any]:
    return br.measure_link(ranks=ranks, repeats=5, cpus_per_rank=pin)


@functools.lru_cache(maxsize=8)
def _share(ranks: int, model: str, quick: bool, pin: int) -> dict[str, Any]:
    return br.measure_cpu_share(ranks, n=4 if quick else 20, spec=model, cpus_per_rank=pin)


def measure(model: str, strategy: str, schedule: str | None, devices: int, batch_size: int, steps: int,
            quick: bool = False) -> dict[str, Any]:
    """Plan on the calibrated cost model, run it for real, compare the iteration times."""
    from graphpipe.runtime import RunOptions, run_plan

    pin = br.auto_cpus_per_rank(devices)
    raw = _graph(model, quick, pin)
    cluster = cluster_from_dict(br.cpu_cluster_doc(_link(devices, pin), devices))
    plan = br.plan_for(model, raw, cluster, batch_size, strategy, schedule)
    predicted_s, slowdown, concurrency = br.predict_calibrated(plan, raw, _share(devices, model, quick, pin))
    result = run_plan(plan, RunOptions(steps=steps, warmup_steps=1, cpus_per_rank=pin))
    measured_s = result.measured.iteration_time_s
    from graphpipe.runtime.measure import memory_error

    used = plan.stage_graph.devices_used()
    mem_measured = [result.measured.peak_activation_bytes[d] for d in used]
    mem_predicted = [plan.predicted["peak_activation_bytes"][d] for d in used]
    return {
        "devices": devices,
        "schedule": plan.schedule.name,
        "num_stages": plan.stage_graph.num_stages,
        "predicted_s": predicted_s,
        "predicted_profile_only_s": plan.predicted["iteration_time_s"],
        "measured_s": measured_s,
        "error_frac": abs(predicted_s - measured_s) / measured_s,
        "memory_error_frac": memory_error(mem_measured, mem_predicted),
        "measured_activation_bytes": mem_measured,
        "predicted_activation_bytes": mem_predicted,
        "cpu_slowdown": slowdown,
        "cpus_per_rank": pin,
        "mean_busy_ranks": concurrency,
        "measured_throughput": result.measured.throughput,
    }
