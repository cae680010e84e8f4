"""Figures for the evaluations. Every function reads only result files.

Each figure is titled, has labelled axes with units and a legend, and marks
the paper's reported value where there is one.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .common import read_result  # noqa: E402

__all__ = ["PLOTS", "plot_all"]

COLORS = {"gpp": "#d62728", "pipedream": "#1f77b4", "piper": "#2ca02c", "gpipe": "#9467bd"}
MARKERS = {"gpp": "o", "pipedream": "s", "piper": "^", "gpipe": "v"}


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, f"{name}.png")
    from graphpipe.files import write_atomic

    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path


def plot_throughput(res: dict[str, Any], out: str) -> str:
    models = res["config"]["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for strategy in res["config"]["strategies"]:
            pts = [(r["devices"], r["throughput"]) for r in res["rows"]
                   if r["model"] == model and r["strategy"] == strategy and r["feasible"]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=MARKERS.get(strategy, "o"), color=COLORS.get(strategy), label=strategy)
        ax.set_title(model)
        ax.set_xlabel("devices (V100 preset)")
        ax.set_ylabel("simulated throughput (samples/s)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        best = [s for s in res["summary"]["speedup_vs_best_spp"] if s["model"] == model and s["speedup"]]
        if best:
            top = max(best, key=lambda s: s["devices"])
            ax.text(0.02, 0.97, f"gpp/best SPP at {top['devices']}: {top['speedup']:.2f}x\npaper: up to 1.6x",
                    transform=ax.transAxes, va="top", fontsize=8, bbox=dict(fc="white", alpha=0.8))
    fig.suptitle("Throughput vs devices (paper Fig. 6)")
    return _save(fig, out, "throughput")


def plot_search_time(res: dict[str, Any], out: str) -> str:
    rows = res["rows"]
    cfg = res["config"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.3))
    ax = axes[0]
    n = max(cfg["devices"])
    width = 0.8 / len(cfg["strategies"])
    for i, strategy in enumerate(cfg["strategies"]):
        ys = []
        for model in cfg["models"]:
            r = next(r for r in rows if r["kind"] == "table" and r["model"] == model and r["devices"] == n
                     and r["strategy"] == strategy)
            ys.append(r["search_time_s"] or 0.0)
        xs = [j + i * width for j in range(len(cfg["models"]))]
        bars = ax.bar(xs, ys, width, label=strategy, color=COLORS.get(strategy))
        for x, y, model in zip(xs, ys, cfg["models"]):
            if y == 0.0:  # refused (piper's guard) or no plan fits: say so at the foot of the axis
                ax.text(x, 0.03, "no plan", rotation=90, ha="center", va="bottom", fontsize=7,
                        transform=ax.get_xaxis_transform())
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cfg["models"]))], cfg["models"])
    ax.set_yscale("log")
    ax.set_ylabel("search time (s, median)")
    ax.set_title(f"Search time at {n} devices\n(paper Table 1: gpp 9-21x faster than Piper)", fontsize=10)
    ax.legend(fontsize=8)
    for ax, kind, key, xlabel in ((axes[1], "devices", "devices", "devices"),
                                  (axes[2], "branches", "branches", "branches (candle-uno)")):
        pts = [(r[key], r["search_time_s"]) for r in rows if r["kind"] == kind and r["search_time_s"] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", color=COLORS["gpp"], label="gpp")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("gpp search time (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_title(f"gpp search time vs devices\n({cfg['scaling_model']})", fontsize=10)
    axes[2].set_title(f"gpp search time vs branches\n(candle-uno, {cfg['branch_devices']} devices)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "search-time")


def plot_branches(res: dict[str, Any], out: str) -> str:
    norm = res["summary"]["normalised_to_pipedream"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, series, title in ((axes[0], "candle-uno", "CANDLE-Uno: throughput vs branches (paper Fig. 7)"),
                              (axes[1], "mmt-fixed-mb", f"MMT, micro-batch fixed at {res['config']['fixed_micro_batch_size']}")):
        strategies = sorted({r["strategy"] for r in norm if r["series"] == series}, key=lambda s: list(COLORS).index(s))
        for strategy in strategies:
            pts = [(r["branches"], r["normalised"]) for r in norm
                   if r["series"] == series and r["strategy"] == strategy and r["normalised"] is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=MARKERS.get(strategy), color=COLORS.get(strategy), label=strategy)
        if series == "candle-uno":
            ax.plot([16], [2.0], marker="*", markersize=14, color="black", linestyle="none", label="paper: ~2x at 16")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("parallel branches")
        ax.set_ylabel("throughput / pipedream")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, "branches")


def plot_ablation(res: dict[str, Any], out: str) -> str:
    rows = res["rows"]
    models = res["config"]["models"]
    variants = []
    for r in rows:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ys = []
        for model in models:
            r = next((r for r in rows if r["model"] == model and r["variant"] == variant), None)
            ys.append(r["speedup"] if r and r["speedup"] else 0.0)
        ax.bar([j + i * width for j in range(len(models))], ys, width, label=variant)
    ax.axhspan(1.12, 1.40, color="orange", alpha=0.15, label="paper: concurrent stages 1.12-1.40x")
    ax.axhspan(1.25, 1.61, color="red", alpha=0.08, label="paper: full GraphPipe 1.25-1.61x")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    ax.set_ylabel("throughput / best SPP")
    ax.set_title(f"Ablation at {res['config']['devices']} devices (paper Fig. 9)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out, "ablation")


def plot_case_study(res: dict[str, Any], out: str) -> str:
    from graphpipe.plan import read_plan
    from graphpipe.sched import plot_gantt_pair, simulate

    timelines, titles = [], []
    for r in res["rows"]:
        if not r.get("plan_file"):
            continue
        plan = read_plan(os.path.join(out, r["plan_file"]))
        timelines.append(simulate(plan.stage_graph, plan.schedule, plan.cluster))
        titles.append(f"{r['strategy']}: depth {r['depth']}, micro-batch {r['micro_batch_sizes']}, "
                      f"{r['throughput']:.0f} samples/s")
    path = os.path.join(out, "case-study.png")
    if len(timelines) == 2:
        plot_gantt_pair(timelines[0], timelines[1], path, titles)
    return path


def plot_memory(res: dict[str, Any], out: str) -> str:
    rows = [r for r in res["rows"] if r["feasible"]]
    models = res["config"]["models"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for i, strategy in enumerate(("pipedream", "gpp")):
        peaks, flights = [], []
        for model in models:
            r = next((r for r in rows if r["model"] == model and r["strategy"] == strategy), None)
            peaks.append(r["peak_memory_bytes"] / 1e9 if r else 0.0)
            flights.append(r["max_in_flight"] if r and r.get("max_in_flight") is not None else 0)
        xs = [j + i * width for j in range(len(models))]
        axes[0].bar(xs, peaks, width, label=strategy, color=COLORS[strategy])
        axes[1].bar(xs, flights, width, label=strategy, color=COLORS[strategy])
    for ax, ylabel, title in ((axes[0], "peak memory on the fullest device (GB)", "Peak memory per device"),
                              (axes[1], "max micro-batches in flight on a stage", "In-flight micro-batches")):
        ax.set_xticks([j + width / 2 for j in range(len(models))], models, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {res['config']['devices']} devices")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, out, "memory")


def plot_fidelity(res: dict[str, Any], out: str) -> str:
    rows = [r for r in res["rows"] if r.get("measured_s") and r.get("predicted_s")]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for r in rows:
        label = f"{r['model']} {r['strategy']} {r.get('schedule') or ''}".strip()
        ax.scatter([r["measured_s"] * 1e3], [r["predicted_s"] * 1e3], label=label, s=30)
    if rows:
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.1
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8, label="predicted = measured")
        ax.fill_between([0, hi], [0, hi * 0.8], [0, hi * 1.2], color="grey", alpha=0.1, label="±20% (target)")
    ax.set_xlabel("measured iteration time (ms)")
    ax.set_ylabel("simulated iteration time (ms)")
    ax.set_title("Simulator fidelity on real runs (CPU ranks)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, out, "fidelity")


def plot_zero_bubble(res: dict[str, Any], out: str) -> str:
    """Throughput gain of each zero-bubble schedule over its reference (graph-1F1B / 1F1B): one panel per
    schedule, bars per model and device count, the peak-memory ratio written in each bar."""
    references = ("graph-1f1b", "1f1b")
    rows = [r for r in res["rows"] if r.get("gain") is not None and r["schedule"] not in references]
    panels = [("graph-zb", "zb-h1"), ("zbv",), ("dualpipev",), ("cpsat",)]
    panels = [p for p in panels if any(r["schedule"] in p for r in rows)]
    devices = res["config"]["devices"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, names in zip(axes[0], panels):
        models = list(dict.fromkeys(r["model"] for r in rows if r["schedule"] in names))
        width = 0.8 / max(1, len(devices))
        for i, n in enumerate(devices):
            ys, labels = [], []
            for model in models:
                r = next((r for r in rows if r["model"] == model and r["devices"] == n and r["schedule"] in names),
                         None)
                ys.append(r["gain"] if r else 0.0)
                labels.append(f"{r['memory_ratio']:.2f}" if r and r.get("memory_ratio") else "")
            bars = ax.bar([j + i * width for j in range(len(models))], ys, width, label=f"{n} devices")
            for bar, text in zip(bars, labels):
                if text:
                    ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() / 2, f"peak memory x{text}",
                            ha="center", va="center", fontsize=7, rotation=90, color="white")
        schedule_of = {r["model"]: r["schedule"] for r in rows if r["schedule"] in names}
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))],
                      [f"{m}\n{schedule_of[m]}\n/ {'graph-1f1b' if schedule_of[m] in ('graph-zb', 'cpsat') else '1f1b'}"
                       for m in models], fontsize=8)
        ax.set_ylabel("simulated throughput gain (x)")
        what = {("cpsat",): ": CP-SAT with split backward, same micro-batch sizes",
                ("zbv",): ": V layout (2K stages on K devices)",
                ("dualpipev",): ": V layout, F of one chunk paired with B of the other"}
        ax.set_title(" / ".join(names) + what.get(names, ": W deferred into idle slots"), fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Zero bubble on gpp's plans (same stages re-scheduled; ZB-V and DualPipeV re-cut as a V), v100 preset")
    path = _save(fig, out, "zero-bubble")
    _plot_zero_bubble_gantt(res, out)
    return path


def _plot_zero_bubble_gantt(res: dict[str, Any], out: str) -> None:
    """``zero-bubble-gantt.png``: the chain schedules of the Gantt case, stacked on one time axis."""
    from graphpipe.plan import read_plan
    from graphpipe.sched import simulate
    from graphpipe.sched.gantt import plot_gantt_stack

    files = (res.get("summary") or {}).get("gantt_plans") or {}
    if not files:
        return
    timelines, titles = [], []
    for name, rel in files.items():
        plan = read_plan(os.path.join(out, rel))
        tl = simulate(plan.stage_graph, plan.schedule, plan.cluster)
        timelines.append(tl)
        titles.append(f"{name}: {plan.stage_graph.num_stages} stages on {plan.cluster.num_devices} devices, "
                      f"{tl.iteration_time_s * 1e3:.3g} ms")
    plot_gantt_stack(timelines, os.path.join(out, "zero-bubble-gantt.png"), titles)
def plot_async_throughput(res: dict[str, Any], out: str) -> str:
    rows = [r for r in res["rows"] if r["source"] == "simulated"]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4.2 * (len(models) + 1), 3.8))
    for ax, model in zip(axes, models):
        for name, marker in (("1f1b", "s"), ("1f1b-async", "o"), ("2bw", "^")):
            pts = sorted((r["devices"], r["throughput"]) for r in rows if r["model"] == model and r["schedule"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices (V100 preset)")
        ax.set_ylabel("simulated samples/s (steady state)")
        ax.set_title(f"{model}: PipeDream plan")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    measured = [r for r in res["rows"] if r["source"] != "simulated"]
    labels = [f"{r['model'].split(':')[0]}\n{r['schedule']}" for r in measured]
    ax.bar(range(len(measured)), [r["throughput"] for r in measured], color="#1f77b4")
    ax.set_xticks(range(len(measured)), labels, fontsize=6)
    ax.set_ylabel("measured samples/s")
    ax.set_title("measured, 4 CPU ranks (small presets)")
    return _save(fig, out, "async-throughput")


def plot_staleness(res: dict[str, Any], out: str) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for r in res["rows"]:
        axes[0].plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["schedule"], lw=1)
        axes[1].plot(r["clock_s"], r["losses"][:len(r["clock_s"])], label=r["schedule"], lw=1)
    for ax, xlabel in ((axes[0], "step (mini-batch)"), (axes[1], "measured wall-clock (s, shared CPU host)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (mean square of the output)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_title("loss vs step")
    axes[1].set_title("loss vs time (PipeDream Fig. 10 style)")
    names = [r["schedule"] for r in res["rows"]]
    axes[2].bar(range(len(names)), [r["stashed_weight_bytes"] / 1e3 for r in res["rows"]], color="#9467bd")
    axes[2].set_xticks(range(len(names)), names, fontsize=7, rotation=15)
    axes[2].set_ylabel("stashed weight kB (fullest device, measured)")
    axes[2].set_title("memory for weight versions")
    return _save(fig, out, "staleness")


PLOTS: dict[str, Callable[[dict, str], str]] = {
    "throughput": plot_throughput,
    "search-time": plot_search_time,
    "branches": plot_branches,
    "ablation": plot_ablation,
    "case-study": plot_case_study,
    "memory": plot_memory,
    "fidelity": plot_fidelity,
    "zero-bubble": plot_zero_bubble,
    "async-throughput": plot_async_throughput,
    "staleness": plot_staleness,
}


def plot_all(out: str, names=None) -> list[str]:
    paths = []
    for name, fn in PLOTS.items():
        if names and name not in names:
            continue
        res = read_result(out, name)
        if res is not None:
            paths.append(fn(res, out))
    return paths
