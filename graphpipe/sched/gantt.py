"""Gantt charts of timelines (matplotlib, Agg backend) (docs/design.md#schedules-and-the-simulator).

One row per device, time in milliseconds on the x axis. Forward actions are
blue, backward actions orange (zero bubble's input-gradient I too; its
weight-gradient W green); when a device hosts several (virtual) stages,
each gets its own shade so the interleaving is visible. The micro-batch id
is written inside each bar wide enough to hold it. A thin grey bar under a
row marks a gradient all-reduce. :func:`plot_gantt_pair` stacks two
timelines on one time scale (simulated vs measured, SPP vs GPP), so equal
lengths mean equal iteration times.

Example (writes a file)::

    tl = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
    plot_gantt(tl, "gantt.png", title="MMT on 8 x V100, graph-1F1B")
"""

from __future__ import annotations

from typing import Sequence

from graphpipe.sched.simulator import Timeline

__all__ = ["plot_gantt", "plot_gantt_pair", "plot_gantt_stack"]

_F_SHADES = ("#1f77b4", "#6baed6", "#08519c", "#9ecae1")
_B_SHADES = ("#ff7f0e", "#fdae6b", "#a63603", "#fdd0a2")
_W_SHADES = ("#2ca02c", "#74c476", "#006d2c", "#c7e9c0")
_ALLREDUCE = "#7f7f7f"
_FIG_WIDTH_IN = 14.0
_DPI = 120
_CHAR_PX = 7.5
"""Approximate width of one label character at the font size used: labels that do not fit are skipped."""


def _stage_shade(timeline: Timeline) -> dict[int, int]:
    """Index of each stage among the stages on its (first) device: the shade it is drawn in."""
    shade = {}
    per_device: dict[int, int] = {}
    for s, devices in enumerate(timeline.stage_devices):
        d = devices[0]
        shade[s] = per_device.get(d, 0)
        per_device[d] = shade[s] + 1
    return shade


def _draw(ax, timeline: Timeline, title: str, xmax_ms: float, width_px: float,
          devices: Sequence[int] | None = None) -> None:
    rows = {d: k for k, d in enumerate(range(timeline.num_devices) if devices is None else sorted(set(devices)))}
    shade = _stage_shade(timeline)
    scale = 1e3  # seconds -> ms
    px_per_ms = width_px / xmax_ms if xmax_ms > 0 else 0.0
    multi = len(set(shade.values())) > 1
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in timeline.actions:
        if r.device not in rows:
            continue
        a = r.action
        colours = _F_SHADES if a.kind == "F" else _W_SHADES if a.kind == "W" else _B_SHADES
        colour = colours[shade[a.stage_id] % len(colours)]
        start, width = r.start * scale, (r.end - r.start) * scale
        bars.setdefault((rows[r.device], colour), []).append((start, width))
        label = f"{a.stage_id}.{a.mb_id}" if multi else str(a.mb_id)
        if width * px_per_ms >= _CHAR_PX * (len(label) + 1):
            ax.text(start + width / 2, rows[r.device], label, ha="center", va="center", fontsize=7,
                    color="white" if colour in (_F_SHADES[0], _F_SHADES[2], _B_SHADES[2], _W_SHADES[2]) else "black")
    # One collection per (device, colour): fast even for tens of thousands of actions.
    for (row, colour), spans in bars.items():
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.4)
    # Re-materialization: the re-run forward at the start of each B, hatched over the B bar.
    redo: dict[int, list[tuple[float, float]]] = {}
    for r in timeline.actions:
        t = timeline.recompute_s[r.action.stage_id] if r.action.kind in ("B", "I") and timeline.recompute_s else 0.0
        if t > 0 and r.device in rows:
            redo.setdefault(rows[r.device], []).append((r.start * scale, min(t, r.end - r.start) * scale))
    for row, spans in redo.items():
        ax.broken_barh(spans, (row - 0.4, 0.8), facecolors="none", edgecolors=_F_SHADES[0], hatch="///",
                       linewidth=0)
    for ar in timeline.allreduces:
        for d in ar.devices:
            if d in rows:
                ax.broken_barh([(ar.start * scale, (ar.end - ar.start) * scale)], (rows[d] + 0.28, 0.12),
                               facecolors=_ALLREDUCE)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"device {d}" for d in rows], fontsize=8)
    ax.set_xlim(0, xmax_ms)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(f"{title}  —  {timeline.iteration_time_s * 1e3:.3g} ms/iter, "
                 f"{timeline.throughput:.4g} samples/s", fontsize=10)


def _legend(fig, timeline: Timeline) -> None:
    from matplotlib.patches import Patch

    chunks = max(_stage_shade(timeline).values(), default=0) + 1
    if chunks > 1:  # virtual stages: one entry per shade, labels in bars read "stage.mb"
        handles = [Patch(color=_F_SHADES[i % len(_F_SHADES)], label=f"F, virtual stage {i}") for i in range(chunks)]
        handles += [Patch(color=_B_SHADES[i % len(_B_SHADES)], label=f"B, virtual stage {i}") for i in range(chunks)]
    else:
        handles = [Patch(color=_F_SHADES[0], label="forward (F)"), Patch(color=_B_SHADES[0], label="backward (B)")]
    if any(r.action.kind == "W" for r in timeline.actions):  # zero bubble: I is drawn like B, W apart
        if chunks > 1:
            handles += [Patch(color=_W_SHADES[i % len(_W_SHADES)], label=f"W, virtual stage {i}")
                        for i in range(chunks)]
        else:
            handles[1] = Patch(color=_B_SHADES[0], label="backward / input gradient (B, I)")
            handles.append(Patch(color=_W_SHADES[0], label="weight gradient (W)"))
    if any(timeline.recompute_s):
        handles.append(Patch(facecolor="none", edgecolor=_F_SHADES[0], hatch="///", label="re-run forward (recompute)"))
    if timeline.allreduces:
        kinds = {ar.collective for ar in timeline.allreduces}
        label = "gradient all-reduce" if kinds == {"allreduce"} else "gradient all-reduce / FSDP gather, reduce-scatter"
        handles.append(Patch(color=_ALLREDUCE, label=label))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)


def _below_legend(fig) -> float:
    """The top of the plots as a share of the figure: 0.3 inch under the legend, however tall the figure."""
    return 1.0 - 0.3 / fig.get_figheight()


def _save(fig, path: str) -> None:
    """Save atomically (:func:`graphpipe.files.write_atomic`): render beside ``path``, then rename over a regular file."""
    from graphpipe.files import write_atomic

    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=_DPI))


def _figure(rows: Sequence[int]):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    heights = [0.32 * n + 1.1 for n in rows]
    fig, axes = plt.subplots(len(rows), 1, figsize=(_FIG_WIDTH_IN, sum(heights) + 0.4),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    return plt, fig, [ax[0] for ax in axes]


def plot_gantt(timeline: Timeline, path: str, title: str | None = None, devices: Sequence[int] | None = None) -> None:
    """Write a Gantt chart PNG of ``timeline`` to ``path``: a row per device, or per device of ``devices`` when
    given (:meth:`Timeline.stage_first_devices`: a stage per row, for plans on more devices than rows read)."""
    plt, fig, (ax,) = _figure([timeline.num_devices if devices is None else len(set(devices))])
    try:
        xmax = timeline.iteration_time_s * 1e3 or 1.0
        _draw(ax, timeline, title or f"{timeline.name} ({timeline.source})", xmax, _FIG_WIDTH_IN * _DPI * 0.85,
              devices)
        _legend(fig, timeline)
        fig.tight_layout(rect=(0, 0, 1, _below_legend(fig)))
        _save(fig, path)
    finally:
        plt.close(fig)


def plot_gantt_pair(timeline_a: Timeline, timeline_b: Timeline, path: str,
                    titles: Sequence[str] | None = None) -> None:
    """Two Gantt charts stacked on one time axis (e.g. simulated vs measured, SPP vs GPP)."""
    if titles is not None and len(list(titles)) != 2:
        from graphpipe.errors import InputError

        raise InputError(f"plot_gantt_pair needs two titles, got {len(list(titles))}")
    plot_gantt_stack((timeline_a, timeline_b), path, titles)


def plot_gantt_stack(timelines: Sequence[Timeline], path: str, titles: Sequence[str] | None = None) -> None:
    """Gantt charts stacked on one time axis, one per timeline (e.g. several schedules of one model)."""
    titles = list(titles) if titles else [f"{t.name} ({t.source})" for t in timelines]
    if len(titles) != len(timelines) or not timelines:
        from graphpipe.errors import InputError

        raise InputError(f"plot_gantt_stack needs one title per timeline, got {len(titles)} for {len(timelines)}")
    plt, fig, axes = _figure([t.num_devices for t in timelines])
    try:
        xmax = max(t.iteration_time_s for t in timelines) * 1e3 or 1.0
        for ax, tl, title in zip(axes, timelines, titles):
            _draw(ax, tl, title, xmax, _FIG_WIDTH_IN * _DPI * 0.85)
        _legend(fig, next((t for t in timelines if t.allreduces), timelines[-1]))
        fig.tight_layout(rect=(0, 0, 1, _below_legend(fig)))
        _save(fig, path)
    finally:
        plt.close(fig)
