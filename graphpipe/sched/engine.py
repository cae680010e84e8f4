"""The dependency engine shared by the validator and the simulator (docs/design.md#schedules-and-the-simulator).

A schedule is a set of per-device action lists. With the shared simulator
semantics (compute per device in list order, transfers are pure delays, no
link contention, compute and communication overlap) the start time of an
action is a longest-path value::

    start(a) = max(end of the previous action on its device,
                   max over dependencies d of  stage_end(d) + delay(d))

where ``stage_end`` of a (stage, kind, mb) is the latest end over the
stage's replicas. So the simulation is an evaluation of a DAG in any
topological order — no event queue, no time ordering, O(actions + deps).
When the evaluation gets stuck, the schedule deadlocks: every blocked
device waits for an action that sits behind another blocked action.

Dependencies (the shared semantics; CP-SAT mirrors them):

* ``F`` of consumer ``c``, mb ``j``: ``F`` of every producer ``p``,
  mb ``i`` in ``sg.consumed_mbs(p, c, j)``, plus the forward delay of ``p->c``.
* ``B`` of stage ``s``, mb ``i``: its own ``F`` (delay 0), and ``B`` of every
  consumer micro-batch covering any of ``i``'s samples, plus the backward delay.
* zero bubble splits ``B`` into ``I`` (input gradients) and ``W`` (weight
  gradients): ``I`` has ``B``'s dependencies and sends the gradients, so a
  consumer's ``I`` stands for its ``B`` (kind index 1 is "the gradient of the
  inputs is done", by ``B`` or by ``I``); ``W`` waits for its own ``I``
  (index 2 records it; it sends nothing).

The delay of an edge ``p->c`` is one message of one *producer* micro-batch:
``cluster.transfer_time(p.devices, c.devices, edge_bytes(p, c) * b_p)``,
the same both ways (activations forward, their gradients back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from graphpipe.actions import Action, Schedule
from graphpipe.stages import StageGraph, covered_mbs

__all__ = ["EngineResult", "Stuck", "run_engine", "run_engine_shared", "drain_tails", "action_deps", "covering_consumer_mbs",
           "lockstep_classes", "KIND_INDEX"]

KIND_INDEX = {"F": 0, "B": 1, "I": 1, "W": 2}
"""Completion slot of each kind: F, input gradients (B or I), W."""

_DURATION_INDEX = {"F": 0, "B": 1, "I": 2, "W": 3}


def covering_consumer_mbs(sg: StageGraph, producer: int, consumer: int, producer_mb: int) -> range:
    """Consumer micro-batch ids holding any sample of producer micro-batch ``producer_mb``.

    The mirror image of :meth:`StageGraph.consumed_mbs`: the gradient of
    producer mb ``i`` is complete once every one of these consumers ran ``B``.
    """
    return covered_mbs(sg.stages[consumer].micro_batch_size, sg.stages[producer].micro_batch_size, producer_mb)


@dataclass(frozen=True, slots=True)
class Stuck:
    """A device that can never proceed: its next action and what it waits for."""

    device: int
    position: int
    action: Action
    waits_for: Action


@dataclass(frozen=True, slots=True)
class EngineResult:
    """``starts[d][k]`` / ``ends[d][k]`` of the ``k``-th action of device ``d``;
    ``stage_end[s][kind][mb]`` the latest replica end; ``stuck`` non-empty on deadlock; ``gave_up``: the run
    stopped early, proving an action ends after ``run_engine``'s ``give_up_after`` (the times are partial)."""

    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    stage_end: tuple[tuple[tuple[float, ...], ...], ...]
    stuck: tuple[Stuck, ...]
    gave_up: bool = False


def action_deps(action: Action, preds, succs, mb_size, fdel, bdel) -> list[tuple[int, int, int, float]]:
    """``(stage, kind index, mb, delay)`` of every action ``action`` waits for (module docstring).

    ``preds``/``succs``/``mb_size`` are per-stage lists of the stage graph,
    ``fdel``/``bdel`` the forward/backward delay of each edge. This runs for
    every action of every simulation, so :func:`covered_mbs` is inlined.
    """
    s, j = action.stage_id, action.mb_id
    if action.kind == "W":
        return [(s, 1, j, 0.0)]
    if action.kind == "F":
        out = []
        bc = mb_size[s]
        for p in preds[s]:
            bp = mb_size[p]
            delay = fdel[(p, s)]
            for i in range(j * bc // bp, ((j + 1) * bc - 1) // bp + 1):
                out.append((p, 0, i, delay))
        return out
    out = [(s, 0, j, 0.0)]
    bp = mb_size[s]
    for c in succs[s]:
        bc = mb_size[c]
        delay = bdel[(s, c)]
        for k in range(j * bp // bc, ((j + 1) * bp - 1) // bc + 1):
            out.append((c, 1, k, delay))
    return out


def run_engine(sg: StageGraph, device_actions: Sequence[Sequence[Action]],
               duration: Callable[[int, str], float],
               fwd_delay: Callable[[int, int], float],
               bwd_delay: Callable[[int, int], float],
               replicas: Sequence[int] | None = None, give_up_after: float | None = None,
               tails: Sequence[float] | None = None, release: Sequence[float] | None = None) -> EngineResult:
    """Evaluate start/end times of every action (see module docstring).

    Preconditions (checked by :func:`graphpipe.sched.validate.check_structure`):
    kinds are F/B/I/W, stage and mb ids in range, each (stage, kind, mb) appears
    exactly once on each device of its stage and nowhere else.
    ``duration(stage, kind)`` is the compute time of one action.
    ``replicas[s]``: how many of the listed devices run each action of stage
    ``s`` (default: its devices, one for a round-robin stage); a caller that
    lists one device of several in lockstep passes the count it listed.

    ``give_up_after`` (seconds): a search that only wants a schedule ending
    by then. The run stops (``gave_up``) as soon as a device provably ends
    later: when an action of it could start at ``t`` and the actions left on
    it, this one included, take ``busy`` seconds, it ends no earlier than
    ``t + busy`` whatever the rest does, as a device runs one action at a time
    (past a relative margin of 1e-9, far above the rounding of those sums).
    ``tails[d]`` (with ``give_up_after``): seconds the iteration provably
    runs after device ``d``'s last action ends (the backward of that
    micro-batch on the stages before it, :func:`drain_tails`), added to that bound.
    ``release[s]``: no F of stage ``s`` starts before it (the stage's all-gather
    at the step's start, :meth:`graphpipe.stages.StageGraph.gather_time`).

    The loop runs once per action of every simulation a search scores, so it
    is kept to local names and list indexing: each device runs its actions
    until one waits for a (stage, slot, mb) not yet done, registers in that
    entry's waiting list and resumes when the last replica finishes it.
    """
    num_devices = len(device_actions)
    tab = _Tables(sg, duration, fwd_delay, bwd_delay, replicas, release)
    done, partial, remaining = tab.done, tab.partial, tab.remaining
    # waiting[s][k][mb]: the devices whose next action waits for (s, k, mb), or None
    waiting: list[list[list[list[int] | None]]] = [[[None] * len(per_kind) for per_kind in per_stage]
                                                   for per_stage in done]
    table = _kind_table(tab, waiting)
    pos = [0] * num_devices
    free = [0.0] * num_devices
    starts: list[list[float]] = [[] for _ in range(num_devices)]
    ends: list[list[float]] = [[] for _ in range(num_devices)]
    resume: list[tuple | None] = [None] * num_devices  # a mixed-size head action's (deps, cursor, ready so far)
    blocked_on: list[tuple[int, int, int] | None] = [None] * num_devices
    left_busy = None  # per device: compute time of the actions it has not started (with give_up_after)
    if give_up_after is not None:
        give_up_after *= 1 + 1e-9
        steps = [{kind: entry[2] for kind, entry in per_stage.items()} for per_stage in table]
        left_busy = [sum([steps[s][kind] for s, kind, _ in acts]) for acts in device_actions]
        if tails is not None:   # the drain after a device's last action ends: the iteration runs at least that
            left_busy = [busy + tail for busy, tail in zip(left_busy, tails)]
    stack = list(range(num_devices - 1, -1, -1))
    while stack:
        d = stack.pop()
        acts = device_actions[d]
        n_acts = len(acts)
        p = pos[d]
        t_free = free[d]
        busy = left_busy[d] if left_busy is not None else None
        blocked_on[d] = None
        d_starts, d_ends = starts[d], ends[d]
        while p < n_acts:
            s, kind, j = acts[p]
            srcs, k, step, own_done, own_wait, single, ready = table[s][kind]
            if t_free > ready:
                ready = t_free
            key = None
            if srcs is not None:  # every neighbour has this stage's micro-batch size: dependency j of each
                for dep_done, delay, s2, k2 in srcs:
                    t = dep_done[j]
                    if t is None:
                        key = (s2, k2, j)
                        break
                    t += delay
                    if t > ready:
                        ready = t
            else:
                if resume[d] is not None:
                    deps, cursor, ready = resume[d]
                    resume[d] = None
                else:
                    deps, cursor = action_deps(acts[p], tab.preds, tab.succs, tab.mb_size, tab.fdel, tab.bdel), 0
                n_deps = len(deps)
                while cursor < n_deps:
                    s2, k2, mb2, delay = deps[cursor]
                    t = done[s2][k2][mb2]
                    if t is None:
                        key = (s2, k2, mb2)
                        resume[d] = (deps, cursor, ready)
                        break
                    t += delay
                    if t > ready:
                        ready = t
                    cursor += 1
            if key is not None:
                wait = waiting[key[0]][key[1]]
                if wait[key[2]] is None:
                    wait[key[2]] = [d]
                else:
                    wait[key[2]].append(d)
                blocked_on[d] = key
                break
            if busy is not None:
                if ready + busy > give_up_after:
                    return tab.result(device_actions, pos, blocked_on, starts, ends, gave_up=True)
                busy -= step
            end = ready + step
            d_starts.append(ready)
            d_ends.append(end)
            t_free = end
            p += 1
            if single:
                own_done[j] = end
            else:  # tab.finish, inlined: the stage-level end once every replica has run it
                if end > partial[s][k][j]:
                    partial[s][k][j] = end
                left = remaining[s][k]
                left[j] -= 1
                if left[j]:
                    continue
                own_done[j] = partial[s][k][j]
            woken = own_wait[j]
            if woken is not None:
                stack.extend(woken)
                own_wait[j] = None
        pos[d] = p
        free[d] = t_free
        if busy is not None:
            left_busy[d] = busy
    return tab.result(device_actions, pos, blocked_on, starts, ends)


def drain_tails(sg: StageGraph, device_actions: Sequence[Sequence[Action]],
                duration: Callable[[int, str], float]) -> list[float]:
    """Per device, seconds the iteration provably runs after its last action ends: when that action is a
    B or an I of stage ``s`` on micro-batch ``j``, each stage before ``s`` still runs its own backward
    (B or I) of ``j`` after it, one after another along the longest such path; after an F or a W nothing
    need follow (transfers and all-reduces only add)."""
    down = [0.0] * sg.num_stages
    for s in range(sg.num_stages):   # stage ids are a topological order
        down[s] = max((min(duration(p, "B"), duration(p, "I")) + down[p] for p in sg.preds(s)), default=0.0)
    return [down[acts[-1][0]] if acts and acts[-1][1] in ("B", "I") else 0.0 for acts in device_actions]


def _kind_table(tab: "_Tables", waiting) -> list[dict[str, tuple]]:
    """Per stage, per kind: ``(sources, completion slot, duration, the slot's done list, its waiting list, one
    replica, earliest start)`` for :func:`run_engine` (the earliest start: the stage's release for F, else 0).

    ``sources`` lists ``(done list, delay, stage, slot)`` of each dependency when every neighbour of the stage has
    its micro-batch size (dependency ``j`` of micro-batch ``j``), else None (:func:`action_deps` per action).
    """
    out = []
    for s in range(len(tab.preds)):
        size = tab.mb_size[s]
        same = (all(tab.mb_size[p] == size for p in tab.preds[s]) and all(tab.mb_size[c] == size for c in tab.succs[s]))
        own = tab.done[s]
        fwd = tuple((tab.done[p][0], tab.fdel[(p, s)], p, 0) for p in tab.preds[s])
        bwd = ((own[0], 0.0, s, 0),) + tuple((tab.done[c][1], tab.bdel[(s, c)], c, 1) for c in tab.succs[s])
        srcs = {"F": fwd, "B": bwd, "I": bwd, "W": ((own[1], 0.0, s, 1),)}
        out.append({kind: (srcs[kind] if same or kind == "W" else None, KIND_INDEX[kind], tab.dur[s][i],
                           own[KIND_INDEX[kind]], waiting[s][KIND_INDEX[kind]], tab.replicas[s] == 1,
                           tab.release[s] if kind == "F" else 0.0)
                    for kind, i in _DURATION_INDEX.items()})
    return out


def run_engine_shared(sg: StageGraph, device_actions: Sequence[Sequence[Action]],
                      duration: Callable[[int, str], float],
                      fwd_delay: Callable[[int, int], float],
                      bwd_delay: Callable[[int, int], float],
                      slowdown: Callable[[int], float], release: Sequence[float] | None = None) -> EngineResult:
    """:func:`run_engine` for devices that share one host's processors.

    The dependencies and per-device order are the same; what changes is
    speed: while ``k`` actions run at once, each progresses at
    ``1 / slowdown(k)`` of its dedicated rate (processor sharing, the fluid
    model of a time-shared CPU: ``slowdown(k) = max(1, k / cores)`` for
    ``cores`` cores, or a measured table that also carries memory-bandwidth
    contention). Start times then depend on what else runs, so this is a
    time-ordered event loop, not a longest-path pass: O(events x devices).
    With ``slowdown(k) == 1`` it returns :func:`run_engine`'s times (up to
    rounding).
    """
    num_devices = len(device_actions)
    tab = _Tables(sg, duration, fwd_delay, bwd_delay, release=release)
    pos = [0] * num_devices
    free = [0.0] * num_devices
    starts: list[list[float]] = [[] for _ in range(num_devices)]
    ends: list[list[float]] = [[] for _ in range(num_devices)]
    ready: list[float | None] = [None] * num_devices  # head action's earliest start, once its inputs are known
    left: list[float | None] = [None] * num_devices  # dedicated-time work left of the running head action
    blocked_on: list[tuple[int, int, int] | None] = [None] * num_devices

    def resolve(d: int) -> None:
        """Set ``ready[d]`` when every input of device ``d``'s next action has finished (else note the blocker)."""
        action = device_actions[d][pos[d]]
        at = max(free[d], tab.release[action.stage_id]) if action.kind == "F" else free[d]
        for s2, k2, mb2, delay in action_deps(action, tab.preds, tab.succs, tab.mb_size, tab.fdel, tab.bdel):
            end = tab.done[s2][k2][mb2]
            if end is None:
                blocked_on[d] = (s2, k2, mb2)
                return
            at = max(at, end + delay)
        blocked_on[d], ready[d] = None, at

    for d in range(num_devices):
        if device_actions[d]:
            resolve(d)
    now = 0.0
    while True:
        for d in range(num_devices):  # start every head action whose inputs are in and whose device is free
            if left[d] is None and ready[d] is not None and ready[d] <= now:
                action = device_actions[d][pos[d]]
                left[d] = tab.dur[action.stage_id][_DURATION_INDEX[action.kind]]
                starts[d].append(now)
        running = [d for d in range(num_devices) if left[d] is not None]
        later = [ready[d] for d in range(num_devices) if left[d] is None and ready[d] is not None]
        if not running:
            if not later:
                break  # finished, or stuck (blocked_on says on what)
            now = min(later)
            continue
        rate = 1.0 / slowdown(len(running))
        step = min(left[d] for d in running) / rate
        if later:
            step = min(step, min(later) - now)
        now += step
        finished = []
        for d in running:
            left[d] -= step * rate
            if left[d] <= 1e-12 * max(1.0, now):
                finished.append(d)
        for d in finished:
            action = device_actions[d][pos[d]]
            ends[d].append(now)
            free[d], left[d], ready[d] = now, None, None
            pos[d] += 1
            tab.finish(action.stage_id, KIND_INDEX[action.kind], action.mb_id, now)
        if finished:  # a finished action may release any device's head
            for d in range(num_devices):
                if left[d] is None and ready[d] is None and pos[d] < len(device_actions[d]):
                    resolve(d)
    return tab.result(device_actions, pos, blocked_on, starts, ends)


class _Tables:
    """Per-stage inputs and per-(stage, kind, mb) completion state shared by both engines."""

    def __init__(self, sg: StageGraph, duration, fwd_delay, bwd_delay, replicas: Sequence[int] | None = None,
                 release: Sequence[float] | None = None) -> None:
        num_stages = sg.num_stages
        self.release = list(release) if release is not None else [0.0] * num_stages
        self.preds = [sg.preds(s) for s in range(num_stages)]
        self.succs = [sg.succs(s) for s in range(num_stages)]
        self.mb_size = [st.micro_batch_size for st in sg.stages]
        num_mbs = [sg.num_micro_batches(s) for s in range(num_stages)]
        if replicas is None:  # round-robin: one replica runs each mb
            replicas = [st.group_size if st.round_robin else len(st.devices) for st in sg.stages]
        self.replicas = list(replicas)  # listed devices running each action of a stage
        self.fdel = {(p, c): fwd_delay(p, c) for p, c in sg.edges}
        self.bdel = {(p, c): bwd_delay(p, c) for p, c in sg.edges}
        self.dur = [tuple(duration(s, kind) for kind in _DURATION_INDEX) for s in range(num_stages)]
        # Stage-level completion time of (stage, kind slot, mb): None until every replica has run it.
        self.done: list[list[list[float | None]]] = [[[None] * n for _ in range(3)] for n in num_mbs]
        self.partial: list[list[list[float]]] = [[[0.0] * n for _ in range(3)] for n in num_mbs]
        self.remaining: list[list[list[int]]] = [[[r] * n for _ in range(3)] for n, r in zip(num_mbs, replicas)]

    def finish(self, s: int, k: int, j: int, end: float) -> bool:
        """Record one replica's end of ``(s, k, j)``; True when that was the last replica."""
        if end > self.partial[s][k][j]:
            self.partial[s][k][j] = end
        self.remaining[s][k][j] -= 1
        if self.remaining[s][k][j]:
            return False
        self.done[s][k][j] = self.partial[s][k][j]
        return True

    def result(self, device_actions, pos, blocked_on, starts, ends, gave_up: bool = False) -> EngineResult:
        if gave_up:
            return EngineResult(tuple(map(tuple, starts)), tuple(map(tuple, ends)), (), (), True)
        stuck = []
        for d, acts in enumerate(device_actions):
            if pos[d] < len(acts):
                key = blocked_on[d]
                waits = Action(key[0], _slot_kind(device_actions, key), key[2]) if key else acts[pos[d]]
                stuck.append(Stuck(d, pos[d], acts[pos[d]], waits))
        stage_end = tuple(tuple(tuple(per_kind) if None not in per_kind else
                                tuple(x if x is not None else float("nan") for x in per_kind) for per_kind in per_stage)
                          for per_stage in self.done)
        return EngineResult(tuple(map(tuple, starts)), tuple(map(tuple, ends)), stage_end, tuple(stuck))


def _slot_kind(device_actions: Sequence[Sequence[Action]], key: tuple[int, int, int]) -> str:
    """The kind a blocked device waits for: slot 1 is ``I`` where the stage splits its backward, else ``B``."""
    if key[1] != 1:
        return "FBW"[key[1]]
    split = any(a.stage_id == key[0] and a.kind == "I" for acts in device_actions for a in acts)
    return "I" if split else "B"


def lockstep_classes(sg: StageGraph, schedule: Schedule) -> tuple[list[int], list[int | None], list[int]]:
    """(representative devices, each device's index among them or None when idle, per-stage replica counts for
    :func:`run_engine`): devices whose action lists are equal form one class, its first device standing for it.

    Equal lists run in lockstep on dedicated devices: the same actions,
    waiting on the same stage-level completions, for the same durations (the
    replicas of a stage that splits its micro-batches). A round-robin stage's
    replicas run different micro-batches, so their lists differ anyway.
    """
    reps: list[int] = []
    rep_index: list[int | None] = []
    by_content: dict[tuple, int] = {}
    by_identity: dict[int, int] = {}  # generators share one tuple among replicas: skip hashing it again
    for d, acts in enumerate(schedule.device_actions):
        if not acts:
            rep_index.append(None)
            continue
        i = by_identity.get(id(acts))
        if i is None:
            key = tuple(acts)
            i = by_content.get(key)
            if i is None:
                i = by_content[key] = len(reps)
                reps.append(d)
            by_identity[id(acts)] = i
        rep_index.append(i)
    listed = set(reps)
    replicas = [1 if st.round_robin else sum(1 for d in st.devices if d in listed) for st in sg.stages]
    return reps, rep_index, replicas
