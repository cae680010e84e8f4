"""Zero-bubble schedules: the backward split into I (input gradients) and W (weight gradients) (docs/design.md#schedules-and-the-simulator).

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR'24): a stage's backward
is two passes. ``I`` computes the gradients of the stage's inputs — the only
thing the producer stage waits for — and ``W`` the gradients of its weights,
which nothing downstream of it needs before the optimizer step. Running I
first shortens the critical path of gradients back through the pipeline, and
the W passes become filler for the slots where a device would otherwise idle.
The price is memory: a micro-batch's activations live until its W.

* :func:`zb_h1` — the paper's ZB-H1 for a chain of stages: 1F1B's warm-up
  (``K - i`` forwards on stage ``i`` of ``K``), then per step ``I_k``,
  ``W_{k - i}``, ``F``: stage ``i``'s weight gradients trail its input
  gradients by ``i`` micro-batches, and the ``i`` W's left at the end fill
  the cool-down, where 1F1B idles. Every stage then holds at most ``K``
  micro-batches (the first stage's 1F1B count, so the peak over devices is
  1F1B's) and, with ``F = I = W`` and free communication, each device idles
  ``(K-1)(F + I - W)`` instead of 1F1B's ``(K-1)(F + I + W)``: a third
  (tests/test_zero_bubble.py derives it).
* :func:`graph_zb` — the same on a graph of stages: graph-1F1B's warm-ups
  (:func:`graphpipe.sched.graph1f1b.schedule_warmups`) and order with each B
  split, stage ``s``'s W's trailing its I's by ``lag_s = min(L, D - w_s)``
  micro-batches, where ``D`` is the deepest warm-up (the source's in-flight
  count under graph-1F1B) — so no stage holds more micro-batches than
  graph-1F1B's source does. A branch's W's fill the slots its join leaves
  idle. ``L`` is chosen by simulation among ``0..D-1``: ``L = 0`` is
  graph-1F1B with each backward split in place — the same memory, and never
  slower, because producers wait for I instead of the whole B — and a larger
  ``L`` is taken only when it is faster, its peak activation bytes over
  devices stay within ``L = 0``'s (ZB-H1's memory criterion: the device
  holding the most activations holds no more) and every device still fits
  its memory capacity; ties keep the smaller ``L``.

* :func:`zbv` — the paper's ZB-V (§6; torch's ``ScheduleZBVZeroBubble``):
  ``2K`` stages of a chain on ``K`` devices in a V, device ``d`` hosting
  stage ``d`` (chunk 0, going down) and stage ``2K-1-d`` (chunk 1, coming
  back), so the last stage sits on device 0 beside the first and each
  device's two chunks balance each other's memory. Build the layout with
  :func:`graphpipe.sched.generators.v_shape_chain`.
* :func:`dualpipev` — DeepSeek's DualPipeV (torch's ``ScheduleDualPipeV``)
  on the same V: forwards of one chunk paired with backwards of the other in
  the steady state, split backwards only where the V turns and in the drain.

* :func:`interleaved_zb` — interleaved 1F1B's layout (``K*v`` stages
  round-robin, :func:`graphpipe.sched.generators.round_robin_chain`) with
  each backward split and rank ``r``'s W's trailing its I's by ``r``
  backwards (torch's ``ScheduleInterleavedZeroBubble``).

zb-h1 and graph-zb run one stage per device (like 1F1B and graph-1F1B).

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("c", [Op(n, "x", Affine(0, 1), Affine(0, 2), 4.0) for n in "ab"], [("a", "b", 0.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 3, 2)
>>> print(zb_h1(sg).to_text())
0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
"""

from __future__ import annotations

from collections import deque

import math
from typing import Sequence

from graphpipe.actions import Action, Schedule
from graphpipe.cluster import Cluster, DeviceSpec, Link
from graphpipe.errors import ScheduleError
from graphpipe.stages import StageGraph

from graphpipe.sched.graph1f1b import assemble, schedule_warmups
from graphpipe.sched.simulator import simulate

__all__ = ["zb_h1", "graph_zb", "zbv", "dualpipev", "interleaved_zb", "v_shape_groups", "lagged_sequence"]


def lagged_sequence(stage_id: int, num_mbs: int, warmup: int, lag: int) -> list[Action]:
    """``warmup`` forwards, then per micro-batch ``k``: ``I_k``, ``W_{k-lag}`` (once ``k >= lag``), the next
    forward; then the ``lag`` W's left. ``lag = 0`` is 1F1B with each B split in place.

    >>> " ".join(map(str, lagged_sequence(0, 4, 2, 1)))
    '0F0 0F1 0I0 0F2 0I1 0W0 0F3 0I2 0W1 0I3 0W2 0W3'
    """
    warmup = max(1, min(warmup, num_mbs))
    lag = max(0, min(lag, num_mbs))
    out = [Action(stage_id, "F", j) for j in range(warmup)]
    for k in range(num_mbs):
        out.append(Action(stage_id, "I", k))
        if k >= lag:
            out.append(Action(stage_id, "W", k - lag))
        if warmup + k < num_mbs:
            out.append(Action(stage_id, "F", warmup + k))
    out.extend(Action(stage_id, "W", j) for j in range(num_mbs - lag, num_mbs))
    return out


def _lagged_schedule(sg: StageGraph, name: str, warm: Sequence[int], cap: int) -> Schedule:
    """Each stage's W's trail its I's by ``min(cap, max(warm) - warm_s)`` micro-batches."""
    deepest = max(warm, default=1)
    per_stage = [lagged_sequence(s, sg.num_micro_batches(s), warm[s], min(cap, deepest - warm[s]))
                 for s in range(sg.num_stages)]
    return assemble(sg, name, per_stage)


def zb_h1(sg: StageGraph, cluster: Cluster | None = None) -> Schedule:
    """ZB-H1 (module docstring) for a chain of stages, one stage per device.

    A stage graph with branches is refused: its schedule is :func:`graph_zb`.
    """
    if cluster is not None and cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}")
    if not sg.is_chain():
        raise ScheduleError("zb-h1 needs a chain of stages and this stage graph has branches; use 'graph-zb', "
                            "zero bubble for stage graphs")
    warm = schedule_warmups(sg)
    return _lagged_schedule(sg, "zb-h1", warm, max(warm, default=1))


def graph_zb(sg: StageGraph, cluster: Cluster | None = None) -> Schedule:
    """Graph-1F1B with the backward split and W's deferred (module docstring), best lag cap by simulation.

    Without a cluster the candidates are compared on compute alone (free
    communication), as the structural graph-1F1B needs none.
    """
    if cluster is not None and cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}")
    warm = schedule_warmups(sg)
    deepest = max(warm, default=1)
    if cluster is None:  # compare on compute alone: free communication (memory needs no links)
        cluster = Cluster(name="compute-only", num_devices=sg.num_devices, devices_per_node=sg.num_devices,
                          device=DeviceSpec(name="any", memory_bytes=math.inf, peak_flops=1.0, op_overhead_s=0.0),
                          intra_node=Link(0.0, math.inf), inter_node=Link(0.0, math.inf))
    best: tuple[float, Schedule] | None = None
    act_limit = mem_limit = math.inf
    for cap in range(deepest):  # cap 0 first: it holds what graph-1F1B holds, and ties keep the least memory
        schedule = _lagged_schedule(sg, "graph-zb", warm, cap)
        timeline = simulate(sg, schedule, cluster)
        act = max(timeline.activation_peak_bytes, default=0.0)
        mem = timeline.peak_memory_bytes
        if best is None:
            best = (timeline.iteration_time_s, schedule)
            act_limit = act * (1 + 1e-12)
            mem_limit = max(max(mem, default=0.0), cluster.device.memory_bytes)
        elif (act <= act_limit and max(mem, default=0.0) <= mem_limit
              and timeline.iteration_time_s < best[0] * (1 - 1e-12)):
            best = (timeline.iteration_time_s, schedule)
    return best[1]


def v_shape_groups(sg: StageGraph, name: str = "zbv") -> tuple[tuple[int, ...], ...]:
    """The ``K`` device groups of a V-shaped layout (stage ``s`` and ``2K-1-s`` on group ``s``), or a
    :class:`ScheduleError` naming what is wrong."""
    n = sg.num_stages
    hint = f"plan with --schedule {name}, which cuts the model into that V"
    if n % 2 or n < 2:
        raise ScheduleError(f"{name} needs 2K stages in a V on K device groups; the stage graph has {n} stages — {hint}")
    k = n // 2
    if not sg.is_chain() or any(sg.succs(s) != (s + 1,) for s in range(n - 1)):
        raise ScheduleError(f"{name} needs a chain of stages 0 -> 1 -> ... -> {n - 1}, and these stages branch "
                            "(a model with parallel branches has no V layout: use graph-zb)")
    groups = tuple(sg.stages[s].devices for s in range(k))
    for s in range(k, n):
        if sg.stages[s].devices != groups[n - 1 - s]:
            raise ScheduleError(f"{name} needs stage {s} on the devices of stage {n - 1 - s} "
                                f"({list(groups[n - 1 - s])}), found {list(sg.stages[s].devices)}; {hint}")
    if len(set(groups)) != k:
        raise ScheduleError(f"{name} needs the first {k} stages on {k} different device groups; {hint}")
    if len({st.micro_batch_size for st in sg.stages}) > 1:
        raise ScheduleError(f"{name} needs one micro-batch size for all stages")
    return groups


def zbv(sg: StageGraph, cluster: Cluster | None = None) -> Schedule:
    """ZB-V (module docstring): per rank ``r`` of ``K``, chunk 0 = stage ``r``, chunk 1 = stage ``2K-1-r``.

    Phases (Qi et al. §6, Fig. 8; the order torch 2.13's ``ScheduleZBVZeroBubble`` runs):

    1. warm-up: ``2(K-r)-1`` forwards of chunk 0 (the V's descent needs that many in flight below);
       ``r`` pairs (F chunk 1, F chunk 0); ``K-r`` triples (F, I, W) of chunk 1 — the bottom of the V
       turns the first micro-batches around at once;
    2. steady state, while chunk 0 has forwards left or chunk 1 lags behind: (F, I, W) of chunk 0
       (F only while micro-batches remain), then (F, I, W) of chunk 1;
    3. cool-down: ``r`` pairs (I chunk 0, I chunk 1) with their W's deferred, then ``K-r`` pairs
       (I, W) of chunk 0, then every W left (chunk 1's first): the deferred W's fill the drain.

    Counts assume at least ``2K-1`` micro-batches; with fewer the phases are laid out for ``2K-1`` and the
    actions of micro-batches that do not exist are dropped, as torch does.
    """
    if cluster is not None and cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}")
    groups = v_shape_groups(sg)
    k = len(groups)
    m = sg.num_micro_batches(0)
    padded = max(2 * k - 1, m)
    lists: list[list[Action]] = [[] for _ in range(sg.num_devices)]
    for r, devices in enumerate(groups):
        chunk0, chunk1 = r, 2 * k - 1 - r
        count: dict[tuple[int, str], int] = {}
        acts: list[Action] = []

        def emit(stage: int, kind: str, mb: int | None = None) -> None:
            j = count.get((stage, kind), 0) if mb is None else mb
            count[(stage, kind)] = j + 1
            acts.append(Action(stage, kind, j))

        def done(stage: int, kind: str) -> int:
            return count.get((stage, kind), 0)

        for _ in range(2 * (k - r) - 1):
            emit(chunk0, "F")
        for _ in range(r):
            emit(chunk1, "F")
            emit(chunk0, "F")
        for _ in range(k - r):
            for kind in "FIW":
                emit(chunk1, kind)
        while done(chunk1, "F") < done(chunk0, "F") or done(chunk0, "F") < padded:
            if done(chunk0, "F") < padded:
                emit(chunk0, "F")
            for stage in (chunk0, chunk1):
                for kind in ("IW" if stage == chunk0 else "FIW"):
                    emit(stage, kind)
        for _ in range(r):  # W's of these I's are deferred to the drain
            emit(chunk0, "I")
            emit(chunk1, "I")
        for _ in range(k - r):
            emit(chunk0, "I")
            emit(chunk0, "W")
        for stage in (chunk1, chunk0):
            while done(stage, "W") < done(stage, "I"):
                emit(stage, "W")
        kept = [a for a in acts if a.mb_id < m]
        for d in devices:
            lists[d] = list(kept)
    return Schedule.from_lists("zbv", lists)


def dualpipev(sg: StageGraph, cluster: Cluster | None = None) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto one V; torch's ``ScheduleDualPipeV``) on the V layout.

    Rank ``r`` of ``K`` hosts chunk 0 = stage ``r`` (going down the V) and
    chunk 1 = stage ``2K-1-r`` (coming back up). Its order, in eight phases:

    1. ``2(K-1-r)`` forwards of chunk 0: what the ranks below need in flight;
    2. ``r+1`` pairs (F chunk 0, F chunk 1);
    3. ``K-1-r`` triples (I chunk 1, its W at once, F chunk 1): the bottom of
       the V turns its first micro-batches around with split backwards;
    4. steady state, ``M-2K+r+1`` rounds of (F chunk 0, B chunk 1, F chunk 1,
       B chunk 0): DualPipe pairs a forward with a backward of the other
       chunk so one's compute hides the other's communication (torch runs
       each pair as one ``OVERLAP_F_B`` action; here they run in turn, the
       same per-rank order);
    5. ``K-1-r`` triples (B chunk 1, F chunk 1, B chunk 0);
    6. ``r+1`` pairs (backward chunk 1, backward chunk 0), switching from
       whole backwards to I's (W deferred) halfway through — one pair earlier
       on odd ranks;
    7. ``K-1-r`` pairs (a deferred W, a backward of chunk 0);
    8. the last ``r+1`` deferred W's, oldest first.

    Needs at least ``2K`` micro-batches (torch's condition); ``cluster`` is unused (the order is fixed).
    """
    if cluster is not None and cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}")
    groups = v_shape_groups(sg, "dualpipev")
    k = len(groups)
    m = sg.num_micro_batches(0)
    if m < 2 * k:
        fix = (f"use a micro-batch size of at most {sg.batch_size // (2 * k)}" if sg.batch_size >= 2 * k
               else f"use a batch of at least {2 * k} samples")
        raise ScheduleError(f"dualpipev needs at least as many micro-batches as stages ({2 * k}), the batch gives "
                            f"{m}: {fix}")
    lists: list[list[Action]] = [[] for _ in range(sg.num_devices)]
    for r, devices in enumerate(groups):
        down, up = r, 2 * k - 1 - r
        acts: list[Action] = []
        next_mb: dict[tuple[int, str], int] = {}  # (stage, "F" or "G"radient) -> its next micro-batch
        deferred: deque[Action] = deque()  # W's of the I's run so far, oldest first

        def emit(stage: int, kind: str) -> None:
            key = (stage, "F" if kind == "F" else "G")
            j = next_mb.get(key, 0)
            next_mb[key] = j + 1
            acts.append(Action(stage, kind, j))
            if kind == "I":
                deferred.append(Action(stage, "W", j))

        def weight() -> None:
            if deferred:
                acts.append(deferred.popleft())

        for _ in range(2 * (k - 1 - r)):
            emit(down, "F")
        for _ in range(r + 1):
            emit(down, "F")
            emit(up, "F")
        for _ in range(k - 1 - r):
            emit(up, "I")
            weight()
            emit(up, "F")
        for _ in range(m - 2 * k + r + 1):
            for stage, kind in ((down, "F"), (up, "B"), (up, "F"), (down, "B")):
                emit(stage, kind)
        for _ in range(k - 1 - r):
            emit(up, "B")
            emit(up, "F")
            emit(down, "B")
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            emit(up, "I" if split else "B")
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            emit(down, "I" if split else "B")
        for _ in range(k - 1 - r):
            weight()
            emit(down, "I" if split else "B")
        for _ in range(r + 1):
            weight()
        for d in devices:
            lists[d] = list(acts)
    return Schedule.from_lists("dualpipev", lists)


def interleaved_zb(sg: StageGraph, groups: Sequence[Sequence[int]], per_round: int) -> Schedule:
    """Interleaved 1F1B with split backward on the round-robin layout ``groups`` (stage ``s`` on group
    ``s % K``), ``per_round`` micro-batches per round (both from
    :func:`graphpipe.sched.generators.interleaved_layout`, which checks them).

    Rank ``r`` of ``K`` with ``v`` chunks runs ``M*v`` forwards; micro-batches advance in rounds of
    ``R = M / max(1, M // K)``. Its ``k``-th forward is on chunk ``(k // R) % v`` and its ``k``-th input
    gradient on chunk ``v - 1 - (k // R) % v``. The warm-up is ``(v-1) R + (K-1-r)`` forwards — one per hop
    from the last rank, not interleaved 1F1B's two, because an I comes back sooner than a B — then each
    step runs F then I, and from the ``r``-th step on also the W of the oldest I not yet followed by
    one; the cool-down runs the remaining I's the same way, then the W's left. This is the order of torch
    2.13's ``ScheduleInterleavedZeroBubble`` (tested against it).
    """
    k_groups = len(groups)
    v = sg.num_stages // k_groups
    total = sg.num_micro_batches(0) * v
    lists: list[list[Action]] = [[] for _ in range(sg.num_devices)]
    for r, devices in enumerate(groups):
        warm = min((v - 1) * per_round + (k_groups - 1 - r), total)
        count: dict[tuple[int, str], int] = {}
        acts: list[Action] = []
        grad_steps: list[int] = []  # the step of every I issued, oldest first: its W follows in that order

        def emit(stage: int, kind: str) -> None:
            j = count.get((stage, kind), 0)
            count[(stage, kind)] = j + 1
            acts.append(Action(stage, kind, j))

        def forward_stage(step: int) -> int:
            return ((step // per_round) % v) * k_groups + r

        def grad_stage(step: int) -> int:
            return (v - 1 - ((step - warm) // per_round) % v) * k_groups + r

        for step in range(total + warm):
            if step < warm:
                emit(forward_stage(step), "F")
                continue
            if step < total:
                emit(forward_stage(step), "F")
            emit(grad_stage(step), "I")
            grad_steps.append(step)
            if step - warm >= r:
                emit(grad_stage(grad_steps[len(grad_steps) - 1 - r]), "W")
        for step in grad_steps[len(grad_steps) - min(r, len(grad_steps)):]:
            emit(grad_stage(step), "W")
        for d in devices:
            lists[d] = list(acts)
    return Schedule.from_lists("interleaved-zb", lists)
