"""The GraphPipe paper's experiments as configs and runners (docs/design.md#papers).

Each experiment is a pair: ``<name>_config(quick) -> dict`` (the resolved
configuration, written beside the numbers) and ``run_<name>(config, progress)
-> (rows, summary)``. :func:`run_experiment` ties them to a result file.
``--quick`` shrinks every sweep (few devices, small branch counts, one
repetition) so the whole set runs in CI in a few minutes; the full sweep is
what ``evals/REPORT.md`` is generated from.

Cluster: the ``v100`` preset (the paper's Summit nodes). Batch size: the
paper scales the mini-batch with the device count; we use ``16 x devices``
samples per iteration (weak scaling) unless a config says otherwise.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
from typing import Any, Callable

from . import staleness
from .common import Progress, write_result
from .zero_bubble import num_points as zero_bubble_points, zero_bubble_config
from graphpipe.cluster import preset
from graphpipe.errors import GraphpipeError
from graphpipe.search.common import SearchOptions

__all__ = ["EXPERIMENTS", "run_experiment", "ORDER"]

log = logging.getLogger(__name__)

SPP = ("pipedream", "piper", "gpipe")
STRATEGIES = ("gpp",) + SPP
PAPER_MODELS = ("mmt", "dlrm", "candle-uno")
SAMPLES_PER_DEVICE = 16


@functools.lru_cache(maxsize=64)
def _graph(spec: str, cluster_name: str = "v100"):
    from graphpipe.frontend import zoo
    return zoo.load_graph(spec, device=preset(cluster_name, 1).device)


def _plan(spec: str, devices: int, batch_size: int, strategy: str, options: SearchOptions | None = None,
          schedule: str | None = None, time_limit_s: float = 10.0):
    from graphpipe.search.planner import make_plan

    cluster = preset("v100", devices)
    return make_plan(spec, _graph(spec), cluster, batch_size, strategy, options or SearchOptions(),
                     schedule=schedule, time_limit_s=time_limit_s)


def _row(plan) -> dict[str, Any]:
    sg = plan.stage_graph
    pred = plan.predicted
    return {
        "feasible": True,
        "throughput": pred["throughput"],
        "iteration_time_s": pred["iteration_time_s"],
        "search_time_s": plan.search.get("time_s"),
        "num_stages": sg.num_stages,
        "depth": sg.depth(),
        "micro_batch_sizes": sorted({s.micro_batch_size for s in sg.stages}),
        "devices_used": len(sg.devices_used()),
        "peak_memory_bytes": max(pred["peak_memory_bytes"]),
        "error": None,
    }


def _try_plan(*args, **kwargs) -> tuple[Any, dict[str, Any]]:
    try:
        plan = _plan(*args, **kwargs)
        return plan, _row(plan)
    except GraphpipeError as exc:
        return None, {"feasible": False, "throughput": None, "error": str(exc)}


def _best_spp(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    feasible = [r for r in rows if r["strategy"] in SPP and r["feasible"]]
    return max(feasible, key=lambda r: r["throughput"]) if feasible else None


# ----------------------------------------------------------------- throughput
def throughput_config(quick: bool) -> dict[str, Any]:
    """Paper Fig. 6: simulated samples/s vs devices, gpp vs the SPP baselines."""
    return {
        "models": ["mmt:layers=2", "candle-uno:branches=3"] if quick else list(PAPER_MODELS),
        "devices": [4] if quick else [4, 8, 16, 32],
        "samples_per_device": SAMPLES_PER_DEVICE,
        "strategies": list(STRATEGIES),
        "cluster": "v100",
    }


def run_throughput(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    rows = []
    for model in config["models"]:
        for n in config["devices"]:
            for strategy in config["strategies"]:
                batch = config["samples_per_device"] * n
                _, row = _try_plan(model, n, batch, strategy)
                rows.append({"model": model, "devices": n, "batch_size": batch, "strategy": strategy, **row})
                progress.step(f"{model} {n} {strategy}")
    summary = {"speedup_vs_best_spp": _speedups(rows, ("model", "devices"))}
    return rows, summary


def _speedups(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """gpp throughput / best feasible SPP throughput, per group of ``keys``."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, group in groups.items():
        gpp = next((r for r in group if r["strategy"] == "gpp" and r["feasible"]), None)
        best = _best_spp(group)
        ratio = gpp["throughput"] / best["throughput"] if gpp and best else None
        out.append({**dict(zip(keys, key)), "best_spp": best["strategy"] if best else None, "speedup": ratio})
    return out


# ---------------------------------------------------------------- search time
def search_time_config(quick: bool) -> dict[str, Any]:
    """Paper Table 1: search time per strategy; plus gpp scaling vs devices and vs branches."""
    return {
        "models": ["mmt:layers=2", "candle-uno:branches=3"] if quick else list(PAPER_MODELS),
        "devices": [4] if quick else [8, 16, 32],
        "repeats": 1 if quick else 5,
        "single_run_over_s": 60.0,  # a search this long is timed once: its noise is small beside it (Piper on mmt)
        "strategies": list(STRATEGIES),
        "scaling_model": "candle-uno:branches=16",
        "scaling_devices": [8, 16] if quick else [32, 64, 128, 256, 512, 1024],
        "branch_counts": [2, 4] if quick else [2, 4, 8, 16, 32],
        "branch_devices": 8 if quick else 32,
        "samples_per_device": SAMPLES_PER_DEVICE,
    }


def _search_time(model: str, n: int, batch: int, strategy: str, repeats: int,
                 single_run_over_s: float = math.inf) -> dict[str, Any]:
    times, row = [], {}
    for _ in range(repeats):
        # recompute none: the partitioner's own search (auto would search twice, GPipe would re-materialize)
        plan, row = _try_plan(model, n, batch, strategy, SearchOptions(recompute="none"))
        if plan is None:
            break
        times.append(plan.search["time_s"])
        if times[0] > single_run_over_s:
            break
    return {"search_time_s": statistics.median(times) if times else None, "repeats": len(times),
            "feasible": row.get("feasible", False), "error": row.get("error")}


def run_search_time(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    rows = []
    for model in config["models"]:
        for n in config["devices"]:
            for strategy in config["strategies"]:
                batch = config["samples_per_device"] * n
                rows.append({"kind": "table", "model": model, "devices": n, "strategy": strategy,
                             **_search_time(model, n, batch, strategy, config["repeats"],
                                            config["single_run_over_s"])})
                progress.step(f"{model} {n} {strategy}")
    for n in config["scaling_devices"]:
        rows.append({"kind": "devices", "model": config["scaling_model"], "devices": n, "strategy": "gpp",
                     **_search_time(config["scaling_model"], n, config["samples_per_device"] * n, "gpp", 1)})
        progress.step(f"gpp {n} devices")
    for k in config["branch_counts"]:
        model = f"candle-uno:branches={k}"
        n = config["branch_devices"]
        rows.append({"kind": "branches", "model": model, "branches": k, "devices": n, "strategy": "gpp",
                     **_search_time(model, n, config["samples_per_device"] * n, "gpp", 1)})
        progress.step(f"gpp {k} branches")
    ratios = []
    for model in config["models"]:
        for n in config["devices"]:
            by = {r["strategy"]: r for r in rows if r["kind"] == "table" and r["model"] == model and r["devices"] == n}
            gpp_t = by["gpp"]["search_time_s"]
            for other in SPP:
                t = by[other]["search_time_s"]
                ratios.append({"model": model, "devices": n, "baseline": other,
                               "ratio": (t / gpp_t) if (t and gpp_t) else None})
    return rows, {"baseline_over_gpp": ratios}


# ------------------------------------------------------------------- branches
def branches_config(quick: bool) -> dict[str, Any]:
    """Paper Fig. 7: candle-uno with 2-16 branches, throughput normalised to pipedream;
    mmt at a fixed micro-batch size isolates the gain from a shallower pipeline."""
    return {
        "branch_counts": [2, 3] if quick else [2, 4, 8, 16],
        "devices": 4 if quick else 16,
        "samples_per_device": SAMPLES_PER_DEVICE,
        "mmt_branch_counts": [2] if quick else [2, 4, 8],
        "mmt_layers": 2 if quick else 8,
        "fixed_micro_batch_size": 4,
    }


def run_branches(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    rows = []
    n = config["devices"]
    batch = config["samples_per_device"] * n
    for k in config["branch_counts"]:
        model = f"candle-uno:branches={k}"
        for strategy in STRATEGIES:
            _, row = _try_plan(model, n, batch, strategy)
            rows.append({"series": "candle-uno", "model": model, "branches": k, "devices": n, "strategy": strategy, **row})
            progress.step(f"{model} {strategy}")
    options = SearchOptions(micro_batch_size=config["fixed_micro_batch_size"])
    for k in config["mmt_branch_counts"]:
        model = f"mmt:branches={k},layers={config['mmt_layers']}"
        for strategy in ("gpp", "pipedream"):
            _, row = _try_plan(model, n, batch, strategy, options)
            rows.append({"series": "mmt-fixed-mb", "model": model, "branches": k, "devices": n, "strategy": strategy, **row})
            progress.step(f"{model} {strategy}")
    summary = {"normalised_to_pipedream": _normalised(rows)}
    return rows, summary


def _normalised(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        base = next((b for b in rows if b["series"] == r["series"] and b["model"] == r["model"]
                     and b["strategy"] == "pipedream" and b["feasible"]), None)
        out.append({"series": r["series"], "branches": r["branches"], "strategy": r["strategy"],
                    "normalised": (r["throughput"] / base["throughput"]) if base and r["feasible"] else None})
    return out


# ------------------------------------------------------------------- ablation
def ablation_config(quick: bool) -> dict[str, Any]:
    """Paper Fig. 9 at 32 devices: concurrent stages only (SPP's micro-batch size) vs full gpp
    vs per-stage micro-batch sizes vs the CP-SAT schedule, each normalised to the best SPP."""
    return {
        "models": ["mmt:layers=2", "candle-uno:branches=3"] if quick else list(PAPER_MODELS),
        "devices": 4 if quick else 32,
        "samples_per_device": SAMPLES_PER_DEVICE,
        "cpsat_time_limit_s": 2.0 if quick else 20.0,
    }


def run_ablation(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    rows = []
    n = config["devices"]
    batch = config["samples_per_device"] * n
    for model in config["models"]:
        spp_rows = []
        for strategy in SPP:
            _, row = _try_plan(model, n, batch, strategy)
            spp_rows.append({"strategy": strategy, **row})
        best = _best_spp(spp_rows)
        variants: list[tuple[str, Callable[[], tuple]]] = []
        if best:
            mb = best["micro_batch_sizes"][0]
            variants.append(("concurrent stages only", lambda: _try_plan(model, n, batch, "gpp", SearchOptions(micro_batch_size=mb))))
        else:  # no sequential plan to take the micro-batch size from: that point is skipped, still counted
            progress.step(f"{model} concurrent stages only (no feasible spp)")
        variants += [
            ("gpp", lambda: _try_plan(model, n, batch, "gpp", SearchOptions(recompute="none"))),
            # re-materialization where memory or throughput asks for it (equal to gpp when memory is ample)
            ("gpp + re-materialization", lambda: _try_plan(model, n, batch, "gpp", SearchOptions(recompute="auto"))),
            ("gpp + per-stage micro-batch", lambda: _try_plan(model, n, batch, "gpp", SearchOptions(per_stage_micro_batch=True))),
            ("gpp + cpsat schedule", lambda: _try_plan(model, n, batch, "gpp", schedule="cpsat",
                                                       time_limit_s=config["cpsat_time_limit_s"])),
        ]
        rows.append({"model": model, "variant": "best spp", "strategy": best["strategy"] if best else None,
                     **(best or {"feasible": False, "throughput": None}), "speedup": 1.0 if best else None})
        for name, fn in variants:
            plan, row = fn()
            speedup = row["throughput"] / best["throughput"] if best and row["feasible"] else None
            extra = {}
            if plan is not None and "lower_bound_s" in plan.search:
                extra = {"lower_bound_s": plan.search["lower_bound_s"], "gap": plan.search.get("gap")}
            rows.append({"model": model, "variant": name, **row, **extra, "speedup": speedup})
            progress.step(f"{model} {name}")
    return rows, {}


# ----------------------------------------------------------------- case study
def case_study_config(quick: bool) -> dict[str, Any]:
    """Paper Figs. 8/10: the 2-branch transformer on 8 devices, SPP vs GPP."""
    return {"model": "twobranch:layers=2" if quick else "twobranch", "devices": 4 if quick else 8,
            "batch_size": 64 if quick else 128}


def run_case_study(config: dict[str, Any], progress: Progress, out: str) -> tuple[list, dict]:
    from graphpipe.plan import write_plan
    import os

    rows = []
    for strategy in ("pipedream", "gpp"):
        plan, row = _try_plan(config["model"], config["devices"], config["batch_size"], strategy)
        if plan is not None:
            path = os.path.join(out, "results", f"case-study-{strategy}.plan.json")
            write_plan(path, plan)
            row["plan_file"] = os.path.relpath(path, out)
        rows.append({"strategy": strategy, **row})
        progress.step(strategy)
    spp, gpp = rows
    summary = {}
    if spp["feasible"] and gpp["feasible"]:
        summary = {"depth_spp": spp["depth"], "depth_gpp": gpp["depth"],
                   "micro_batch_spp": spp["micro_batch_sizes"], "micro_batch_gpp": gpp["micro_batch_sizes"],
                   "throughput_gain": gpp["throughput"] / spp["throughput"]}
    return rows, summary


# --------------------------------------------------------------------- memory
def memory_config(quick: bool) -> dict[str, Any]:
    """Peak memory per device and in-flight micro-batches, gpp vs SPP."""
    return {"models": ["mmt:layers=2", "candle-uno:branches=3"] if quick else list(PAPER_MODELS) + ["twobranch"],
            "devices": 4 if quick else 16, "samples_per_device": SAMPLES_PER_DEVICE}


def run_memory(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    rows = []
    n = config["devices"]
    batch = config["samples_per_device"] * n
    for model in config["models"]:
        for strategy in ("gpp", "pipedream"):
            plan, row = _try_plan(model, n, batch, strategy)
            if plan is not None:
                row["peak_memory_per_device"] = list(plan.predicted["peak_memory_bytes"])
                row["in_flight"] = list(plan.predicted.get("in_flight", []))
                row["max_in_flight"] = max(row["in_flight"], default=None)
            rows.append({"model": model, "devices": n, "strategy": strategy, **row})
            progress.step(f"{model} {strategy}")
    return rows, {}


# ------------------------------------------------------------------- fidelity
def fidelity_config(quick: bool) -> dict[str, Any]:
    """Simulated vs measured iteration time on real runtime runs (CPU ranks here)."""
    # Full points use sizes where compute dominates per-action overheads (evals.bench_runtime's models).
    uno = "candle-uno:small,branches=4,layers=3,hidden=1024,features=512,head_layers=2"
    gpt = "transformer:small,layers=8,hidden=128,seq=32,heads=4,ffn=512,vocab=256"
    return {"points": [["candle-uno:small,branches=2,layers=2", "gpp", None]] if quick else [
                [uno, "gpp", None], [uno, "pipedream", None], [gpt, "pipedream", "1f1b"], [gpt, "pipedream", "gpipe"],
                [gpt, "gpp", None]],
            "devices": 2 if quick else 4, "batch_size": 16, "steps": 3 if quick else 6}


def run_fidelity(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    from . import fidelity

    rows = []
    for model, strategy, schedule in config["points"]:
        try:
            row = fidelity.measure(model, strategy, schedule, config["devices"], config["batch_size"], config["steps"],
                                   quick=config["quick"])
        except GraphpipeError as exc:
            row = {"error": str(exc)}
        rows.append({"model": model, "strategy": strategy, "schedule": schedule, **row})
        progress.step(f"{model} {strategy}")
    errors = [r["error_frac"] for r in rows if r.get("error_frac") is not None]
    memory = [r["memory_error_frac"] for r in rows if r.get("memory_error_frac") is not None]
    return rows, {"median_error": statistics.median(errors) if errors else None,
                  "median_memory_error": statistics.median(memory) if memory else None,
                  "worst_memory_error": max(memory) if memory else None}


# ---------------------------------------------------------------- zero bubble
def run_zero_bubble(config: dict[str, Any], progress: Progress, out: str | None = None) -> tuple[list, dict]:
    from . import zero_bubble

    return zero_bubble.run_zero_bubble(config, progress, lambda model, n, batch, strategy: _plan(model, n, batch,
                                                                                                   strategy), out)
# ------------------------------------------------------- memory measured on real runs
def memory_runtime_config(quick: bool) -> dict[str, Any]:
    from . import memory_runtime

    return memory_runtime.config(quick)


def run_memory_runtime(config: dict[str, Any], progress: Progress) -> tuple[list, dict]:
    from . import memory_runtime

    return memory_runtime.run(config, progress)


# -------------------------------------------------------------------- runner
EXPERIMENTS: dict[str, tuple[Callable[[bool], dict], Callable]] = {
    "throughput": (throughput_config, run_throughput),
    "search-time": (search_time_config, run_search_time),
    "branches": (branches_config, run_branches),
    "ablation": (ablation_config, run_ablation),
    "case-study": (case_study_config, run_case_study),
    "memory": (memory_config, run_memory),
    "fidelity": (fidelity_config, run_fidelity),
    "zero-bubble": (zero_bubble_config, run_zero_bubble),
    "async-throughput": (staleness.async_throughput_config, staleness.run_async_throughput),
    "staleness": (staleness.staleness_config, staleness.run_staleness),
    "memory-runtime": (memory_runtime_config, run_memory_runtime),
}
ORDER = tuple(EXPERIMENTS)


def _num_points(name: str, config: dict[str, Any]) -> int:
    if name == "throughput":
        return len(config["models"]) * len(config["devices"]) * len(config["strategies"])
    if name == "search-time":
        return (len(config["models"]) * len(config["devices"]) * len(config["strategies"])
                + len(config["scaling_devices"]) + len(config["branch_counts"]))
    if name == "branches":
        return len(config["branch_counts"]) * len(STRATEGIES) + 2 * len(config["mmt_branch_counts"])
    if name == "ablation":  # per model: concurrent stages only, gpp and its three additions
        return 5 * len(config["models"])
    if name == "case-study":
        return 2
    if name == "memory":
        return 2 * len(config["models"])
    if name == "zero-bubble":
        return zero_bubble_points(config)
    if name == "async-throughput":
        return len(config["models"]) * len(config["devices"]) + 1
    if name == "staleness":
        return len(config["variants"])
    if name == "memory-runtime":
        return 2 * len(config["models"]) * len(config["strategies"]) * len(config["schedules"])
    return len(config["points"])


def run_experiment(name: str, out: str, quick: bool) -> str:
    """Run one experiment, write ``<out>/results/<name>.json``, return its path."""
    if name not in EXPERIMENTS:
        from graphpipe.errors import InputError

        raise InputError(f"unknown experiment {name!r}; known: {', '.join(ORDER)}, all")
    config_fn, run_fn = EXPERIMENTS[name]
    config = dict(config_fn(quick), quick=quick)
    progress = Progress(name, _num_points(name, config))
    if name in ("case-study", "zero-bubble"):  # they also write plan files beside the results
        rows, summary = run_fn(config, progress, out)
    else:
        rows, summary = run_fn(config, progress)
    progress.close()
    return write_result(out, name, config, rows, summary)


