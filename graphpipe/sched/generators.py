"""Schedule generators (GPipe, 1F1B, interleaved 1F1B) and the schedule registry, :data:`SCHEDULES` (docs/design.md#schedules-and-the-simulator).

Each registry entry (:class:`ScheduleSpec`, looked up with :func:`get_schedule`) carries its generator and
what it needs of a plan: the stage layout it runs on (the strategy's own, looped device groups, or a V),
split backward, asynchrony, its micro-batch rules. :func:`make_schedule` generates and validates one.

Each generator is a pure function of a :class:`StageGraph` returning a
:class:`Schedule` (per-device action lists; every replica of a stage gets the
stage's list). Per-device orders match ``torch.distributed.pipelining``'s
``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` on
sequential chains (tested against torch).

* :func:`gpipe` — fill-drain (GPipe, Huang et al. 2019): all forwards in
  micro-batch order, then all backwards in micro-batch order. Bubble
  ``(K-1)/(M+K-1)`` on K equal stages with M micro-batches.
* :func:`one_f_one_b` — PipeDream-Flush 1F1B (Narayanan et al. 2021): stage
  ``i`` of ``K`` warms up with ``min(K-i, M)`` forwards, then alternates one
  backward and one forward, then drains. Works on any stage DAG by treating a
  topological order of the stages as the chain (the SPP baseline that
  graph-1F1B is compared against); at most ``K-i`` micro-batches in flight.
* :func:`interleaved_1f1b` — Megatron-LM interleaved 1F1B (Narayanan et al.
  SC'21 §2.2): ``K*v`` virtual stages placed round-robin (stage ``s`` on
  device group ``s % K``); bubble time shrinks by ``v``.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("c", [Op("a", "x"), Op("b", "x")], [("a", "b", 1.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 3, 2)
>>> print(make_schedule("gpipe", sg).to_text())
0: 0F0 0F1 0F2 0B0 0B1 0B2
1: 1F0 1F1 1F2 1B0 1B1 1B2
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, Sequence

from graphpipe.actions import Action, Schedule
from graphpipe.cluster import Cluster
from graphpipe.errors import InputError, ScheduleError
from graphpipe.graph import OpGraph
from graphpipe.stages import Stage, StageGraph

from graphpipe.sched.graph1f1b import (assemble, graph_1f1b, one_f_one_b_sequence, round_robin_rule_applies,
                                       round_robin_warmups, warmup_counts)
from graphpipe.sched.validate import validate_schedule
from graphpipe.sched.zero_bubble import dualpipev, graph_zb, interleaved_zb, zb_h1, zbv

__all__ = ["gpipe", "gpipe_time_bound_s", "one_f_one_b", "interleaved_1f1b", "round_robin_chain", "looped_chain", "v_shape_chain", "make_schedule",
           "SCHEDULE_NAMES", "SCHEDULES", "ScheduleSpec", "get_schedule", "ORDER_FROM_COSTS", "V_LAYOUT_SCHEDULES",
           "interleaved_groups", "interleaved_layout"]


def gpipe(sg: StageGraph) -> Schedule:
    """Fill-drain: per device, every forward of its stages (stage order, mb order), then every backward.

    Backwards run in increasing micro-batch order, as torch's ``ScheduleGPipe``
    does; with several (virtual) stages on one device, later stages'
    backwards come first (they are the ones whose gradients arrive first).
    """
    # The replicas of a (not round-robin) stage run the same list: build it once and share the tuple (at 1024
    # devices a plan's replicas hold most of the schedule's actions).
    built: dict[tuple, tuple[Action, ...]] = {}
    lists: list[tuple[Action, ...]] = []
    for d in range(sg.num_devices):
        stages = sg.stages_on_device(d)
        key = tuple((s, _own_micro_batches(sg, s, d)) for s in stages)
        if key not in built:
            built[key] = (tuple(Action(s, "F", j) for s, mine in key for j in mine)
                          + tuple(Action(s, "B", j) for s, mine in reversed(key) for j in mine))
        lists.append(built[key])
    return Schedule.from_lists("gpipe", lists)


def gpipe_time_bound_s(sg: StageGraph, cluster) -> float | None:
    """No simulation of :func:`gpipe`'s schedule of ``sg`` on dedicated devices ends an iteration sooner;
    None where this bound does not apply (a device holding several stages, a round-robin stage, stages
    of different micro-batch sizes).

    Each device runs its stage's M forwards in micro-batch order, then its M backwards. So the last
    forward on a stage ends no earlier than its first forward's start (after its producers' first forwards and
    its own all-gather at the step's start, if any) plus M forwards, nor than the last
    forward on each producer plus that edge's delay and one forward (``f_end``); its first backward (of
    micro-batch 0) starts after that, and after the first backward of each consumer plus one backward
    and the delay (``b_start``); its last backward ends M backwards later, and a replicated stage's
    gradient all-reduce follows it; nor can it end before the last backward on each consumer plus the
    delay and one backward (``b_end``: every micro-batch's backward waits for the consumer's of the same
    micro-batch). The durations and delays are the simulator's (longest paths over
    the engine's own dependencies, with the waits left out); a search compares the bound to a
    throughput with a relative margin far above the rounding of these sums.
    """
    from graphpipe.sched.simulator import edge_delay

    stages = sg.stages
    devices = [d for st in stages for d in st.devices]
    if (len(devices) != len(set(devices)) or any(st.round_robin for st in stages)
            or len({st.micro_batch_size for st in stages}) > 1):
        return None
    n = sg.num_stages
    m = sg.num_micro_batches(0) if n else 0
    fwd = [sg.fwd_time(s) for s in range(n)]
    bwd = [sg.bwd_time(s) for s in range(n)]
    delay = {(p, c): edge_delay(sg, cluster, p, c) for p, c in sg.edges}
    f_start, f_end = sg.gather_times(cluster), [0.0] * n   # stage ids are a topological order
    for s in range(n):
        preds = sg.preds(s)
        f_start[s] = max([f_start[s]] + [f_start[p] + fwd[p] + delay[(p, s)] for p in preds])
        f_end[s] = max([f_start[s] + m * fwd[s]] + [f_end[p] + delay[(p, s)] + fwd[s] for p in preds])
    b_start, b_end = [0.0] * n, [0.0] * n
    end = 0.0
    for s in range(n - 1, -1, -1):
        succs = sg.succs(s)
        b_start[s] = max([f_end[s]] + [b_start[c] + bwd[c] + delay[(s, c)] for c in succs])
        b_end[s] = max([b_start[s] + m * bwd[s]] + [b_end[c] + delay[(s, c)] + bwd[s] for c in succs])
        last = b_end[s]
        if stages[s].num_replicas > 1:
            last += sg.sync_time(s, cluster)
        end = max(end, last)
    return end


def _own_micro_batches(sg: StageGraph, stage_id: int, device: int) -> range:
    """The micro-batches of ``stage_id`` that ``device`` runs: all of them, or under round-robin the ``i mod r``
    that :meth:`Stage.replica_of` gives it (a stride, not a scan: at 1024 devices a scan per device is N x M)."""
    st = sg.stages[stage_id]
    m = sg.num_micro_batches(stage_id)
    if not st.round_robin:
        return range(m)
    return range(st.devices.index(device) // st.group_size, m, st.num_groups)


def one_f_one_b(sg: StageGraph, order: Sequence[int] | None = None) -> Schedule:
    """1F1B over the linear stage order ``order`` (default: stage ids ``0..K-1``).

    Stage ``order[i]`` warms up with ``min(K - i, M)`` forwards (with equal
    micro-batch sizes; with mixed sizes the warm-up rule of
    :mod:`graphpipe.sched.graph1f1b` is applied along the chain, so it is
    measured in each stage's own micro-batches). ``order`` must be a
    topological order of the stage graph: skip edges (0 -> 2) are fine.
    """
    n = sg.num_stages
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ScheduleError(f"1f1b order {order} is not a permutation of the stage ids 0..{n - 1}")
    position = {s: i for i, s in enumerate(order)}
    for p, c in sg.edges:
        if position[p] > position[c]:
            raise ScheduleError(f"1f1b order {order} puts stage {c} before its producer {p}; pass a topological order")
    # The chain successor plus the real successors: with equal sizes the chain
    # successor dominates (warm-ups strictly decrease along the order), with
    # mixed sizes the real edges keep the rule deadlock-free.
    successors = [tuple(sorted(set(sg.succs(s)) | ({order[position[s] + 1]} if position[s] + 1 < n else set())))
                  for s in range(n)]
    warm = warmup_counts(sg, successors)
    if round_robin_rule_applies(sg):
        # 1F1B-RR: each replica admits K - i of its own, along the chain of the order
        chain = [(order[position[s] + 1],) if position[s] + 1 < n else () for s in range(n)]
        warm = round_robin_warmups(sg, chain, warm)
    per_stage = [one_f_one_b_sequence(s, sg.num_micro_batches(s), warm[s]) for s in range(n)]
    return assemble(sg, "1f1b", per_stage)


def interleaved_groups(sg: StageGraph) -> tuple[tuple[int, ...], ...]:
    """The ``K`` device groups of a round-robin virtual-stage layout, or a :class:`ScheduleError`."""
    groups: list[tuple[int, ...]] = []
    for st in sg.stages:
        if st.devices in groups:
            break
        groups.append(st.devices)
    k = len(groups)
    if k == sg.num_stages:
        raise ScheduleError(f"interleaved 1F1B needs several virtual stages per device group; all {k} stages are on "
                            f"different devices: use --schedule 1f1b, or plan with --virtual-stages 2 (or auto), whose "
                            f"stages take the device groups in turn (stage s on group s % K)")
    if sg.num_stages % k:
        raise ScheduleError(f"interleaved 1F1B needs the same number of stages on each of the {k} device groups; "
                            f"{sg.num_stages} stages is not a multiple of {k}; use --schedule 1f1b, or a plan with "
                            f"{k * (sg.num_stages // k + 1)} stages taking the groups in turn")
    for st in sg.stages:
        if st.devices != groups[st.id % k]:
            raise ScheduleError(f"interleaved 1F1B needs stage s on device group s % {k}; stage {st.id} is on "
                                f"{list(st.devices)}, expected {list(groups[st.id % k])}; use --schedule "
                                f"1f1b, or a plan whose stages take the device groups in turn")
    sizes = {st.micro_batch_size for st in sg.stages}
    if len(sizes) > 1:
        raise ScheduleError(f"interleaved 1F1B needs one micro-batch size for all stages, got {sorted(sizes)}")
    return tuple(groups)


def interleaved_layout(sg: StageGraph, schedule: str) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(device groups, micro-batches per round) of an interleaved schedule named ``schedule``.

    Micro-batches advance in rounds of ``R = M / max(1, M // K)`` (``R = K``
    when ``K`` divides ``M``, fewer when ``M < K``); like torch, a round count
    that does not divide ``M`` is refused rather than padded.
    """
    groups = interleaved_groups(sg)
    k_groups = len(groups)
    m = sg.num_micro_batches(0)
    rounds = max(1, m // k_groups)
    if m % rounds:
        raise ScheduleError(f"{schedule} runs micro-batches in {rounds} rounds of about K={k_groups}: the number "
                            f"of micro-batches ({m} = batch {sg.batch_size} / {sg.stages[0].micro_batch_size}) must be "
                            f"a multiple of {rounds}; use a multiple of {k_groups} micro-batches")
    return groups, m // rounds


def interleaved_1f1b(sg: StageGraph) -> Schedule:
    """Megatron-LM interleaved 1F1B over ``K`` device groups with ``v = num_stages / K`` virtual stages each.

    Rank ``r`` (device group ``r``) runs ``M*v`` forwards and backwards. Its
    ``k``-th forward is on chunk ``(k // R) % v`` (stage ``chunk*K + r``), its
    ``k``-th backward on chunk ``v - 1 - (k // R) % v``, where micro-batches
    advance in rounds of ``R = M / max(1, M // K)`` (``R = K`` when ``K``
    divides ``M``, Megatron's setting). The warm-up is ``(v-1)*R + 2*(K-1-r)``
    forwards (capped at ``M*v``): enough for the first backward of the last
    chunk to come back. Then each step runs one forward and one backward
    (forward first, as in Megatron and torch's ``ScheduleInterleaved1F1B``),
    then the remaining backwards drain. The number of rounds must divide ``M``.
    """
    groups, per_round = interleaved_layout(sg, "interleaved 1F1B")
    k_groups = len(groups)
    v = sg.num_stages // k_groups
    total = sg.num_micro_batches(0) * v
    lists: list[list[Action]] = [[] for _ in range(sg.num_devices)]
    for r, devices in enumerate(groups):
        warm = min((v - 1) * per_round + 2 * (k_groups - 1 - r), total)
        f_next: dict[int, int] = {}
        b_next: dict[int, int] = {}

        def forward(k: int) -> Action:
            s = ((k // per_round) % v) * k_groups + r
            f_next[s] = f_next.get(s, -1) + 1
            return Action(s, "F", f_next[s])

        def backward(k: int) -> Action:
            s = (v - 1 - (k // per_round) % v) * k_groups + r
            b_next[s] = b_next.get(s, -1) + 1
            return Action(s, "B", b_next[s])

        acts = [forward(k) for k in range(warm)]
        for k in range(total - warm):
            acts.append(forward(warm + k))
            acts.append(backward(k))
        acts.extend(backward(k) for k in range(total - warm, total))
        for d in devices:
            lists[d] = list(acts)
    return Schedule.from_lists("interleaved", lists)


def round_robin_chain(graph: OpGraph, num_devices: int, virtual_per_device: int, batch_size: int,
                      micro_batch_size: int) -> StageGraph:
    """Cut the op order ``0..n-1`` into ``K*v`` contiguous pieces of near-equal time, placed round-robin.

    Piece ``s`` goes on device ``s % K`` (:func:`looped_chain` with one device per group). Contiguous ranges
    of a topological order are convex (a path between two ops of ``[i, j]`` only visits ids between them),
    so every piece is a valid stage. The cut minimises the slowest piece's ``fwd + bwd`` time at
    ``micro_batch_size``.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1), Affine(0, 2)) for i in range(8)],
    ...                   [(f"l{i}", f"l{i+1}", 1) for i in range(7)])
    >>> sg = round_robin_chain(g, 2, 2, 4, 1)
    >>> [(s.op_ids, s.devices) for s in sg.stages]
    [((0, 1), (0,)), ((2, 3), (1,)), ((4, 5), (0,)), ((6, 7), (1,))]
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise InputError(f"num_devices must be a positive integer, got {num_devices!r}")
    return looped_chain(graph, tuple((d,) for d in range(num_devices)), virtual_per_device, batch_size,
                        micro_batch_size, sequential=False)


def looped_chain(graph: OpGraph, groups: Sequence[Sequence[int]], virtual: int, batch_size: int,
                 micro_batch_size: int, recompute: bool = False, num_devices: int | None = None,
                 sequential: bool = True) -> StageGraph:
    """The op order cut into ``K*v`` contiguous stages placed in turn over the ``K`` device ``groups``.

    Stage ``s`` runs on group ``s % K`` (interleaved 1F1B's looped layout, Narayanan et al. SC'21 §2.2);
    a group of ``r`` devices splits each micro-batch over its replicas. The cut minimises the slowest
    stage's ``fwd + bwd`` time per micro-batch on its group (each replica runs ``micro_batch_size / r``
    samples): a bisection on that bottleneck with a greedy test, each stage taking as many ops as fit,
    which is exact for a fixed order of stages. ``sequential`` (the default) makes stage ``i`` feed only
    stage ``i + 1``, which relays whatever crosses the cut (as torch's pipelines do), so a model with
    branches still gives a chain; contiguous ranges of a topological order are convex.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1), Affine(0, 2)) for i in range(6)],
    ...                   [(f"l{i}", f"l{i+1}", 1) for i in range(5)])
    >>> sg = looped_chain(g, [(0, 1), (2,)], 2, 4, 2)
    >>> [(s.op_ids, s.devices) for s in sg.stages]
    [((0, 1), (0, 1)), ((2,), (2,)), ((3, 4), (0, 1)), ((5,), (2,))]
    """
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
        raise InputError(f"the number of virtual stages per device group must be a positive integer, got {virtual!r}")
    groups = tuple(tuple(g) for g in groups)
    k = len(groups)
    pieces = k * virtual
    n = graph.num_ops
    if n < pieces:
        raise InputError(f"cannot cut {n} ops into {pieces} virtual stages ({k} device groups x {virtual}); "
                         "use fewer devices or virtual stages")
    rows = []
    for devices in groups:
        share = micro_batch_size / len(devices)
        rows.append([graph.fwd_time((i,), share) + graph.bwd_time((i,), share) for i in range(n)])
    bounds = [0, *_balanced_cuts(rows, pieces), n]
    stages = [Stage(s, tuple(range(bounds[s], bounds[s + 1])), groups[s % k], micro_batch_size, recompute)
              for s in range(pieces)]
    return StageGraph.build(graph, stages, batch_size,
                            num_devices if num_devices is not None else 1 + max(d for g in groups for d in g),
                            allow_shared_devices=virtual > 1, sequential=sequential)


def v_shape_chain(graph: OpGraph, num_devices: int, batch_size: int, micro_batch_size: int) -> StageGraph:
    """Cut the op order into ``2K`` balanced contiguous pieces placed in a V (zero bubble's ZB-V layout):
    piece ``s`` on device ``s`` for ``s < K`` and on device ``2K-1-s`` after, so device ``d`` hosts the
    ``d``-th stage from the start and the ``d``-th from the end.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1), Affine(0, 2)) for i in range(8)],
    ...                   [(f"l{i}", f"l{i+1}", 1) for i in range(7)])
    >>> [s.devices for s in v_shape_chain(g, 2, 4, 1).stages]
    [(0,), (1,), (1,), (0,)]
    """
    sg = round_robin_chain(graph, num_devices, 2, batch_size, micro_batch_size)
    k = num_devices
    stages = [replace(st, devices=(s if s < k else 2 * k - 1 - s,)) for s, st in enumerate(sg.stages)]
    return StageGraph.build(graph, stages, batch_size, num_devices, allow_shared_devices=True)


def _balanced_cuts(rows: Sequence[Sequence[float]], pieces: int) -> list[int]:
    """Cut positions splitting the ops into exactly ``pieces`` non-empty runs, minimising the largest run's
    sum; run ``s`` costs op ``i`` ``rows[s % len(rows)][i]`` (its device group's time for it)."""
    n = len(rows[0])

    def greedy(limit: float) -> list[int] | None:
        cuts, acc, piece = [], 0.0, 0
        for i in range(n):
            row = rows[piece % len(rows)]
            # Cut before i when adding it would pass the limit, or when the ops
            # left are only just enough to give every remaining piece one.
            if i > 0 and (acc + row[i] > limit or n - i == pieces - 1 - len(cuts)):
                cuts.append(i)
                acc, piece = 0.0, piece + 1
                row = rows[piece % len(rows)]
                if piece >= pieces:
                    return None
            if row[i] > limit:
                return None
            acc += row[i]
        return cuts if len(cuts) <= pieces - 1 else None

    lo, hi = 0.0, sum(max(column) for column in zip(*rows))
    for _ in range(100):
        mid = (lo + hi) / 2
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = greedy(hi) or []
    # Fewer runs than asked (possible when many ops cost zero): split the longest runs.
    while len(cuts) < pieces - 1:
        bounds = [0, *cuts, n]
        widest = max(range(len(bounds) - 1), key=lambda i: (bounds[i + 1] - bounds[i], -i))
        cuts = sorted([*cuts, (bounds[widest] + bounds[widest + 1]) // 2])
    return cuts


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """One schedule of the registry (:data:`SCHEDULES`): how to generate it and what it needs of a plan.

    The planner reads these fields instead of testing schedule names (as torch's ``get_schedule_class`` maps a
    name to a class whose attributes say what it needs), so a new schedule is a generator and one entry.
    """

    name: str
    """The ``--schedule`` name, also written as the plan's ``schedule.name``."""
    generate: Callable[[StageGraph, Cluster | None], Schedule]
    """``generate(stage_graph, cluster_or_None) -> Schedule``, not yet validated."""
    summary: str
    """One line for people: the schedule and where it comes from."""
    layout: Literal["plan", "looped", "v"] = "plan"
    """The stage layout it runs on: ``plan``, the strategy's own stage graph; ``looped``, ``K x v`` stages taking
    the strategy's ``K`` device groups in turn (:mod:`graphpipe.search.looped`); ``v``, the model cut into ``2K``
    stages in a V on ``K`` devices (:func:`v_shape_chain`)."""
    split_backward: bool = False
    """Backward split into input gradient (``I``) and weight gradient (``W``) actions (zero bubble)."""
    asynchronous: bool = False
    """No flush: PipeDream's weight versions (:mod:`graphpipe.sched.async_pipe`); scored as a steady state."""
    one_micro_batch_size: bool = False
    """Every stage must run the same micro-batch size."""
    shrinks_micro_batch: bool = False
    """The planner may lower the strategy's micro-batch size (to smaller divisors of the batch) until the
    schedule accepts the plan and it fits in memory, unless the size was forced (DualPipeV needs enough
    micro-batches for its V)."""
    order_from_costs: bool = False
    """The action order depends on the stage graph's costs (graph-zb simulates candidates); every other
    order reads only the structure (stages, devices, micro-batch counts)."""
    base: str | None = None
    """The schedule whose plan this one starts from: the strategy searches and is scored under ``base``, then
    its plan is converted (asynchronous schedules stream the 1F1B partition) or its micro-batch size is cut
    into this layout (the V). None: the strategy searches under this schedule itself (a looped layout starts
    from the strategy's own plan, whose device groups it takes in turn)."""

    def __post_init__(self) -> None:
        if self.layout not in ("plan", "looped", "v"):
            raise InputError(f"schedule {self.name!r}: layout must be plan, looped or v, got {self.layout!r}")


def _interleaved_zb(sg: StageGraph, cluster: Cluster | None) -> Schedule:
    return interleaved_zb(sg, *interleaved_layout(sg, "interleaved-zb"))


def _window(name: str) -> Callable[[StageGraph, Cluster | None], Schedule]:
    """PipeDream's asynchronous pipelines (:mod:`graphpipe.sched.async_pipe`): the plan keeps one mini-batch of
    the 1F1B order for display and validation; simulator and runtime stream it without a flush."""
    return lambda sg, cluster: Schedule(name, one_f_one_b(sg).device_actions)


SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec(name="gpipe", generate=lambda sg, cluster: gpipe(sg),
                 summary="fill-drain: every forward, then every backward (GPipe)"),
    ScheduleSpec(name="1f1b", generate=lambda sg, cluster: one_f_one_b(sg),
                 summary="PipeDream-Flush 1F1B along a topological order of the stages"),
    ScheduleSpec(name="interleaved", generate=lambda sg, cluster: interleaved_1f1b(sg), layout="looped",
                 one_micro_batch_size=True,
                 summary="Megatron-LM interleaved 1F1B over K device groups with v stages each"),
    ScheduleSpec(name="graph-1f1b", generate=graph_1f1b,
                 summary="GraphPipe's 1F1B on the stage DAG, warm-ups from every successor"),
    ScheduleSpec(name="zb-h1", generate=zb_h1, split_backward=True,
                 summary="zero bubble ZB-H1: 1F1B with weight gradients deferred into the bubbles (chains)"),
    ScheduleSpec(name="graph-zb", generate=graph_zb, split_backward=True, order_from_costs=True,
                 summary="graph-1F1B with split backward, W lag picked by simulation"),
    ScheduleSpec(name="zbv", generate=zbv, layout="v", split_backward=True, one_micro_batch_size=True,
                 shrinks_micro_batch=True, base="1f1b",
                 summary="zero bubble ZB-V on 2K stages in a V"),
    ScheduleSpec(name="dualpipev", generate=dualpipev, layout="v", split_backward=True, one_micro_batch_size=True,
                 shrinks_micro_batch=True, base="1f1b",
                 summary="DualPipeV (DeepSeek-V3's DualPipe folded onto one V) on 2K stages in a V"),
    ScheduleSpec(name="interleaved-zb", generate=_interleaved_zb, layout="looped", split_backward=True,
                 one_micro_batch_size=True,
                 summary="interleaved 1F1B with split backward over K device groups with v stages each"),
    ScheduleSpec(name="1f1b-async", generate=_window("1f1b-async"), asynchronous=True, base="1f1b",
                 summary="PipeDream's asynchronous 1F1B: no flush, weight stashing"),
    ScheduleSpec(name="2bw", generate=_window("2bw"), asynchronous=True, base="1f1b",
                 summary="PipeDream-2BW: no flush, double-buffered weight versions"),
)}
"""Every generated schedule by name (``"cpsat"`` is an optimiser over plans, :mod:`graphpipe.search.cpsat`)."""

SCHEDULE_NAMES = tuple(SCHEDULES)

ORDER_FROM_COSTS = frozenset(name for name, spec in SCHEDULES.items() if spec.order_from_costs)
"""Schedules whose action order depends on the stage graph's costs (:attr:`ScheduleSpec.order_from_costs`)."""

V_LAYOUT_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.layout == "v")
"""Schedules that run on :func:`v_shape_chain`'s layout only (the planner cuts the model into it)."""


def get_schedule(name: str) -> ScheduleSpec:
    """The registry entry of schedule ``name`` (any case), or a :class:`ScheduleError` listing the known names.

    >>> get_schedule("ZBV").layout, get_schedule("zbv").split_backward, get_schedule("2bw").base
    ('v', True, '1f1b')
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in SCHEDULES:
        hint = " ('cpsat' is graphpipe.search.cpsat.optimize_plan)" if key == "cpsat" else ""
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULE_NAMES)}{hint}")
    return SCHEDULES[key]


def make_schedule(name: str, sg: StageGraph, cluster: Cluster | None = None, *, validate: bool = True) -> Schedule:
    """The schedule ``name`` for ``sg``, validated (``gpipe``, ``1f1b``, ``interleaved``, ``graph-1f1b``,
    and zero bubble's ``zb-h1``, ``graph-zb``, ``zbv``, ``dualpipev`` and ``interleaved-zb``, :mod:`graphpipe.sched.zero_bubble`).

    ``"cpsat"`` is an optimiser over plans and lives in
    :mod:`graphpipe.search.cpsat`, not here. ``validate=False`` is for a
    caller that simulates the schedule at once: :func:`~graphpipe.sched.simulate`
    runs the validator's own checks (``check_structure``, then the deadlock
    check on the engine it runs anyway), so validating first would run them twice.
    """
    spec = get_schedule(name)
    if cluster is not None and cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}")
    schedule = spec.generate(sg, cluster)
    if validate:
        validate_schedule(sg, schedule)
    return schedule
