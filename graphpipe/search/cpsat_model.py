"""The CP-SAT model of one pipeline iteration, built apart from solving it.

Decisions: each stage's micro-batch size (one boolean per candidate size,
exactly one true) and the order of every forward (F) and backward (B) task
on every device. Objective: the iteration makespan. The model mirrors the
simulator's semantics (docs/design.md#schedules-and-the-simulator, the shared "simulator semantics"):

* A stage with size ``b`` has ``batch_size // b`` micro-batches. Tasks are
  created for *every* candidate size's micro-batches as optional intervals,
  present only when that size is chosen.
* Replicas of a data-parallel stage run the same tasks, so a stage's tasks
  are modelled once on its device group; a task takes
  ``fwd_time(b / replicas)`` (resp. bwd) seconds.
* F of consumer micro-batch ``j`` waits for F of every producer micro-batch
  it covers (:func:`graphpipe.stages.covered_mbs`, as ``StageGraph.consumed_mbs``) plus the
  transfer of ``edge_bytes * producer_size`` bytes; B of the producer waits
  for B of the same consumer micro-batches plus the same transfer back.
* Activations of (stage, mb) (:mod:`graphpipe.costs`: ``act_bytes_per_sample * b / replicas`` on each
  device) live from the start of F to the end of B, never above device
  memory minus model state on any device group. Two equivalent encodings:
  ``"cumulative"`` (default): one optional interval per (stage, size, mb)
  from F start to B end with the activation bytes as demand, in an
  ``add_cumulative``; ``"reservoir"``: ``add_reservoir_constraint_with_active``
  with +act at F start and -act at B end. Both count a release before an
  allocation at the same instant, like the simulator. The reservoir is the
  literal statement, but CP-SAT expands it into one precedence literal per
  pair of events: on twobranch at 8 devices, batch 128, all candidate
  sizes, 128k booleans and 280k clauses whose presolve alone outlasts a 30 s
  limit, while the cumulative needs no expansion.
* A replicated stage all-reduces its gradients after its last B (an FSDP
  stage gathered for the step reduce-scatters, having all-gathered its
  parameters from time 0: none of its F's starts before that,
  :attr:`ModelData.release`); the iteration ends when every device is done.
* Split backward (zero bubble, ``split=True`` in :func:`model_data`): each B
  becomes two tasks, I (input gradients: B's dependencies, and what the
  producer's I waits for) and W (weight gradients, after its I on the same
  device, free to move into idle time); the activations live from F start
  to W end. Their durations split B by the cost model
  (:meth:`StageGraph.split_backward_times`). Re-materializing stages are not
  split (their working set would need its own interval), so a stage graph
  with one is modelled unsplit.

Time scale
----------
One integer tick is ``unit_s`` seconds, a power of ten chosen by
:func:`time_unit` so that the reference makespan (the heuristic's) is 10^7 to
10^8 ticks. Every duration and transfer is rounded **up** to whole ticks
(compute tasks to at least one tick, so intervals never have zero length and
the order on a device is read unambiguously from start times). Hence the
solver's schedule, replayed with exact durations in the same order (the
simulator), can only finish earlier. For a fixed order the makespan is a
longest path, and rounding lengthens a path by at most :func:`rounding_slack`
seconds (the rounding of every task of the chosen sizes, one transfer into
each task and one all-reduce). So when the solver proves optimality,
``0 <= solver_makespan - simulated_makespan <= slack``; when it stops at a
feasible solution its timing may be looser and only ``0 <=`` holds (the
simulated value is reported). The same slack makes the bound rigorous for
exact durations: ``exact optimum >= bound - slack``.

Memory is counted in units of ``mem_unit_bytes``, a power of ten that puts
the largest capacity near 10^6 units (CP-SAT multiplies demands by
durations in its energy reasoning; bytes times ticks would overflow int64).
Activations are rounded up and capacity down, so the model is conservative
by less than one unit (~1e-6 of memory) per micro-batch in flight.

Bounds and pruning
------------------
Optional intervals relax weakly in the LP, so the model carries redundant
constraints linear in the size literals: per device the work of the chosen
sizes, per stage a fill/drain chain, and per (stage, size) the bound of
:func:`size_lower_bounds` (fill, drain, the round trip of a micro-batch
through the downstream stages, and the in-flight limit that memory
imposes). The same bounds let :func:`prune_sizes` drop, before building the
model, every size that cannot beat a known schedule.

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.stages import Stage, StageGraph
>>> from graphpipe.cluster import preset
>>> g = OpGraph.build("c", [Op("a", "x", Affine(0, 1e-3), Affine(0, 2e-3)),
...                         Op("b", "x", Affine(0, 1e-3), Affine(0, 2e-3))], [("a", "b", 0.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 2)], 4, 2)
>>> data = model_data(sg, preset("v100", 2), candidates=[(2,), (2,)], reference_s=0.02)
>>> data.unit_s, data.duration[(0, 2, "F")], data.duration[(0, 2, "B")]
(1e-09, 2000000, 4000000)
>>> cm = build_model(data)
>>> sorted(cm.use)
[(0, 2), (1, 2)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ortools.sat.python import cp_model

from graphpipe import costs
from graphpipe.actions import Action, Schedule
from graphpipe.cluster import Cluster
from graphpipe.errors import InfeasibleError, InputError
from graphpipe.stages import StageGraph, covered_mbs

__all__ = [
    "TARGET_TICKS",
    "MEMORY_ENCODINGS",
    "MEMORY_UNITS",
    "ModelData",
    "CpsatModel",
    "time_unit",
    "stage_candidates",
    "model_data",
    "check_memory",
    "rounding_slack",
    "size_lower_bounds",
    "prune_sizes",
    "build_model",
    "task_graph",
    "replay",
    "memory_peaks",
    "add_hint",
    "schedule_from_starts",
]

TARGET_TICKS = 10**7
"""The reference makespan spans 10^7..10^8 ticks: rounding error per term is
at most 1e-7 of it, and int64 horizons stay far from overflow."""

MEMORY_UNITS = 10**6
"""Device memory spans about 10^6..10^7 memory units (see the module docstring)."""

TaskKey = tuple[int, str, int]
"""(stage_id, kind, mb_id) once sizes are fixed."""


@dataclass(frozen=True, slots=True)
class ModelData:
    """Everything the model needs, already in integer ticks and bytes."""

    sg: StageGraph
    unit_s: float
    """Seconds per tick."""
    slack_s: float
    """Most that rounding durations up can add to any path of a schedule (see :func:`rounding_slack`)."""
    candidates: tuple[tuple[int, ...], ...]
    """Candidate micro-batch sizes per stage (sorted)."""
    duration: Mapping[tuple[int, int, str], int]
    """(stage_id, size, kind) -> ticks of one F or B task on one replica."""
    delay: Mapping[tuple[int, int, int], int]
    """(producer, consumer, producer size) -> ticks of one transfer (both directions)."""
    act: Mapping[tuple[int, int], int]
    """(stage_id, size) -> activation memory units one micro-batch keeps on each of the stage's devices from its
    F start to its B end (only the stage inputs when the stage re-materializes)."""
    working: Mapping[tuple[int, int], int]
    """(stage_id, size) -> units a re-materializing stage's micro-batch adds during its B (0 otherwise)."""
    allreduce: tuple[int, ...]
    """Per stage: ticks of the gradient all-reduce after its last B (0 when not replicated)."""
    groups: tuple[tuple[int, ...], ...]
    """Distinct device sets; tasks of all stages on a group never overlap."""
    group_stages: tuple[tuple[int, ...], ...]
    mem_unit_bytes: float
    """Bytes per memory unit."""
    capacity: tuple[int, ...]
    """Per group: memory units left for activations on each device after model state."""
    state: tuple[float, ...]
    """Per group: model-state bytes on each device."""
    buffers: Mapping[tuple[int, int], int]
    """(stage_id, size) -> communication-buffer units resident for the whole iteration when the size is chosen
    (:func:`graphpipe.costs.buffer_bytes`)."""
    horizon: int
    """An upper bound on any left-justified schedule's makespan, in ticks."""
    uniform: bool
    """All stages must pick the same micro-batch size."""
    split: bool = False
    """Zero bubble: tasks F, I, W instead of F, B (module docstring)."""
    release: tuple[int, ...] = ()
    """Per stage: ticks before which none of its F's starts, its all-gather at the step's start
    (:meth:`graphpipe.stages.StageGraph.gather_time`; empty: none)."""

    def released(self, s: int) -> int:
        """Stage ``s``'s :attr:`release` (0 when none)."""
        return self.release[s] if self.release else 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """Task kinds per micro-batch: ``F, B`` or, split, ``F, I, W``."""
        return ("F", "I", "W") if self.split else ("F", "B")

    @property
    def grad(self) -> str:
        """The kind that sends gradients to the producers: B, or I when split."""
        return "I" if self.split else "B"

    @property
    def last(self) -> str:
        """The kind after which a micro-batch's activations are released: B, or W when split."""
        return "W" if self.split else "B"

    def work(self, s: int, b: int) -> int:
        """Ticks of one micro-batch's tasks of stage ``s`` at size ``b`` (F + B, or F + I + W)."""
        return sum(self.duration[(s, b, kind)] for kind in self.kinds)

    @property
    def num_stages(self) -> int:
        return self.sg.num_stages

    def num_mbs(self, size: int) -> int:
        return self.sg.batch_size // size


@dataclass(frozen=True, slots=True)
class CpsatModel:
    """The built model and its variables, keyed by index tuples."""

    data: ModelData
    model: cp_model.CpModel
    use: Mapping[tuple[int, int], cp_model.IntVar]
    """(stage_id, size) -> true when the stage runs micro-batches of that size."""
    start: Mapping[tuple[int, int, str, int], cp_model.IntVar]
    """(stage_id, size, kind, mb_id) -> start tick of the task."""
    interval: Mapping[tuple[int, int, str, int], cp_model.IntervalVar]
    life: Mapping[tuple[int, int, int], cp_model.IntVar]
    """(stage_id, size, mb_id) -> ticks from F start to B end (cumulative memory encoding only)."""
    makespan: cp_model.IntVar
    memory_groups: tuple[int, ...]
    """Groups that received a memory constraint (memory can bind there)."""


def time_unit(reference_s: float) -> float:
    """Power-of-ten seconds per tick that puts ``reference_s`` in [TARGET, 10*TARGET) ticks.

    >>> time_unit(0.02)
    1e-09
    """
    if not (reference_s > 0 and math.isfinite(reference_s)):
        return 1e-9
    exponent = math.floor(math.log10(reference_s / TARGET_TICKS))
    return float(f"1e{exponent}")


def _ticks(seconds: float, unit_s: float, minimum: int = 0) -> int:
    """Round up to whole ticks (see the module docstring for why up)."""
    return max(minimum, math.ceil(seconds / unit_s - 1e-12 * max(1.0, seconds / unit_s)))


def stage_candidates(sg: StageGraph, candidate_sizes: Sequence[int] | None,
                     per_stage: bool = True) -> tuple[tuple[int, ...], ...]:
    """Candidate sizes per stage: divisors of the batch (or ``candidate_sizes``)
    divisible by the stage's replica count, always including its current size
    (so the heuristic's schedule stays a feasible hint and the answer is never
    worse than it). ``per_stage=False`` keeps each stage at its current size.

    >>> from graphpipe.graph import Op, OpGraph
    >>> from graphpipe.stages import Stage
    >>> g = OpGraph.build("c", [Op("a", "x"), Op("b", "x")], [("a", "b", 0.0)])
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0, 1), 2), Stage(1, (1,), (2,), 2)], 8, 3)
    >>> stage_candidates(sg, None)
    ((2, 4, 8), (1, 2, 4, 8))
    """
    batch = sg.batch_size
    if candidate_sizes is None:
        pool = [d for d in range(1, batch + 1) if batch % d == 0]
    else:
        pool = []
        for size in candidate_sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1 or batch % size:
                raise InputError(f"candidate micro-batch size {size!r} must be a positive integer dividing "
                                 f"the batch size {batch}; use divisors such as "
                                 f"{[d for d in range(1, batch + 1) if batch % d == 0][:8]}")
            pool.append(size)
    result = []
    for stage in sg.stages:
        sizes = {stage.micro_batch_size}
        if per_stage:
            sizes |= {b for b in pool if b % stage.num_replicas == 0}
        result.append(tuple(sorted(sizes)))
    return tuple(result)


def model_data(sg: StageGraph, cluster: Cluster, candidates: Sequence[Sequence[int]],
               reference_s: float, uniform: bool = False, split: bool = False) -> ModelData:
    """Durations, delays and memory in ticks and bytes for every candidate size (``split``: I and W too)."""
    if split and any(st.recompute for st in sg.stages):
        raise InputError("the CP-SAT model splits backwards only for stages without re-materialization; "
                         "model this stage graph unsplit")
    if len(candidates) != sg.num_stages:
        raise InputError(f"need candidate sizes for {sg.num_stages} stages, got {len(candidates)}")
    cands = tuple(tuple(sorted(set(c))) for c in candidates)
    if uniform:
        common = set(cands[0]).intersection(*map(set, cands[1:]))
        if not common:
            raise InputError("no micro-batch size is a candidate for every stage (replica counts differ); "
                             "drop uniform sizes or pass candidate sizes divisible by every replica count")
        cands = tuple(tuple(sorted(common)) for _ in cands)
    unit = time_unit(reference_s)
    groups = tuple(sorted({s.devices for s in sg.stages}))
    group_stages = tuple(tuple(s.id for s in sg.stages if s.devices == grp) for grp in groups)
    sums = [sg.stage_sums(s) for s in range(sg.num_stages)]
    state = tuple(sum(sg.state_bytes(s, cluster) for s in members) for members in group_stages)
    mem_unit = float(f"1e{max(0, math.floor(math.log10(max(cluster.memory_bytes, 1.0) / MEMORY_UNITS)))}")
    capacity = tuple(math.floor((cluster.memory_bytes - st) / mem_unit) for st in state)
    g = sg.graph
    duration: dict[tuple[int, int, str], int] = {}
    act: dict[tuple[int, int], int] = {}
    working: dict[tuple[int, int], int] = {}
    buffers: dict[tuple[int, int], int] = {}
    task_error = []  # per stage: worst total rounding of all its tasks over its candidate sizes
    batch = sg.batch_size
    for stage in sg.stages:
        r = stage.num_replicas
        sm, rc = sums[stage.id], stage.recompute
        kept, rebuilt = sg.activation_terms(stage.id)
        worst = 0.0
        for b in cands[stage.id]:
            fwd, bwd = costs.action_times(sm.fwd_alpha, sm.fwd_beta, sm.bwd_alpha, sm.bwd_beta, b / r, rc)
            duration[(stage.id, b, "F")] = _ticks(fwd, unit, 1)
            duration[(stage.id, b, "B")] = _ticks(bwd, unit, 1)
            if split:  # the cost model's split (graphpipe.costs.split_backward); each part at least one tick
                weight = costs.weight_grad_time(g, stage.op_ids, b / r)
                i_s, w_s = costs.split_backward(bwd, weight, fwd, False)
                duration[(stage.id, b, "I")] = _ticks(i_s, unit, 1)
                duration[(stage.id, b, "W")] = _ticks(w_s, unit, 1)
            act[(stage.id, b)] = math.ceil(kept * b / r / mem_unit)
            working[(stage.id, b)] = math.ceil(rebuilt * b / r / mem_unit)
            buffers[(stage.id, b)] = math.ceil(costs.buffer_bytes(sm.inputs, sm.outputs, b / r) / mem_unit)
            rounded = sum(duration[(stage.id, b, kind)] for kind in (("F", "I", "W") if split else ("F", "B"))) * unit
            worst = max(worst, batch // b * max(0.0, rounded - fwd - bwd))
        task_error.append(worst)
    delay: dict[tuple[int, int, int], int] = {}
    delay_error = 0.0
    for p, c in sg.edges:
        src, dst = sg.stages[p].devices, sg.stages[c].devices
        for bp in cands[p]:
            seconds = cluster.transfer_time(src, dst, sg.edge_bytes(p, c) * bp)
            delay[(p, c, bp)] = _ticks(seconds, unit)
            delay_error = max(delay_error, delay[(p, c, bp)] * unit - seconds)
    allreduce_s = [sg.sync_time(s.id, cluster) for s in sg.stages]
    allreduce = tuple(_ticks(t, unit) for t in allreduce_s)
    allreduce_error = max((a * unit - t for a, t in zip(allreduce, allreduce_s)), default=0.0)
    release_s = sg.gather_times(cluster)
    release = tuple(_ticks(t, unit) for t in release_s)
    release_error = max((r * unit - t for r, t in zip(release, release_s)), default=0.0)
    # Horizon: a left-justified schedule idles only while waiting for a
    # transfer, at most once per task, so work + tasks * longest delay + the
    # longest all-reduce bounds its makespan.
    kinds = ("F", "I", "W") if split else ("F", "B")
    work = sum(max(batch // b * sum(duration[(s, b, kind)] for kind in kinds) for b in cands[s])
               for s in range(sg.num_stages))
    max_tasks = sum(len(kinds) * batch // min(cands[s]) for s in range(sg.num_stages))
    horizon = work + max_tasks * max(delay.values(), default=0) + max(allreduce, default=0) + max(release, default=0) + 1
    # Rounding slack: along any path every task appears at most once and each
    # step into a task crosses at most one transfer, then one all-reduce; a path starts at most at one release.
    slack = sum(task_error) + max_tasks * max(0.0, delay_error) + max(0.0, allreduce_error) + max(0.0, release_error)
    return ModelData(sg=sg, unit_s=unit, slack_s=slack, candidates=cands, duration=duration, delay=delay, act=act,
                     working=working, buffers=buffers,
                     allreduce=allreduce, groups=groups, group_stages=group_stages, mem_unit_bytes=mem_unit, capacity=capacity,
                     state=state, horizon=horizon, uniform=uniform, split=split, release=release)


def check_memory(data: ModelData, memory_bytes: float) -> None:
    """Raise :class:`InfeasibleError` when no schedule can fit some device.

    Necessary condition: model state plus one in-flight micro-batch of the
    stage with the largest smallest-candidate activation (a stage must hold
    at least one micro-batch between its F and B).
    """
    for gi, grp in enumerate(data.groups):
        need_act = max(min(data.act[(s, b)] + data.working[(s, b)] + data.buffers[(s, b)] for b in data.candidates[s])
                       * data.mem_unit_bytes for s in data.group_stages[gi])
        need = data.state[gi] + need_act
        if need > memory_bytes:
            stages = ", ".join(str(s) for s in data.group_stages[gi])
            raise InfeasibleError(
                f"device {grp[0]} (stage {stages}) needs at least {need:.4g} bytes (model state "
                f"{data.state[gi]:.4g} + one micro-batch of activations and buffers {need_act:.4g}) but has "
                f"{memory_bytes:.4g}; give the stage more devices, use a smaller micro-batch, or a larger device")


def rounding_slack(data: ModelData) -> float:
    """Seconds by which rounding up can lengthen any schedule of the model.

    For a fixed order the makespan is a longest path; rounding changes a
    path by the rounding of the tasks on it (at most all tasks of the chosen
    sizes), of the transfers into them (at most one per task), of one
    all-reduce and of one stage's release. So ``solver makespan - simulated makespan`` of the solver's
    order lies in ``[0, slack]`` and ``exact optimum >= bound - slack``.
    """
    return data.slack_s


def size_lower_bounds(data: ModelData, candidates: Sequence[Sequence[int]] | None = None) -> dict[tuple[int, int], int]:
    """Per (stage, size): a lower bound in ticks on the makespan of any schedule of the
    model in which the stage runs micro-batches of that size (the other stages at
    any of their ``candidates``, default the model's).

    Three terms, each the cheapest over the other stages' sizes, found by a
    dynamic programme over the stage DAG (stage ids are topological):

    * ``head``: the stage's first F waits for the producer micro-batches it
      covers (``covered_mbs``; a larger consumer size waits for several, run
      one after another on the producer), each producer after its own head,
      plus the transfer, and its own all-gather at the step's start
      (:attr:`ModelData.release`); ``tail``: after the stage's last B, every producer
      micro-batch covering the same samples still runs its B, then the
      producer's own tail (at least the stage's all-reduce).
    * ``down``: from the end of a micro-batch's F to the start of its B, the
      samples travel through every downstream stage and back (F and B of the
      consumer micro-batches covering them, with both transfers), computed
      for the first, the last and any micro-batch.
    * memory: at most ``k = capacity // activation`` micro-batches are in
      flight, so before the first B starts at most ``k`` F's ran, and before
      the last F starts at least ``M - k`` B's ended (F's and B's of a stage
      run in micro-batch order in the model).

    The bound is ``head + max(M (F + B), F + down_first + M B + (M - k) F,
    M F + (M - k) B + down_last + B) + tail``; infinite when one micro-batch
    does not fit. Split into I and W, B's role on the gradient path is I's
    (``tail`` follows the stage's last I), and a second bound counts every W
    too up to the stage's last W, followed only by its all-reduce. It relies
    on the model's symmetry breaking (in-order F's and B's, or F's, I's and
    W's), which :func:`graphpipe.search.cpsat.solve` always imposes.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> from graphpipe.stages import Stage, StageGraph
    >>> from graphpipe.cluster import preset
    >>> g = OpGraph.build("c", [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in "ab"], [("a", "b", 0.0)])
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 4, 2)
    >>> data = model_data(sg, preset("v100", 2), candidates=[(1, 2, 4)] * 2, reference_s=0.02)
    >>> bounds = size_lower_bounds(data)
    >>> bounds[(0, 1)], bounds[(0, 4)]   # 12 ms of own work; one micro-batch of 4 also waits >= 9 ms for stage 1
    (12000000, 21000000)
    """
    sg = data.sg
    cands = tuple(tuple(c) for c in (candidates or data.candidates))
    n_st = sg.num_stages
    dur = data.duration
    grad = data.grad  # gradients travel with B, or with I when the backward is split

    def count(producer: int, consumer: int, mb: int) -> int:
        return len(covered_mbs(producer, consumer, mb))

    head: dict[tuple[int, int], int] = {}
    tail: dict[tuple[int, int], int] = {}
    for s in range(n_st):  # producers before consumers
        for b in cands[s]:
            last = data.num_mbs(b) - 1
            head[s, b] = max([data.released(s)] + [min(head[p, bp] + count(bp, b, 0) * dur[p, bp, "F"]
                                                           + data.delay[p, s, bp] for bp in cands[p])
                                                       for p in sg.preds(s)])
            tail[s, b] = max([data.allreduce[s]] + [
                min(data.delay[p, s, bp] + count(bp, b, last) * dur[p, bp, grad] + tail[p, bp] for bp in cands[p])
                for p in sg.preds(s)])
    down: dict[tuple[str, int, int], int] = {}
    for s in reversed(range(n_st)):  # consumers before producers
        for b in cands[s]:
            num = data.num_mbs(b)
            for which, mb in (("first", 0), ("last", num - 1), ("any", None)):
                value = 0
                for c in sg.succs(s):
                    options = []
                    for bc in cands[c]:
                        f, bwd, wait = dur[c, bc, "F"], dur[c, bc, grad], data.delay[s, c, b]
                        # m: consumer micro-batches that hold samples of this micro-batch.
                        m = count(bc, b, mb) if mb is not None else min(count(bc, b, j) for j in range(num))
                        inner = down["last" if which == "last" else "any", c, bc]
                        via_first = down["first" if which == "first" else "any", c, bc]
                        extra = (count(b, bc, 0) - 1) * dur[s, b, "F"] if which == "first" else 0
                        options.append(2 * wait + extra + max(m * f + inner + bwd, f + via_first + m * bwd))
                    value = max(value, min(options))
                down[which, s, b] = value
    group_of = {s: gi for gi, members in enumerate(data.group_stages) for s in members}
    bounds: dict[tuple[int, int], int] = {}
    for s in range(n_st):
        for b in cands[s]:
            num, f = data.num_mbs(b), dur[s, b, "F"]
            act, capacity = data.act[s, b], data.capacity[group_of[s]] - data.working[s, b] - data.buffers[s, b]
            k = num if act <= 0 else min(num, max(0, capacity) // act)
            if capacity < act or capacity < 0:  # not even one micro-batch (and its re-materialized working set)
                k = 0
            if k == 0:
                bounds[s, b] = math.inf
                continue
            # Split: B's terms are I's up to the stage's last I (the producers' tail follows it), and the
            # W's come on top up to the stage's last W (only its own all-reduce follows that).
            bwd = dur[s, b, grad]
            w = dur[s, b, "W"] if data.split else 0
            to_last_grad = max(num * (f + bwd), f + down["first", s, b] + num * bwd + (num - k) * f,
                               num * f + (num - k) * (bwd + w) + down["last", s, b] + bwd)
            to_last_w = max(num * (f + bwd + w), f + down["first", s, b] + num * (bwd + w) + (num - k) * f,
                            num * f + (num - k) * (bwd + w) + down["last", s, b] + bwd + w)
            bounds[s, b] = head[s, b] + max(to_last_grad + tail[s, b], to_last_w + data.allreduce[s])
    return bounds


def prune_sizes(data: ModelData, upper_ticks: int) -> tuple[tuple[tuple[int, ...], ...], dict[tuple[int, int], int]]:
    """Candidate sizes that a schedule no slower than ``upper_ticks`` may use.

    Sound: a size whose :func:`size_lower_bounds` exceeds the makespan of a
    known schedule (the warm start) appears in no schedule at least as good,
    so the model's optimum and its bound are unchanged when the optimum is
    below ``upper_ticks``, and otherwise the known schedule is optimal. The
    bounds are recomputed over the surviving sizes until nothing changes
    (a schedule at most ``upper_ticks`` long uses survivors only).
    Returns the surviving candidates and, per pruned (stage, size), its bound
    (``math.inf`` when one micro-batch does not fit memory).
    """
    cands = [list(c) for c in data.candidates]
    pruned: dict[tuple[int, int], int] = {}
    changed = True
    while changed:
        changed = False
        bounds = size_lower_bounds(data, cands)
        for s, sizes in enumerate(cands):
            keep = [b for b in sizes if bounds[s, b] <= upper_ticks]
            if not keep:  # upper_ticks was not a schedule's makespan: keep the most promising size
                keep = [min(sizes, key=lambda b: bounds[s, b])]
            if len(keep) < len(sizes):
                pruned.update({(s, b): bounds[s, b] for b in sizes if b not in keep})
                cands[s] = keep
                changed = True
    return tuple(tuple(c) for c in cands), pruned


MEMORY_ENCODINGS = ("cumulative", "reservoir")


def build_model(data: ModelData, symmetry_breaking: bool = True, memory: str = "cumulative",
                upper_bound: int | None = None) -> CpsatModel:
    """The CP-SAT model (variables keyed by index tuples, one comment per constraint block).

    ``symmetry_breaking`` orders each stage's F tasks and its B tasks by
    micro-batch id. Micro-batches of a stage are interchangeable up to the
    sample ranges they share with neighbours, and every schedule generator
    and the runtime's per-link FIFO order use increasing ids, so this keeps
    the schedules the validator accepts; the tests compare against a brute
    force over the full order space on tiny instances. Without it the model
    admits orders that the validator's per-link FIFO check rejects, so
    :func:`graphpipe.search.cpsat.solve` always breaks symmetry.

    The blocks are added in a fixed order (variables, sizes, devices, task
    order, data dependencies, memory, makespan and its redundant bounds):
    the solver's search, and so the schedule among equal optima, depends on it.
    """
    horizon = data.horizon if upper_bound is None else min(data.horizon, upper_bound)
    v = _task_variables(data, horizon)
    _one_size_per_stage(v)
    _one_task_at_a_time(v)
    _task_order(v, symmetry_breaking)
    _data_dependencies(v)
    memory_groups, life = _memory_limits(v, memory)
    makespan = _makespan(v, symmetry_breaking)
    v.model.minimize(makespan)
    return CpsatModel(data=data, model=v.model, use=v.use, start=v.start, interval=v.interval, life=life,
                      makespan=makespan, memory_groups=tuple(memory_groups))


@dataclass(slots=True)
class _Vars:
    """A model being built and its task variables (the fields of :class:`CpsatModel` known so far)."""

    data: ModelData
    model: cp_model.CpModel
    horizon: int
    use: dict[tuple[int, int], cp_model.IntVar]
    start: dict[tuple[int, int, str, int], cp_model.IntVar]
    interval: dict[tuple[int, int, str, int], cp_model.IntervalVar]

    def end(self, s: int, b: int, kind: str, j: int):
        """End tick of task ``(s, b, kind, j)``: its start plus its fixed duration."""
        return self.start[s, b, kind, j] + self.data.duration[(s, b, kind)]


def _task_variables(data: ModelData, horizon: int) -> _Vars:
    """A size literal per (stage, candidate size) and an optional fixed-size interval per task of that size."""
    model = cp_model.CpModel()
    v = _Vars(data, model, horizon, {}, {}, {})
    for s in range(data.sg.num_stages):
        for b in data.candidates[s]:
            v.use[s, b] = model.new_bool_var(f"use_s{s}_b{b}")
            if data.num_mbs(b) * data.work(s, b) > horizon:
                model.add(v.use[s, b] == 0)  # this size's work alone outlasts the horizon
            for kind in data.kinds:
                dur = data.duration[(s, b, kind)]
                for j in range(data.num_mbs(b)):
                    first = data.released(s) if kind == "F" else 0  # no F before the stage's all-gather
                    v.start[s, b, kind, j] = model.new_int_var(min(first, max(0, horizon - dur)),
                                                               max(0, horizon - dur), f"start_{s}{kind}{j}_b{b}")
                    v.interval[s, b, kind, j] = model.new_optional_fixed_size_interval_var(
                        v.start[s, b, kind, j], dur, v.use[s, b], f"task_{s}{kind}{j}_b{b}")
    return v


def _one_size_per_stage(v: _Vars) -> None:
    """Each stage runs exactly one micro-batch size; with uniform sizes, stage 0's."""
    data, model, use = v.data, v.model, v.use
    for s in range(data.sg.num_stages):
        model.add_exactly_one(use[s, b] for b in data.candidates[s])
    if data.uniform:
        for s in range(1, data.sg.num_stages):
            for b in data.candidates[s]:
                model.add(use[s, b] == use[0, b])


def _one_task_at_a_time(v: _Vars) -> None:
    """A device runs one task at a time (replicas share their stage's tasks)."""
    for members in v.data.group_stages:
        v.model.add_no_overlap([iv for (s, _b, _k, _j), iv in v.interval.items() if s in members])


def _task_order(v: _Vars, symmetry_breaking: bool) -> None:
    """The backward of a micro-batch follows its own forward (split: I follows F, W follows I); with symmetry
    breaking, a stage's forwards, and its backwards, run in micro-batch order."""
    data, model, use, start, end = v.data, v.model, v.use, v.start, v.end
    grad = data.grad
    for s in range(data.sg.num_stages):
        for b in data.candidates[s]:
            for j in range(data.num_mbs(b)):
                model.add(start[s, b, grad, j] >= end(s, b, "F", j)).only_enforce_if(use[s, b])
                if data.split:
                    model.add(start[s, b, "W", j] >= end(s, b, "I", j)).only_enforce_if(use[s, b])
    if symmetry_breaking:
        for s in range(data.sg.num_stages):
            for b in data.candidates[s]:
                for kind in data.kinds:
                    for j in range(data.num_mbs(b) - 1):
                        model.add(start[s, b, kind, j + 1] >= end(s, b, kind, j)).only_enforce_if(use[s, b])


def _data_dependencies(v: _Vars) -> None:
    """Data dependencies along stage edges, for every pair of sizes that may be chosen: consumer F waits for the
    producer F's it covers plus a transfer; producer B waits for those consumer B's plus the transfer back."""
    data, model, use, start, end = v.data, v.model, v.use, v.start, v.end
    for p, c in data.sg.edges:
        for bp in data.candidates[p]:
            wait = data.delay[(p, c, bp)]
            for bc in data.candidates[c]:
                both = [use[p, bp], use[c, bc]]
                for j in range(data.num_mbs(bc)):
                    for i in covered_mbs(bp, bc, j):
                        model.add(start[c, bc, "F", j] >= end(p, bp, "F", i) + wait).only_enforce_if(both)
                        model.add(start[p, bp, data.grad, i] >= end(c, bc, data.grad, j) + wait).only_enforce_if(both)


def _memory_limits(v: _Vars, memory: str) -> tuple[list[int], dict[tuple[int, int, int], cp_model.IntVar]]:
    """Activation memory: a micro-batch's activations live from its F start to its B end; their sum never
    exceeds what model state leaves free (skipped where even every sample at once fits).

    ``(groups constrained, life variables)``; ``memory`` picks the encoding, a
    cumulative over life intervals or a reservoir of +/- changes.
    """
    data, model, use, start, end, horizon = v.data, v.model, v.use, v.start, v.end, v.horizon
    memory_groups = []
    life: dict[tuple[int, int, int], cp_model.IntVar] = {}
    for gi, members in enumerate(data.group_stages):
        worst = sum(max(data.act[(s, b)] * data.num_mbs(b) + data.working[(s, b)] + data.buffers[(s, b)]
                        for b in data.candidates[s]) for s in members)
        if worst <= data.capacity[gi]:
            continue
        memory_groups.append(gi)
        lives = [(s, b, j) for s in members for b in data.candidates[s] if data.act[(s, b)] > 0
                 for j in range(data.num_mbs(b))]
        capacity = max(0, data.capacity[gi])
        if memory == "cumulative":
            intervals = []
            for s, b, j in lives:
                life[s, b, j] = model.new_int_var(data.work(s, b), horizon, f"life_{s}_{j}_b{b}")
                intervals.append(model.new_optional_interval_var(start[s, b, "F", j], life[s, b, j],
                                                                 end(s, b, data.last, j), use[s, b],
                                                                 f"life_{s}_{j}_b{b}"))
            demands = [data.act[(s, b)] for s, b, _ in lives]
            # a re-materializing stage holds its full activations while B re-runs the forward and goes back
            redo = [(s, b, j) for s in members for b in data.candidates[s] if data.working[(s, b)] > 0
                    for j in range(data.num_mbs(b))]
            intervals += [v.interval[s, b, "B", j] for s, b, j in redo]
            demands += [data.working[(s, b)] for s, b, _ in redo]
            # communication buffers of the chosen size, resident the whole iteration
            held = [(s, b) for s in members for b in data.candidates[s] if data.buffers[(s, b)] > 0]
            intervals += [model.new_optional_fixed_size_interval_var(0, horizon, use[s, b], f"buffers_{s}_b{b}")
                          for s, b in held]
            demands += [data.buffers[(s, b)] for s, b in held]
            model.add_cumulative(intervals, demands, capacity)
        else:
            times = [t for s, b, j in lives for t in (start[s, b, "F", j], end(s, b, data.last, j))]
            changes = [c for s, b, _ in lives for c in (data.act[(s, b)], -data.act[(s, b)])]
            actives = [use[s, b] for s, b, _ in lives for _ in range(2)]
            for s in members:
                for b in data.candidates[s]:
                    if data.working[(s, b)] > 0:
                        for j in range(data.num_mbs(b)):
                            times += [start[s, b, "B", j], end(s, b, "B", j)]
                            changes += [data.working[(s, b)], -data.working[(s, b)]]
                            actives += [use[s, b], use[s, b]]
                    if data.buffers[(s, b)] > 0:
                        times.append(0)
                        changes.append(data.buffers[(s, b)])
                        actives.append(use[s, b])
            model.add_reservoir_constraint_with_active(times, changes, actives, 0, capacity)
    return memory_groups, life


def _makespan(v: _Vars, symmetry_breaking: bool) -> cp_model.IntVar:
    """The iteration's end: after every backward and every gradient all-reduce, with the redundant bounds."""
    data, model, use, end = v.data, v.model, v.use, v.end
    makespan = model.new_int_var(0, v.horizon, "makespan")
    for s in range(data.sg.num_stages):
        for b in data.candidates[s]:
            last = range(data.num_mbs(b) - 1, data.num_mbs(b)) if symmetry_breaking else range(data.num_mbs(b))
            for j in last:
                model.add(makespan >= end(s, b, data.last, j) + data.allreduce[s]).only_enforce_if(use[s, b])
    _device_work_bound(v, makespan)
    _fill_drain_bound(v, makespan)
    if symmetry_breaking:
        _size_bounds(v, makespan)
    return makespan


def _device_work_bound(v: _Vars, makespan) -> None:
    """Redundant, for the bound: a device works through all its tasks (for the chosen sizes) one at a time, and
    the stage that finishes last then all-reduces. Optional intervals relax weakly in the LP; this is linear in
    the size literals and lifts the bound when sizes are free."""
    data, use = v.data, v.use
    for members in data.group_stages:
        work = sum(use[s, b] * (data.num_mbs(b) * data.work(s, b)) for s in members for b in data.candidates[s])
        v.model.add(makespan >= work + min(data.allreduce[s] for s in members))


def _fill_drain_bound(v: _Vars, makespan) -> None:
    """Redundant, for the bound (pipeline fill and drain): a stage cannot start before its first micro-batch has
    crossed every upstream stage (head), and after its last backward the producers still run theirs (tail).
    Both are linear in the size literals, so the LP sees the depth of the pipeline, not only each device's
    work; the transfer delay of each edge counts too."""
    data, model, use, horizon, grad = v.data, v.model, v.use, v.horizon, v.data.grad
    sg = data.sg
    dur = {(s, kind): sum(use[s, b] * data.duration[(s, b, kind)] for b in data.candidates[s])
           for s in range(sg.num_stages) for kind in data.kinds}
    head = [model.new_int_var(0, horizon, f"head_{s}") for s in range(sg.num_stages)]
    tail = [model.new_int_var(0, horizon, f"tail_{s}") for s in range(sg.num_stages)]
    for s in range(sg.num_stages):
        model.add(tail[s] >= data.allreduce[s])
        model.add(head[s] >= data.released(s))
        for p in sg.preds(s):
            wait = sum(use[p, b] * data.delay[(p, s, b)] for b in data.candidates[p])
            model.add(head[s] >= head[p] + dur[p, "F"] + wait)
            model.add(tail[s] >= tail[p] + dur[p, grad] + wait)
    for members in data.group_stages:
        if len(members) == 1:
            (s,) = members
            # every F and every B (or I) of the stage precede its last B (or I), and the tail follows that;
            # split, the W's come on top, followed only by the stage's all-reduce
            to_grad = sum(use[s, b] * (data.num_mbs(b) * (data.duration[(s, b, "F")] + data.duration[(s, b, grad)]))
                          for b in data.candidates[s])
            model.add(makespan >= head[s] + to_grad + tail[s])
            if data.split:
                work = sum(use[s, b] * (data.num_mbs(b) * data.work(s, b)) for b in data.candidates[s])
                model.add(makespan >= head[s] + work + data.allreduce[s])


def _size_bounds(v: _Vars, makespan) -> None:
    """Redundant, for the bound: per stage, the size-conditional bound of :func:`size_lower_bounds` (fill, drain,
    round trip, memory), linear in the size literals; sizes whose bound exceeds the horizon are out. The bound
    assumes in-order micro-batches, so only with symmetry breaking."""
    data, model, use = v.data, v.model, v.use
    size_bound = size_lower_bounds(data)
    for s in range(data.sg.num_stages):
        terms = []
        for b in data.candidates[s]:
            if size_bound[s, b] > v.horizon:
                model.add(use[s, b] == 0)
            else:
                terms.append(use[s, b] * size_bound[s, b])
        model.add(makespan >= sum(terms))


def task_graph(data: ModelData, sizes: Sequence[int]) -> dict[TaskKey, tuple[int, list[tuple[TaskKey, int]]]]:
    """For fixed sizes: task -> (duration ticks, [(predecessor task, delay ticks)])."""
    sg = data.sg
    tasks: dict[TaskKey, tuple[int, list[tuple[TaskKey, int]]]] = {}
    for s in range(sg.num_stages):
        b = sizes[s]
        for j in range(data.num_mbs(b)):
            tasks[(s, "F", j)] = (data.duration[(s, b, "F")], [])
            tasks[(s, data.grad, j)] = (data.duration[(s, b, data.grad)], [((s, "F", j), 0)])
            if data.split:
                tasks[(s, "W", j)] = (data.duration[(s, b, "W")], [((s, "I", j), 0)])
    for p, c in sg.edges:
        bp, bc = sizes[p], sizes[c]
        wait = data.delay[(p, c, bp)]
        for j in range(data.num_mbs(bc)):
            for i in covered_mbs(bp, bc, j):
                tasks[(c, "F", j)][1].append(((p, "F", i), wait))
                tasks[(p, data.grad, i)][1].append(((c, data.grad, j), wait))
    return tasks


def replay(data: ModelData, sizes: Sequence[int], schedule: Schedule) -> tuple[dict[TaskKey, int], int] | None:
    """Left-justified start ticks of ``schedule`` run with the model's rounded durations.

    The integer twin of the simulator, used to hint the solver with a
    schedule that satisfies the model exactly. Returns ``(starts, makespan)``
    or None when the order deadlocks or misses tasks.
    """
    tasks = task_graph(data, sizes)
    orders: list[list[TaskKey]] = []
    for grp in data.groups:
        acts = schedule.device_actions[grp[0]] if grp[0] < schedule.num_devices else ()
        orders.append([(a.stage_id, a.kind, a.mb_id) for a in acts])
    if sorted(k for order in orders for k in order) != sorted(tasks):
        return None
    starts: dict[TaskKey, int] = {}
    finish: dict[TaskKey, int] = {}
    position = [0] * len(orders)
    free = [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for gi, order in enumerate(orders):
            while position[gi] < len(order):
                key = order[position[gi]]
                dur, preds = tasks[key]
                if any(pred not in finish for pred, _ in preds):
                    break
                t = max([free[gi], data.released(key[0]) if key[1] == "F" else 0]
                        + [finish[pred] + wait for pred, wait in preds])
                starts[key], finish[key] = t, t + dur
                free[gi] = t + dur
                position[gi] += 1
                progressed = True
    if len(starts) != len(tasks):
        return None
    makespan = 0
    for s in range(data.num_stages):
        last = max(finish[(s, data.last, j)] for j in range(data.num_mbs(sizes[s])))
        makespan = max(makespan, last + data.allreduce[s])
    return starts, makespan


def memory_peaks(data: ModelData, sizes: Sequence[int], starts: Mapping[TaskKey, int]) -> tuple[int, ...]:
    """Peak activation and communication-buffer units per device group of a timed schedule (releases
    before allocations at equal times, as in the model and the simulator)."""
    peaks = []
    for members in data.group_stages:
        events = [(-1, data.buffers[(s, sizes[s])]) for s in members]
        for s in members:
            act, dur_b = data.act[(s, sizes[s])], data.duration[(s, sizes[s], data.last)]
            redo = data.working[(s, sizes[s])]
            for j in range(data.num_mbs(sizes[s])):
                events += [(starts[(s, "F", j)], act), (starts[(s, data.last, j)] + dur_b, -act)]
                if redo:
                    events += [(starts[(s, "B", j)], redo), (starts[(s, "B", j)] + dur_b, -redo)]
        level = peak = 0
        for _, change in sorted(events, key=lambda e: (e[0], e[1])):
            level += change
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def add_hint(cm: CpsatModel, sizes: Sequence[int], starts: Mapping[TaskKey, int], makespan: int) -> None:
    """Hint a complete solution: chosen sizes, their task starts, 0 elsewhere."""
    for (s, b), var in cm.use.items():
        cm.model.add_hint(var, b == sizes[s])
    for (s, b, kind, j), var in cm.start.items():
        cm.model.add_hint(var, starts[(s, kind, j)] if b == sizes[s] else 0)
    data = cm.data
    for (s, b, j), var in cm.life.items():
        shortest = data.work(s, b)
        cm.model.add_hint(var, starts[(s, data.last, j)] + data.duration[(s, b, data.last)] - starts[(s, "F", j)]
                          if b == sizes[s] else shortest)
    cm.model.add_hint(cm.makespan, makespan)


def schedule_from_starts(data: ModelData, sizes: Sequence[int], starts: Mapping[TaskKey, int],
                         name: str = "cpsat") -> Schedule:
    """Per device, the chosen tasks sorted by start tick (replicas get identical lists)."""
    per_device: list[list[Action]] = [[] for _ in range(data.sg.num_devices)]
    for gi, grp in enumerate(data.groups):
        keys = [(s, kind, j) for s in data.group_stages[gi] for kind in data.kinds
                for j in range(data.num_mbs(sizes[s]))]
        keys.sort(key=lambda k: (starts[k], k))
        actions = [Action(s, kind, j) for s, kind, j in keys]
        for d in grp:
            per_device[d] = list(actions)
    return Schedule.from_lists(name, per_device)
