"""The dependency engine shared by the validator and the simulator (DESIGN §7).

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

The delay of an edge ``p->c`` is one message of one *producer* micro-batch:
``cluster.transfer_time(p.devices, c.devices, edge_bytes(p, c) * b_p)``,
the same both ways (activations forward, their gradients back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from graphpipe.actions import Action
from graphpipe.stages import StageGraph, covered_mbs

__all__ = ["EngineResult", "Stuck", "run_engine", "covering_consumer_mbs", "KIND_INDEX"]

KIND_INDEX = {"F": 0, "B": 1}


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
    ``stage_end[s][kind][mb]`` the latest replica end; ``stuck`` non-empty on deadlock."""

    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    stage_end: tuple[tuple[tuple[float, ...], ...], ...]
    stuck: tuple[Stuck, ...]


def run_engine(sg: StageGraph, device_actions: Sequence[Sequence[Action]],
               duration: Callable[[int, str], float],
               fwd_delay: Callable[[int, int], float],
               bwd_delay: Callable[[int, int], float]) -> EngineResult:
    """Evaluate start/end times of every action (see module docstring).

    Preconditions (checked by :func:`graphpipe.sched.validate.check_structure`):
    kinds are F/B, stage and mb ids in range, each (stage, kind, mb) appears
    exactly once on each device of its stage and nowhere else.
    ``duration(stage, kind)`` is the compute time of one action.
    """
    num_devices = len(device_actions)
    num_stages = sg.num_stages
    preds = [sg.preds(s) for s in range(num_stages)]
    succs = [sg.succs(s) for s in range(num_stages)]
    mb_size = [st.micro_batch_size for st in sg.stages]
    num_mbs = [sg.num_micro_batches(s) for s in range(num_stages)]
    replicas = [len(st.devices) for st in sg.stages]
    fdel = {(p, c): fwd_delay(p, c) for p, c in sg.edges}
    bdel = {(p, c): bwd_delay(p, c) for p, c in sg.edges}
    dur = [(duration(s, "F"), duration(s, "B")) for s in range(num_stages)]
    # Stage-level completion time of (stage, kind, mb): None until every replica has run it.
    done: list[list[list[float | None]]] = [[[None] * num_mbs[s], [None] * num_mbs[s]] for s in range(num_stages)]
    partial: list[list[list[float]]] = [[[0.0] * num_mbs[s], [0.0] * num_mbs[s]] for s in range(num_stages)]
    remaining: list[list[list[int]]] = [[[replicas[s]] * num_mbs[s], [replicas[s]] * num_mbs[s]] for s in range(num_stages)]
    waiters: dict[tuple[int, int, int], list[int]] = {}

    def deps_of(action: Action) -> list[tuple[int, int, int, float]]:
        s, j = action.stage_id, action.mb_id
        if action.kind == "F":
            # covered_mbs(mb_size[p], bc, j), inlined: this runs for every action of every simulation
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
        for c in succs[s]:  # covered_mbs(mb_size[c], bp, j), inlined
            bc = mb_size[c]
            delay = bdel[(s, c)]
            for k in range(j * bp // bc, ((j + 1) * bp - 1) // bc + 1):
                out.append((c, 1, k, delay))
        return out

    pos = [0] * num_devices
    free = [0.0] * num_devices
    starts: list[list[float]] = [[] for _ in range(num_devices)]
    ends: list[list[float]] = [[] for _ in range(num_devices)]
    head_deps: list[list[tuple[int, int, int, float]] | None] = [None] * num_devices
    head_cursor = [0] * num_devices
    head_ready = [0.0] * num_devices
    blocked_on: list[tuple[int, int, int] | None] = [None] * num_devices
    stack = list(range(num_devices - 1, -1, -1))
    while stack:
        d = stack.pop()
        acts = device_actions[d]
        blocked_on[d] = None
        while pos[d] < len(acts):
            action = acts[pos[d]]
            deps = head_deps[d]
            if deps is None:
                deps = head_deps[d] = deps_of(action)
                head_cursor[d] = 0
                head_ready[d] = free[d]
            ready = head_ready[d]
            cursor = head_cursor[d]
            while cursor < len(deps):
                s2, k2, mb2, delay = deps[cursor]
                t = done[s2][k2][mb2]
                if t is None:
                    break
                if t + delay > ready:
                    ready = t + delay
                cursor += 1
            head_ready[d] = ready
            head_cursor[d] = cursor
            if cursor < len(deps):
                key = deps[cursor][:3]
                waiters.setdefault(key, []).append(d)
                blocked_on[d] = key
                break
            s, k, j = action.stage_id, KIND_INDEX[action.kind], action.mb_id
            end = ready + dur[s][k]
            starts[d].append(ready)
            ends[d].append(end)
            free[d] = end
            pos[d] += 1
            head_deps[d] = None
            if end > partial[s][k][j]:
                partial[s][k][j] = end
            remaining[s][k][j] -= 1
            if remaining[s][k][j] == 0:
                done[s][k][j] = partial[s][k][j]
                for w in waiters.pop((s, k, j), ()):
                    stack.append(w)
    stuck = []
    for d in range(num_devices):
        if pos[d] < len(device_actions[d]):
            key = blocked_on[d]
            waits = Action(key[0], "FB"[key[1]], key[2]) if key else device_actions[d][pos[d]]
            stuck.append(Stuck(d, pos[d], device_actions[d][pos[d]], waits))
    stage_end = tuple(tuple(tuple(x if x is not None else float("nan") for x in done[s][k]) for k in (0, 1))
                      for s in range(num_stages))
    return EngineResult(tuple(map(tuple, starts)), tuple(map(tuple, ends)), stage_end, tuple(stuck))
