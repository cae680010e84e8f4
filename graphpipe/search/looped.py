"""Virtual stages: the model cut into ``K x V`` stages placed in turn over ``K`` device groups (docs/design.md#virtual-stages).

Interleaved 1F1B (Narayanan et al., SC'21 §2.2) and interleaved zero bubble
(Qi et al., ICLR'24; torch's ``ScheduleInterleavedZeroBubble``) run ``V``
stages per device group, stage ``s`` on group ``s mod K``: the pipeline's
fill and drain shrink about ``V``-fold, for ``V`` times as many messages and
a few more micro-batches in flight. ``graphpipe plan --virtual-stages V``
(:class:`~graphpipe.search.planner.PlanRequest`'s ``virtual_stages``) makes
such plans:

1. the strategy plans as usual; the device sets of its stages, in pipeline
   order, are the ``K`` groups, so the strategy still decides how many groups
   there are and how many devices each gets (a plan whose stages do not form
   a chain, a gpp plan with branches side by side, is refused with the
   reason: its stages cannot take the groups in turn). When its plan leaves
   devices idle or is one group (on a small model one device, or data
   parallelism alone, may be fastest without interleaving), every device of
   the cluster is a group of its own: the user asked for a pipeline over
   all of them;
2. the model's op order is cut anew into ``K*V`` contiguous stages balanced
   for those groups (:func:`graphpipe.sched.looped_chain`), at every
   micro-batch size the strategy may use, without re-materialization and,
   at a size where nothing fits without it, with it on every stage;
3. every such layout is scheduled and simulated; the fastest that fits in
   device memory wins (:func:`best_layout`).

``auto`` tries ``V = 2, 4, 8, ...`` (while there are enough ops) and, unless a
virtual-stage schedule was named, ``V = 1``, the strategy's own plan; the
fastest fit wins, ties to fewer virtual stages (fewer messages). Every ``V``
tried leaves one line in ``plan.search.virtual_stages_tried``.

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3)) for i in range(8)],
...                   [(f"l{i}", f"l{i+1}", 1e3) for i in range(7)])
>>> best = best_layout(g, ((0,), (1,)), 2, preset("v100", 2), 8, "interleaved", SearchOptions(micro_batch_size=2))
>>> best.virtual, [st.devices for st in best.stage_graph.stages]
(2, [(0,), (1,), (0,), (1,)])
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

from graphpipe.cluster import Cluster
from graphpipe.errors import GraphpipeError, InputError, ScheduleError
from graphpipe.graph import OpGraph
from graphpipe.plan import Plan
from graphpipe.sched.generators import SCHEDULES
from graphpipe.search.common import SearchOptions, micro_batch_candidates, simulated_peak
from graphpipe.stages import StageGraph

__all__ = ["VIRTUAL_SCHEDULES", "MAX_AUTO_VIRTUAL", "LayoutTry", "check_virtual_stages", "device_groups",
           "auto_counts", "best_layout", "pick", "summary", "v_layout_plan"]

log = logging.getLogger(__name__)

VIRTUAL_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.layout == "looped")
"""The schedules that run several stages per device group taken in turn (the default: ``interleaved``)."""

MAX_AUTO_VIRTUAL = 8
"""``--virtual-stages auto`` tries powers of two up to this many stages per group: past it the messages
(``V`` per micro-batch and group each way) outgrow the fill they save on every cluster preset."""


def check_virtual_stages(value) -> int | str | None:
    """``value`` when it is a number of virtual stages (an integer >= 1), ``"auto"`` or None; else an
    :class:`InputError` naming it."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"--virtual-stages must be a positive integer or 'auto', got {value!r}")
    return value


def device_groups(sg: StageGraph, strategy: str) -> tuple[tuple[int, ...], ...]:
    """The device sets of a chain plan's stages in pipeline order: the groups virtual stages take in turn.

    Raises :class:`InputError` with the reason when the stages do not form one chain (stages that run
    side by side cannot be placed in turn) or a device holds several of them already.
    """
    refusal = (f"--virtual-stages: {strategy}'s plan runs stages side by side ({{}}), so its stages cannot take the "
               "device groups in turn; use --strategy pipedream, piper or gpipe (they cut the op order into a chain), "
               "or drop --virtual-stages")
    for s in range(sg.num_stages):
        if len(sg.succs(s)) > 1:
            raise InputError(refusal.format(f"stage {s} feeds stages {', '.join(map(str, sg.succs(s)))}"))
        if len(sg.preds(s)) > 1:
            raise InputError(refusal.format(f"stages {', '.join(map(str, sg.preds(s)))} all feed stage {s}"))
    sources = [s for s in range(sg.num_stages) if not sg.preds(s)]
    if len(sources) > 1 or not sg.is_chain():
        raise InputError(refusal.format(f"stages {', '.join(map(str, sources))} all start from the model's inputs"))
    groups = tuple(st.devices for st in sg.stages)
    if len(set(groups)) != len(groups):
        raise InputError(f"--virtual-stages: {strategy}'s plan already places several stages on one device group")
    return groups


def auto_counts(num_ops: int, num_groups: int) -> list[int]:
    """The ``V > 1`` that ``--virtual-stages auto`` tries: 2, 4, ... up to :data:`MAX_AUTO_VIRTUAL`, while the
    ``num_ops`` ops give every one of the ``num_groups * V`` stages one.

    >>> auto_counts(12, 2), auto_counts(3, 2)
    ([2, 4], [])
    """
    counts, v = [], 2
    while v <= MAX_AUTO_VIRTUAL and num_groups * v <= num_ops:
        counts.append(v)
        v *= 2
    return counts


@dataclass(frozen=True, slots=True)
class LayoutTry:
    """One number of virtual stages tried: the best layout found (None when none fits) and why."""

    virtual: int
    stage_graph: StageGraph | None
    throughput: float | None
    note: str
    """One line for the plan: the winning micro-batch size and throughput, or the reason nothing fits."""


def best_layout(graph: OpGraph, groups: Sequence[Sequence[int]], virtual: int, cluster: Cluster, batch_size: int,
                schedule: str, options: SearchOptions, recompute: str | None = None) -> LayoutTry:
    """The fastest :func:`~graphpipe.sched.looped_chain` of ``graph`` with ``virtual`` stages per group that fits.

    Every micro-batch size of :func:`~graphpipe.search.common.micro_batch_candidates` that each group's
    replicas divide is cut and simulated under ``schedule``; ``recompute`` ``"all"`` re-materializes every
    stage, ``"none"`` none, anything else only at a size where nothing fits without. Sizes whose
    device-work bound cannot beat the best simulated plan are not simulated. Ties go to the smaller size.
    """
    from graphpipe.sched import looped_chain
    from graphpipe.search.gpp import busy_bound_s

    k = len(groups)
    if graph.num_ops < k * virtual:
        return LayoutTry(virtual, None, None, f"{graph.num_ops} ops cannot make {k * virtual} stages "
                                              f"({k} device groups x {virtual})")
    sizes = [b for b in micro_batch_candidates(batch_size, options) if all(b % len(g) == 0 for g in groups)]
    if not sizes:
        return LayoutTry(virtual, None, None, f"no micro-batch size of batch {batch_size} splits evenly over the "
                                              f"groups' {sorted({len(g) for g in groups})} devices")
    modes = {"all": (True,), "none": (False,)}.get(recompute or "", (False, True))
    best: tuple | None = None  # (throughput, -size, stage graph, recompute)
    refusals: list[str] = []
    smallest_need: tuple[float, int] | None = None
    for b in sizes:
        for rc in modes:
            sg = looped_chain(graph, groups, virtual, batch_size, b, rc, cluster.num_devices)
            bound = busy_bound_s(sg, cluster)
            if best is not None and options.host is None and bound > 0 and batch_size / bound < best[0]:
                break
            try:
                throughput, peak = simulated_peak(sg, cluster, schedule, options.host)
            except GraphpipeError as exc:  # the schedule's own condition (micro-batch rounds): not this size
                refusals.append(f"micro-batch {b}: {str(exc).splitlines()[0]}")
                break
            if peak > cluster.memory_bytes:
                if smallest_need is None or peak < smallest_need[0]:
                    smallest_need = (peak, b)
                continue
            if best is None or (throughput, -b) > (best[0], best[1]):
                best = (throughput, -b, sg, rc)
            break  # re-materialization only where nothing fits without it
    if best is None:
        if smallest_need is not None:
            need, b = smallest_need
            why = (f"needs {need / 1e9:.3g} GB on a device at best (micro-batch {b}), a {cluster.device.name} has "
                   f"{cluster.memory_bytes / 1e9:.3g} GB")
        else:
            why = "; ".join(refusals[:2]) or "no micro-batch size works"
        return LayoutTry(virtual, None, None, why)
    throughput, neg_b, sg, rc = best
    note = f"{throughput:.4g} samples/s at micro-batch {-neg_b}{', re-materializing every stage' if rc else ''}"
    log.debug("%d virtual stages per group: %s", virtual, note)
    return LayoutTry(virtual, sg, throughput, note)


def pick(tries: Sequence[LayoutTry], strategy: str, schedule: str) -> LayoutTry:
    """The fastest of ``tries`` that found a layout (ties: fewer virtual stages); an :class:`InputError`
    naming every reason when none did."""
    found = [t for t in tries if t.throughput is not None]
    if not found:
        reasons = "; ".join(f"V={t.virtual}: {t.note}" for t in tries) or "no number of virtual stages to try"
        raise InputError(f"--virtual-stages: no {schedule} layout of {strategy}'s device groups works ({reasons})")
    fastest = max(t.throughput for t in found)
    return min((t for t in found if t.throughput >= fastest * (1 - 1e-9)), key=lambda t: t.virtual)


def summary(tries: Sequence[LayoutTry], winner: LayoutTry) -> dict[str, str]:
    """``plan.search.virtual_stages_tried``: each ``V`` tried (as a string key) and its line, the winner marked."""
    return {str(t.virtual): ("won: " if t is winner else "") + t.note for t in tries}


def v_layout_plan(plan: Plan, name: str, forced: bool = False) -> Plan:
    """``plan``'s model cut anew into a V (:func:`~graphpipe.sched.generators.v_shape_chain`: ``2K`` stages on
    the cluster's ``K`` devices) at the plan's smallest micro-batch size, scheduled with ``name`` (a schedule
    whose :attr:`~graphpipe.sched.generators.ScheduleSpec.layout` is ``v``: zbv, dualpipev) and simulated.

    When the schedule refuses that size (DualPipeV needs a micro-batch per stage) or the V does not fit in
    memory there, smaller divisors of the batch are tried in turn (the entry's ``shrinks_micro_batch``),
    unless the size was ``forced`` (``--micro-batch-size``). Raises :class:`~graphpipe.errors.InputError`
    when the V does not fit a device's memory, and :class:`~graphpipe.errors.ScheduleError` when the model is
    no chain or has too few ops or micro-batches, each for the plan's own size.
    """
    from graphpipe.sched.generators import get_schedule, make_schedule, v_shape_chain
    from graphpipe.sched.simulator import predicted_figures, simulate

    sg, cluster = plan.stage_graph, plan.cluster
    mb = min(st.micro_batch_size for st in sg.stages)
    shrinks = get_schedule(name).shrinks_micro_batch and not forced
    sizes = [mb] + ([b for b in range(mb - 1, 0, -1) if sg.batch_size % b == 0] if shrinks else [])
    first_error = None
    for b in sizes:
        v = v_shape_chain(sg.graph, cluster.num_devices, sg.batch_size, b)
        try:
            schedule = make_schedule(name, v, cluster)
        except ScheduleError as exc:
            first_error = first_error or exc
            continue
        figures = predicted_figures(simulate(v, schedule, cluster))
        worst = max(range(cluster.num_devices), key=lambda d: figures["peak_memory_bytes"][d])
        need = figures["peak_memory_bytes"][worst]
        if need > cluster.memory_bytes:
            first_error = first_error or InputError(
                f"{name}: the V layout (micro-batch {b}) needs {need / 1e9:.3g} GB on device {worst}, the device "
                f"has {cluster.memory_bytes / 1e9:.3g} GB: use a smaller --micro-batch-size or more devices")
            continue
        return replace(plan, stage_graph=v, schedule=schedule, predicted=figures,
                       search={**dict(plan.search), "layout": f"v ({v.num_stages} stages, micro-batch {b})"})
    raise first_error
