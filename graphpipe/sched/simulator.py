"""The discrete-event simulator: one schedule in, one :class:`Timeline` out (docs/design.md#schedules-and-the-simulator).

Semantics (shared with the CP-SAT model and relied on by the partitioners):

* each device runs its action list in order; an action starts when the
  device is free and all its inputs have arrived;
* every replica of a data-parallel stage runs every action of the stage on
  ``micro_batch_size / len(devices)`` samples: ``sg.fwd_time(s)`` /
  ``sg.bwd_time(s)``;
* ``F`` of consumer ``c`` mb ``j`` waits for ``F`` of every producer mb in
  ``sg.consumed_mbs(p, c, j)`` followed by a transfer of
  ``edge_bytes(p, c) * b_p`` bytes taking ``cluster.transfer_time(p.devices,
  c.devices, nbytes)`` — a pure delay from the end of the producer action
  (the latest replica); links carry concurrent transfers without contention,
  compute and communication overlap;
* ``B`` of producer ``p`` mb ``i`` waits for ``B`` of every consumer mb
  covering any of ``i``'s samples plus the same transfer time back, and for
  its own ``F``;
* memory (:mod:`graphpipe.costs`, the one model): activations of stage
  ``s`` on each of its devices, ``act_bytes_per_sample(s) *
  samples_per_replica`` from the start of ``F`` to the end of its ``B``; a
  re-materializing stage keeps only its input bytes from ``F`` to ``B`` and
  its full activations from the start of ``B`` (the re-run forward, inside
  ``B``'s duration) to its end; plus model state and communication buffers
  of every stage on the device for the whole iteration (at equal times a
  release is counted before an allocation);
* zero bubble's split backward: ``I`` (input gradients) has ``B``'s
  dependencies and sends its gradients, ``W`` (weight gradients) follows its
  ``I`` on the device and sends nothing; their times split ``B`` by
  :meth:`StageGraph.split_backward_times` (:func:`graphpipe.costs.weight_grad_time`:
  an op's W as ``graphpipe profile`` measured it, else half of a parameterised
  op's backward, :data:`graphpipe.costs.WEIGHT_GRAD_SHARE`);
  a micro-batch's activations live until its ``W`` ends (W reads them), a
  re-materialized working set from the start of ``I`` to the end of ``W``;
* after a replicated stage's last ``B`` (latest over replicas) its devices
  all-reduce gradients for ``cluster.allreduce_time(devices, param_bytes)``;
  the all-reduce is communication, it overlaps later compute of other
  (virtual) stages on the same devices; an FSDP stage gathered for the step
  instead all-gathers its parameters from the step's start
  (:meth:`StageGraph.gather_time`: no F of it starts before that ends, while
  the pipeline fills) and reduce-scatters its gradients after its last ``B``
  (:meth:`StageGraph.sync_time`);
* the iteration ends when every device has finished, all-reduces included;
  throughput = ``batch_size / iteration_time``.

The evaluation is a longest-path pass over the action DAG
(:mod:`graphpipe.sched.engine`), linear in actions plus dependencies: 32
stages x 256 micro-batches take a few tens of milliseconds
(``python -m graphpipe.evals.bench_simulator``).

Devices without any stage report bubble fraction 1.0 (idle the whole
iteration) and memory 0, so every per-device list has one entry per device
of the cluster; ``mean_bubble_fraction`` in :func:`predicted_figures`
averages only the devices in use.

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.stages import Stage, StageGraph
>>> from graphpipe.cluster import preset
>>> from graphpipe.sched import make_schedule
>>> g = OpGraph.build("c", [Op(n, "x", Affine(0, 1.0), Affine(0, 2.0)) for n in "ab"], [("a", "b", 0.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 2, 2)
>>> tl = simulate(sg, make_schedule("gpipe", sg), preset("v100", 2))
>>> tl.iteration_time_s, tl.bubble_fraction
(9.0, (0.33333333333333337, 0.33333333333333337))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from graphpipe import costs
from graphpipe.actions import Action, Schedule
from graphpipe.cluster import Cluster
from graphpipe.errors import ScheduleError
from graphpipe.stages import StageGraph

from graphpipe.sched.engine import covering_consumer_mbs, drain_tails, lockstep_classes, run_engine, run_engine_shared
from graphpipe.sched.validate import check_structure, raise_deadlock

__all__ = ["SharedHost", "ActionRecord", "TransferRecord", "AllReduceRecord", "Timeline", "simulate", "build_timeline",
           "predicted_figures", "edge_delay", "Score", "score"]


@dataclass(frozen=True, slots=True)
class SharedHost:
    """Devices that are not dedicated processors but share one host (CPU ranks on fewer free cores).

    ``points`` are ``(k, slowdown)`` pairs, ``k`` ascending from 1: while
    ``k`` devices compute at once, each runs ``slowdown`` times slower than
    alone. Between points the slowdown is interpolated linearly; past the
    last point it grows in proportion to ``k`` (every core already shared).
    :meth:`cores` is pure time sharing; a table measured on the host (the
    runtime benchmark times one training step in ``k`` processes at once)
    also carries the memory-bandwidth and cache contention of ``k`` ranks.

    >>> SharedHost.cores(2).slowdown(3), SharedHost(((1, 1.0), (4, 2.5))).slowdown(2)
    (1.5, 1.5)
    """

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        ks = [k for k, _ in self.points]
        if not ks or ks[0] != 1 or any(b <= a for a, b in zip(ks, ks[1:])):
            raise ValueError(f"SharedHost points need k = 1, 2, ... strictly ascending from 1, got k = {ks}")
        bad = [(k, v) for k, v in self.points if not (math.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"SharedHost slowdowns must be positive and finite, got {bad}")

    @classmethod
    def cores(cls, num_cores: int) -> "SharedHost":
        """Pure time sharing of ``num_cores`` cores: ``slowdown(k) = max(1, k / num_cores)``."""
        if num_cores < 1:
            raise ValueError(f"a host needs at least one core, got {num_cores}")
        return cls(((1, 1.0), (num_cores, 1.0)) if num_cores > 1 else ((1, 1.0),))

    def slowdown(self, k: int) -> float:
        pts = self.points
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, s0), (k1, s1) in zip(pts, pts[1:]):
            if k <= k1:
                return s0 + (s1 - s0) * (k - k0) / (k1 - k0)
        k_last, s_last = pts[-1]
        return s_last * k / k_last


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One action executed on one device, ``start``/``end`` in seconds from the iteration start."""

    device: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One message along a stage edge: activations (``fwd``, src=producer) or gradients (``bwd``, src=consumer).

    ``src_mbs`` are the sender's micro-batch ids in the message, ``dst_mbs``
    the receiver's micro-batches that need it; ``src_devices``/``dst_devices`` the devices that send and receive
    it: all of a stage whose replicas split each micro-batch, the group a round-robin stage gave those
    micro-batches.
    """

    src_stage: int
    dst_stage: int
    src_mbs: tuple[int, ...]
    dst_mbs: tuple[int, ...]
    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    start: float
    end: float
    nbytes: float
    direction: str


@dataclass(frozen=True, slots=True)
class AllReduceRecord:
    """The gradient all-reduce of a replicated stage, or an FSDP stage's all-gather at the step's start and
    reduce-scatter after its last backward (``collective``)."""

    stage_id: int
    devices: tuple[int, ...]
    start: float
    end: float
    nbytes: float
    collective: str = "allreduce"
    """``allreduce``, ``allgather`` or ``reducescatter``."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """What happened (simulated or measured) in one training iteration, plus its derived figures."""

    name: str
    """Schedule name (``gpipe``, ``1f1b``, ``graph-1f1b``, ...)."""
    source: str
    """``simulated`` or ``measured``."""
    batch_size: int
    num_devices: int
    stage_devices: tuple[tuple[int, ...], ...]
    """Device set of each stage (for labels and per-stage figures)."""
    actions: tuple[ActionRecord, ...]
    """Sorted by (device, start)."""
    transfers: tuple[TransferRecord, ...]
    allreduces: tuple[AllReduceRecord, ...]
    iteration_time_s: float
    throughput: float
    """Samples per second: ``batch_size / iteration_time_s``."""
    busy_s: tuple[float, ...]
    """Compute seconds per device."""
    bubble_fraction: tuple[float, ...]
    """``1 - busy / iteration_time`` per device; 1.0 for devices with no stage."""
    peak_memory_bytes: tuple[float, ...]
    """Model state + peak live activations per device."""
    state_bytes: tuple[float, ...]
    """Model state (weights, gradients, optimizer) per device."""
    in_flight: tuple[int, ...]
    """Most micro-batches of each stage alive at once (F started, B — or W of a split backward — not ended), in the
    stage's own micro-batches."""
    activation_peak_bytes: tuple[float, ...] = ()
    """Peak live activation bytes per device (stashes + re-materialized working sets), state and buffers excluded:
    what a run measures as the peak bytes of tensors saved for backward."""
    buffer_bytes: tuple[float, ...] = ()
    """Communication buffers per device (:func:`graphpipe.costs.buffer_bytes`)."""
    recompute_s: tuple[float, ...] = ()
    """Per stage: seconds of re-run forward at the start of each of its B actions (0 without re-materialization)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    def devices_used(self) -> tuple[int, ...]:
        return tuple(sorted({d for devs in self.stage_devices for d in devs}))

    def stage_first_devices(self) -> tuple[int, ...]:
        """The first device of each stage, sorted, once each: one row per stage for a trace or a chart of a plan on
        thousands of devices, where a stage's other devices repeat its row with other micro-batches (or the same
        ones: replicas splitting each micro-batch)."""
        return tuple(sorted({devs[0] for devs in self.stage_devices if devs}))


def edge_delay(sg: StageGraph, cluster: Cluster, producer: int, consumer: int) -> float:
    """Seconds one producer micro-batch's message takes along ``producer -> consumer`` (either direction)."""
    src, dst = sg.stages[producer], sg.stages[consumer]
    nbytes = sg.edge_bytes(producer, consumer) * src.micro_batch_size
    if src.round_robin or dst.round_robin:
        # 1F1B-RR: a micro-batch goes whole from one group of replicas to one group, over as many links as the
        # smaller group has replicas (transfer_time shards it over min(|src|, |dst|) links, so scale the bytes
        # by that over the group's links).
        nbytes *= min(src.num_replicas, dst.num_replicas) / min(src.shards_per_micro_batch, dst.shards_per_micro_batch)
    return cluster.transfer_time(src.devices, dst.devices, nbytes)


def _engine_inputs(sg: StageGraph, cluster: Cluster):
    """(delay per stage edge, ``duration(stage, kind)``, ``delay(p, c)``): the engine's inputs for ``sg``."""
    delays = {(p, c): edge_delay(sg, cluster, p, c) for p, c in sg.edges}
    split = [sg.split_backward_times(s) for s in range(sg.num_stages)]
    times = {"F": [sg.fwd_time(s) for s in range(sg.num_stages)], "B": [sg.bwd_time(s) for s in range(sg.num_stages)],
             "I": [i for i, _ in split], "W": [w for _, w in split]}
    return delays, (lambda s, k: times[k][s]), (lambda p, c: delays[(p, c)])


def _runs_on(stage, mb_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The devices of ``stage`` that run micro-batches ``mb_ids``: every device for a stage whose replicas split each
    micro-batch, the micro-batches' own groups for a round-robin one (a message leaves or reaches those only)."""
    if not stage.round_robin:
        return stage.devices
    out: dict[int, None] = {}
    for i in mb_ids:
        out.update(dict.fromkeys(stage.replica_of(i)))
    return tuple(out)


def simulate(sg: StageGraph, schedule: Schedule, cluster: Cluster, host: SharedHost | None = None) -> Timeline:
    """Simulate one iteration of ``schedule`` on ``sg`` and ``cluster`` (semantics in the module docstring).

    With ``host``, the devices share one host's processors: every action
    that runs while ``k`` devices compute is ``host.slowdown(k)`` times
    slower (:func:`graphpipe.sched.engine.run_engine_shared`); transfers and
    all-reduces stay pure delays. This predicts CPU ranks time-sharing fewer
    cores, where concurrent branch stages gain nothing once every core is busy.

    Raises :class:`ScheduleError` for a malformed schedule and
    :class:`DeadlockError` (naming the blocked actions) when it cannot finish.
    """
    delays, starts, ends, result = _action_times(sg, schedule, cluster, host)
    actions = [ActionRecord(d, a, starts[d][k], ends[d][k])
               for d, acts in enumerate(schedule.device_actions) for k, a in enumerate(acts)]
    transfers = []
    for p, c in sg.edges:
        nbytes = sg.edge_bytes(p, c) * sg.stages[p].micro_batch_size
        f_end, b_end = result.stage_end[p][0], result.stage_end[c][1]
        for i in range(sg.num_micro_batches(p)):
            users = tuple(covering_consumer_mbs(sg, p, c, i))
            src_dev, dst_dev = _runs_on(sg.stages[p], (i,)), _runs_on(sg.stages[c], users)
            start = f_end[i]
            transfers.append(TransferRecord(p, c, (i,), users, src_dev, dst_dev, start, start + delays[(p, c)],
                                            nbytes, "fwd"))
            start = max(b_end[k] for k in users)
            transfers.append(TransferRecord(c, p, users, (i,), dst_dev, src_dev, start, start + delays[(p, c)],
                                            nbytes, "bwd"))
    allreduces = [AllReduceRecord(*span) for span in _allreduce_spans(sg, cluster, result)]
    return build_timeline(sg, cluster, schedule.name, actions, transfers, allreduces, source="simulated")


def simulate_figures(sg: StageGraph, schedule: Schedule, cluster: Cluster,
                     host: SharedHost | None = None) -> dict[str, Any]:
    """``predicted_figures(simulate(sg, schedule, cluster, host))`` without the timeline's records.

    A plan keeps the figures, not the records: at thousands of micro-batches
    the records are hundreds of thousands of objects (one per action and two
    per message) built only to be summed. The same structure check, engine
    run and memory model as :func:`simulate`, the same summation order, so
    the same numbers (tests compare them on every schedule).
    """
    _, starts, ends, result = _action_times(sg, schedule, cluster, host)
    # devices of one lockstep class share their action list and their times (the same objects): each distinct
    # triple is sorted once and its figures computed once, however many thousand replicas share it
    sorted_once: dict[tuple[int, int, int], list] = {}
    by_device = []
    for d, acts in enumerate(schedule.device_actions):
        key = (id(acts), id(starts[d]), id(ends[d]))
        if key not in sorted_once:
            sorted_once[key] = sorted(zip(acts, starts[d], ends[d]), key=_by_start) if acts else []
        by_device.append(sorted_once[key])
    spans = _allreduce_spans(sg, cluster, result)
    distinct_ends = {id(e): e for e in ends}.values()
    iteration_time_s = max([e for acts in distinct_ends for e in acts] + [span[3] for span in spans] + [0.0])
    busy, bubble, state, buffers, act_peak, in_flight = _device_figures(sg, cluster, by_device, iteration_time_s)
    peak = [state[d] + buffers[d] + act_peak[d] for d in range(sg.num_devices)]
    return _figures(schedule.name, "simulated", iteration_time_s, _throughput(sg, iteration_time_s), bubble, peak,
                    act_peak, in_flight, busy, sg.devices_used())


def _throughput(sg: StageGraph, iteration_time_s: float) -> float:
    return sg.batch_size / iteration_time_s if iteration_time_s > 0 else math.inf


def _by_start(entry: tuple[Action, float, float]) -> tuple[float, float]:
    return entry[1], entry[2]


def _check_cluster(sg: StageGraph, cluster: Cluster) -> None:
    if cluster.num_devices != sg.num_devices:
        raise ScheduleError(f"cluster has {cluster.num_devices} devices, the stage graph {sg.num_devices}; "
                            f"simulate with the plan's own cluster")


def _action_times(sg: StageGraph, schedule: Schedule, cluster: Cluster, host: SharedHost | None):
    """(delay per stage edge, starts and ends per device in list order, engine result): the structure check and
    the engine run that :func:`simulate` and :func:`simulate_figures` share."""
    _check_cluster(sg, cluster)
    check_structure(sg, schedule)
    delays, duration, delay = _engine_inputs(sg, cluster)
    if host is not None:  # a shared host's speed depends on how many devices run at once: every device is simulated
        result = run_engine_shared(sg, schedule.device_actions, duration, delay, delay, host.slowdown,
                                   sg.gather_times(cluster))
        if result.stuck:
            raise_deadlock(schedule, result.stuck)
        return delays, result.starts, result.ends, result
    # dedicated devices: one device of each lockstep class stands for the others
    _, rep_index, result = _run_lockstep(sg, schedule, cluster, duration, delay)
    starts = [result.starts[i] if i is not None else () for i in rep_index]
    ends = [result.ends[i] if i is not None else () for i in rep_index]
    return delays, starts, ends, result


def stage_finish_times(sg: StageGraph, schedule: Schedule, cluster: Cluster) -> list[float]:
    """Per stage, when its last backward (B, or W of a split one) ends on every replica, dedicated devices: where
    its step-end collective starts. The engine run of the schedule just simulated is reused (its last answer
    is kept), so a search asking this of the plan it simulated pays nothing more."""
    _, duration, delay = _engine_inputs(sg, cluster)
    _, _, result = _run_lockstep(sg, schedule, cluster, duration, delay)
    return [_last_backward_end(result, s) for s in range(sg.num_stages)]


def _last_backward_end(result, stage_id: int) -> float:
    """When stage ``stage_id``'s last backward (B, or W of a split one) ends on every replica, in the engine's
    ``result``: where its step-end collective starts."""
    return max((t for slot in (1, 2) for t in result.stage_end[stage_id][slot] if t == t), default=0.0)  # not nan


def _allreduce_spans(sg: StageGraph, cluster: Cluster, result) -> list[tuple]:
    """(stage, devices, start, end, bytes, collective) of each replicated stage's once-per-step collectives:
    the gradients' all-reduce (or an FSDP stage's reduce-scatter) starts when the stage's last backward (B, or W
    of a split one) ends on every replica; an FSDP stage gathered for the step all-gathers from 0."""
    spans = []
    for st in sg.stages:
        if st.num_replicas > 1:
            nbytes = sg.layout_param_bytes(st.id)
            gather = sg.gather_time(st.id, cluster)
            if gather > 0:
                spans.append((st.id, st.devices, 0.0, gather, nbytes, "allgather"))
            start = _last_backward_end(result, st.id)
            kind = "reducescatter" if st.shard == "fsdp" and not st.reshard_after_forward else "allreduce"
            spans.append((st.id, st.devices, start, start + sg.sync_time(st.id, cluster), nbytes, kind))
    return spans


def build_timeline(sg: StageGraph, cluster: Cluster, name: str, actions: Iterable[ActionRecord],
                   transfers: Iterable[TransferRecord] = (), allreduces: Iterable[AllReduceRecord] = (),
                   source: str = "measured", iteration_time_s: float | None = None) -> Timeline:
    """Assemble a :class:`Timeline` and derive its figures from records.

    The simulator uses it; so can the runtime, with measured records (times
    relative to the iteration start) — memory is then the analytical figure
    of the observed action times. ``iteration_time_s`` defaults to the latest
    end over actions and all-reduces.
    """
    actions = tuple(sorted(actions, key=lambda r: (r.device, r.start, r.end)))
    transfers = tuple(transfers)
    allreduces = tuple(allreduces)
    num_devices = sg.num_devices
    if iteration_time_s is None:
        iteration_time_s = max([r.end for r in actions] + [r.end for r in allreduces] + [0.0])
    by_device: list[list[tuple[Action, float, float]]] = [[] for _ in range(num_devices)]
    for r in actions:
        by_device[r.device].append((r.action, r.start, r.end))
    busy, bubble, state, buffers, act_peak, in_flight = _device_figures(sg, cluster, by_device, iteration_time_s)
    peak = [state[d] + buffers[d] + act_peak[d] for d in range(num_devices)]
    throughput = _throughput(sg, iteration_time_s)
    return Timeline(name=name, source=source, batch_size=sg.batch_size, num_devices=num_devices,
                    stage_devices=tuple(st.devices for st in sg.stages), actions=actions, transfers=transfers,
                    allreduces=allreduces, iteration_time_s=iteration_time_s, throughput=throughput,
                    busy_s=tuple(busy), bubble_fraction=bubble, peak_memory_bytes=tuple(peak),
                    state_bytes=tuple(state), in_flight=tuple(in_flight), activation_peak_bytes=tuple(act_peak),
                    buffer_bytes=tuple(buffers),
                    recompute_s=tuple(sg.recompute_time(s) for s in range(sg.num_stages)))


def _device_figures(sg: StageGraph, cluster: Cluster, by_device: Sequence[Sequence[tuple[Action, float, float]]],
                    iteration_time_s: float):
    """(busy seconds, bubble fraction, state, buffers, activation peak) per device and in-flight per stage, from
    each device's (action, start, end) in (start, end) order: the per-device figures of a timeline."""
    busy = [0.0] * sg.num_devices
    summed: dict[int, float] = {}  # by list identity: lockstep replicas share one (simulate_figures)
    for d, entries in enumerate(by_device):
        if id(entries) in summed:
            busy[d] = summed[id(entries)]
            continue
        for _, start, end in entries:
            busy[d] += end - start
        summed[id(entries)] = busy[d]
    used = set(sg.devices_used())
    bubble = tuple((1.0 - busy[d] / iteration_time_s if iteration_time_s > 0 else 0.0) if d in used else 1.0
                   for d in range(sg.num_devices))
    state, buffers, act_peak, in_flight = _memory(sg, cluster, range(sg.num_devices), by_device)
    return busy, bubble, state, buffers, act_peak, in_flight


def _memory_terms(sg: StageGraph, cluster: Cluster) -> tuple[list[float], list[float], list[float], list[float]]:
    """(state, buffers) per device and (stash, working set) per stage and micro-batch: :func:`_memory`'s terms."""
    state = [0.0] * sg.num_devices
    buffers = [0.0] * sg.num_devices
    stash, working = [], []
    for st in sg.stages:
        sums = sg.stage_sums(st.id)
        samples = st.samples_per_replica
        kept, rebuilt = sg.activation_terms(st.id)  # re-materialization in segments included
        stash.append(kept * samples)
        working.append(rebuilt * samples)
        held, buffered = sg.state_bytes(st.id, cluster), costs.buffer_bytes(sums.inputs, sums.outputs, samples)
        for d in st.devices:
            state[d] += held
            buffers[d] += buffered
    return state, buffers, stash, working


def peak_memory_in_order(sg: StageGraph, schedule: Schedule, cluster: Cluster,
                         devices: Iterable[int] | None = None) -> list[float]:
    """The peak bytes of ``devices`` (default every device, in order) under ``schedule``, as :func:`simulate`
    reports them, from the action order alone.

    A device runs its actions one after another, so the allocations and
    releases of :func:`_memory` happen in list order (a release at an
    action's end comes before the next action's start, as :func:`_memory`
    orders equal times): the peak needs no timing. (Equal to simulate's
    where actions take time: for a zero-length re-materializing backward,
    simulate sorts its release before its working set.) Linear in the actions,
    with no engine and no structure check, for what only needs memory (a
    refusal's numbers at thousands of micro-batches).
    """
    state, buffers, stash, working = _memory_terms(sg, cluster)
    peaks = []
    tops: dict[int, float] = {}  # by list identity: replicas sharing one list share its activation peak
    for d in range(sg.num_devices) if devices is None else devices:
        acts = schedule.device_actions[d]
        if id(acts) in tops:
            peaks.append(state[d] + buffers[d] + tops[id(acts)])
            continue
        live = top = 0.0
        for action in acts:
            s = action.stage_id
            if action.kind == "F":
                live += stash[s]
                top = max(top, live)
            elif action.kind in ("B", "I"):
                top = max(top, live + working[s])
                live += working[s] if action.kind == "I" else -stash[s]
            else:  # W: what its I left
                live -= stash[s] + working[s]
        tops[id(acts)] = top
        peaks.append(state[d] + buffers[d] + top)
    return peaks


def _memory(sg: StageGraph, cluster: Cluster, devices: Iterable[int],
            by_device: Sequence[Sequence[tuple[Action, float, float]]]):
    """(state, buffers, activation peak) per device of ``devices`` (0 elsewhere) and in-flight per stage.

    The memory model of :mod:`graphpipe.costs`: state and communication
    buffers for the whole iteration; a micro-batch's stash from its F start
    to its B (or W) end; a re-materializing stage's working set from the
    start of its B (or I) to that end. Releases count before allocations at
    equal times. ``by_device[d]``: device ``d``'s (action, start, end).
    """
    state, buffers, stash, working = _memory_terms(sg, cluster)
    act_peak = [0.0] * sg.num_devices
    in_flight = [0] * sg.num_stages
    peaks: dict[int, float] = {}  # by list identity: a shared list's peak (and its in-flight counts) once
    for d in devices:
        if id(by_device[d]) in peaks:
            act_peak[d] = peaks[id(by_device[d])]
            continue
        events = []
        for action, start, end in by_device[d]:
            s = action.stage_id
            if action.kind == "F":
                events.append((start, 1, s, stash[s]))
            elif action.kind in ("B", "I"):
                if working[s]:
                    events.append((start, 2, s, working[s]))
                if action.kind == "B":
                    events.append((end, 0, s, -stash[s] - working[s]))
            else:  # W: the activations its I left for it go now
                events.append((end, 0, s, -stash[s] - working[s]))
        live, count = 0.0, {}
        for _, kind, s, delta in sorted(events, key=lambda e: (e[0], e[1] > 0)):
            live += delta
            if kind != 2:
                count[s] = count.get(s, 0) + (1 if kind else -1)
                in_flight[s] = max(in_flight[s], count[s])
            act_peak[d] = max(act_peak[d], live)
        peaks[id(by_device[d])] = act_peak[d]
    return state, buffers, act_peak, in_flight


@dataclass(frozen=True, slots=True)
class Score:
    """What a search ranks a plan by: :func:`simulate`'s iteration time, throughput and largest peak memory."""

    iteration_time_s: float
    throughput: float
    max_peak_memory_bytes: float


_LAST_RUN: list[tuple] = []
"""The last :func:`_run_lockstep` (stage graph, cluster, action lists, its answer): at most one entry."""


def _run_lockstep(sg: StageGraph, schedule: Schedule, cluster: Cluster, duration, delay, classes=None,
                  give_up_after: float | None = None):
    """:func:`run_engine` on one device of each :func:`lockstep_classes` class: ``(representatives, each
    device's index among them, result)``; a deadlock raises :class:`DeadlockError` naming the real devices.
    ``classes``: :func:`lockstep_classes`'s answer, when the caller has it already; ``give_up_after``:
    :func:`run_engine`'s (a run that gave up is not kept).

    The last answer is kept and returned again for the same stage graph (the
    same object), an equal cluster and equal action lists: a search scores
    its winner and the planner then simulates that very schedule, and at
    thousands of micro-batches the engine is most of either's time.
    """
    if _LAST_RUN:
        last_sg, last_cluster, last_actions, answer = _LAST_RUN[0]
        if last_sg is sg and last_cluster == cluster and last_actions == schedule.device_actions:
            return answer
    reps, rep_index, replicas = classes if classes is not None else lockstep_classes(sg, schedule)
    acts = [schedule.device_actions[d] for d in reps]
    tails = drain_tails(sg, acts, duration) if give_up_after is not None else None
    result = run_engine(sg, acts, duration, delay, delay, replicas, give_up_after, tails, sg.gather_times(cluster))
    if result.gave_up:
        return reps, rep_index, result
    if result.stuck:
        raise_deadlock(schedule, [replace(s, device=reps[s.device]) for s in result.stuck])
    _LAST_RUN[:] = [(sg, cluster, schedule.device_actions, (reps, rep_index, result))]
    return reps, rep_index, result


def _peak_in_list_order(sg: StageGraph, schedule: Schedule, cluster: Cluster, devices: Iterable[int],
                        durations: Sequence[Sequence[float]]) -> float | None:
    """The largest peak bytes over ``devices`` exactly as :func:`_memory` sums them, or None when it cannot tell.

    When every action on a device takes time, its memory events in time
    order are its actions in list order (each action's allocation precedes
    its release, and the next action starts no earlier than that release,
    which sorts first at equal times), so the peak needs no start times: the
    same additions in the same order as :func:`_memory`, bit for bit. An
    action of zero length (an op with no cost) may reorder equal-time events:
    None then, and the caller falls back to the timed events.
    ``durations[s]``: stage ``s``'s F, B, I, W times.
    """
    state, buffers, stash, working = _memory_terms(sg, cluster)
    untimed = {(s, kind) for i, kind in enumerate("FBIW") for s in range(sg.num_stages) if not durations[s][i] > 0}
    # only a device holding such a stage can list such an action: the others need no scan
    suspects = {d for st in sg.stages if any((st.id, kind) in untimed for kind in "FBIW") for d in st.devices}
    release = [-stash[s] - working[s] for s in range(sg.num_stages)]  # what a B or W frees, as _memory adds it
    peak = 0.0
    for d in devices:
        acts = schedule.device_actions[d]
        if d in suspects and any((s, kind) in untimed for s, kind, _ in acts):
            return None
        live = top = 0.0
        for s, kind, _ in acts:  # (runs for every action of every scored schedule: kept to plain comparisons)
            if kind == "F":
                live += stash[s]
            elif kind == "B":
                if working[s]:
                    live += working[s]
                if live > top:
                    top = live
                live += release[s]
            elif kind == "I":
                if working[s]:
                    live += working[s]
            else:
                live += release[s]
            if live > top:
                top = live
        peak = max(peak, state[d] + buffers[d] + top)
    return peak


def score(sg: StageGraph, schedule: Schedule, cluster: Cluster, memory_limit: float | None = None,
          give_up_after: float | None = None) -> Score | None:
    """:func:`simulate`'s figures that rank plans, without building the timeline (dedicated devices).

    Devices whose action lists are equal run in lockstep -- the same
    actions, waiting on the same stage-level completions, for the same
    durations (the replicas of a stage that splits its micro-batches) -- so
    one device of each such class is simulated, standing for the others, and
    no per-action or per-message record is built. The figures equal
    :func:`simulate`'s (tests compare them). The schedule's structure is not
    checked: this is for schedules a generator made, scored many times in a
    search; :func:`simulate` the plan that wins. A deadlock still raises
    :class:`DeadlockError`.

    With ``memory_limit`` (bytes), a schedule whose peak memory provably
    exceeds it returns None without running the engine: a search that keeps
    only plans that fit needs no timing of one that does not (the peak comes
    from the action order, :func:`_peak_in_list_order`, when that is exact).

    With ``give_up_after`` (seconds), a schedule whose iteration provably
    ends later also returns None, as soon as the engine can tell
    (:func:`~graphpipe.sched.engine.run_engine`): a search that keeps only
    a plan faster than the best so far needs no exact time of a slower one.
    """
    _check_cluster(sg, cluster)
    _, duration, delay = _engine_inputs(sg, cluster)
    classes = lockstep_classes(sg, schedule)
    reps = classes[0]
    durations = [(duration(s, "F"), duration(s, "B"), duration(s, "I"), duration(s, "W")) for s in range(sg.num_stages)]
    peak = _peak_in_list_order(sg, schedule, cluster, reps, durations)
    if peak is not None and memory_limit is not None and peak > memory_limit:
        return None
    reps, _, result = _run_lockstep(sg, schedule, cluster, duration, delay, classes, give_up_after)
    if result.gave_up:
        return None
    acts = [schedule.device_actions[d] for d in reps]
    end = max((e[-1] for e in result.ends if e), default=0.0)
    for st in sg.stages:
        if st.num_replicas > 1:
            end = max(end, _last_backward_end(result, st.id) + sg.sync_time(st.id, cluster))
    if peak is None:
        by_device: list[list[tuple[Action, float, float]]] = [[] for _ in range(sg.num_devices)]
        for i, d in enumerate(reps):
            by_device[d] = list(zip(acts[i], result.starts[i], result.ends[i]))
        state, buffers, act_peak, _ = _memory(sg, cluster, reps, by_device)
        peak = max((state[d] + buffers[d] + act_peak[d] for d in range(sg.num_devices)), default=0.0)
    return Score(end, _throughput(sg, end), peak)


def predicted_figures(timeline: Timeline) -> dict[str, Any]:
    """The plan's ``predicted`` object: JSON-ready figures of a timeline.

    Keys: ``iteration_time_s``, ``throughput``, ``bubble_fraction`` and
    ``peak_memory_bytes`` and ``peak_activation_bytes`` (one entry per device of the cluster),
    ``in_flight`` (per stage), ``busy_s`` (per device),
    ``mean_bubble_fraction`` (over devices in use), ``max_peak_memory_bytes``,
    ``devices_used``, ``schedule``, ``source``.
    """
    return _figures(timeline.name, timeline.source, timeline.iteration_time_s, timeline.throughput,
                    timeline.bubble_fraction, timeline.peak_memory_bytes, timeline.activation_peak_bytes,
                    timeline.in_flight, timeline.busy_s, timeline.devices_used())


def _figures(name: str, source: str, iteration_time_s: float, throughput: float, bubble: Sequence[float],
             peak: Sequence[float], act_peak: Sequence[float], in_flight: Sequence[int], busy: Sequence[float],
             used: Sequence[int]) -> dict[str, Any]:
    """The ``predicted`` object from a timeline's figures (:func:`predicted_figures`, :func:`simulate_figures`)."""
    return {
        "iteration_time_s": iteration_time_s,
        "throughput": throughput,
        "bubble_fraction": list(bubble),
        "peak_memory_bytes": list(peak),
        "peak_activation_bytes": list(act_peak),
        "in_flight": list(in_flight),
        "busy_s": list(busy),
        "mean_bubble_fraction": (sum(bubble[d] for d in used) / len(used)) if used else 1.0,
        "max_peak_memory_bytes": max(peak, default=0.0),
        "devices_used": list(used),
        "schedule": name,
        "source": source,
    }

