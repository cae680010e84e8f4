"""The one schedule validator (docs/design.md#schedules-and-the-simulator).

Every schedule — generated here, solved by CP-SAT, or read from a plan file —
passes :func:`validate_schedule` before anything simulates or runs it. The
checks, in order:

1. shape: one action list per device of the stage graph; kinds F/B/I/W;
   stage and micro-batch ids in range; an action only on its stage's devices;
2. coverage: every (stage, mb) has exactly one F and one B on every device
   of the stage — or, split for zero bubble, one I (input gradients) and one
   W (weight gradients) instead of the B;
3. B (or I) after F of the same (stage, mb) on the same device, W after its I;
4. replicas of a data-parallel stage list the stage's actions in the same
   relative order (they exchange nothing, but all-reduce together and the
   runtime's messages are matched by order);
5. per-link FIFO order: along each stage edge, the producer sends one message
   per producer micro-batch in its F order and the consumer must need them in
   that same order (and the same for gradients on the way back), because the
   runtime's point-to-point links deliver in order;
6. no deadlock: the dependency engine with zero durations must run every
   action (a cycle of waits leaves some device blocked forever).

A failure raises :class:`ScheduleError` (or :class:`DeadlockError`) whose
message names the problem and prints the device x step grid, one row per
device, with the offending action marked ``>3F2<``.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("c", [Op("a", "x"), Op("b", "x")], [("a", "b", 1.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 1, 2)
>>> validate_schedule(sg, Schedule.from_text("s", "0: 0F0 0B0\\n1: 1F0 1B0", 2))
>>> validate_schedule(sg, Schedule.from_text("s", "0: 0F0 0B0\\n1: 1B0 1F0", 2))
Traceback (most recent call last):
...
graphpipe.errors.ScheduleError: device 1 runs 1B0 before 1F0 (backward before its forward)
device 0: 0F0  0B0
device 1: >1B0< 1F0
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from graphpipe.actions import Action, Schedule
from graphpipe.errors import DeadlockError, ScheduleError
from graphpipe.stages import StageGraph

from graphpipe.sched.engine import covering_consumer_mbs, lockstep_classes, run_engine

__all__ = ["validate_schedule", "validate_plan", "check_structure", "format_grid"]

_GRID_WINDOW = 10
"""Steps shown either side of the marked action: long schedules stay readable."""


def format_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """The device x step grid, actions as ``3F2``, marked ``(device, step)`` cells as ``>3F2<``.

    With marks, only a window of steps around them is shown (``...`` elsewhere).
    """
    marks = set(marks)
    rows = schedule.device_actions
    longest = max((len(r) for r in rows), default=0)
    if marks:
        lo = max(0, min(k for _, k in marks) - _GRID_WINDOW)
        hi = min(longest, max(k for _, k in marks) + _GRID_WINDOW + 1)
    else:
        lo, hi = 0, min(longest, 4 * _GRID_WINDOW)
    width = max((len(str(a)) for r in rows for a in r[lo:hi]), default=3) + 2
    lines = []
    for d, acts in enumerate(rows):
        cells = []
        for k in range(lo, min(hi, len(acts))):
            text = str(acts[k])
            cells.append(f">{text}<" if (d, k) in marks else f"{text}")
        body = " ".join(c.ljust(width - 1) for c in cells).rstrip()
        prefix = "... " if lo > 0 and acts else ""
        suffix = " ..." if len(acts) > hi else ""
        lines.append(f"device {d}: {prefix}{body}{suffix}" if acts else f"device {d}: (idle)")
    return "\n".join(lines)


def _fail(schedule: Schedule, message: str, marks: Iterable[tuple[int, int]] = (), cls=ScheduleError):
    raise cls(message + "\n" + format_grid(schedule, marks))


def check_structure(sg: StageGraph, schedule: Schedule) -> None:
    """Checks 1-5 of the module docstring (everything but deadlock freedom)."""
    num_devices = sg.num_devices
    if schedule.num_devices != num_devices:
        raise ScheduleError(f"schedule {schedule.name!r} lists {schedule.num_devices} devices, the stage graph has "
                            f"{num_devices}: give one action list per device (empty for idle devices)")
    num_mbs = [sg.num_micro_batches(s) for s in range(sg.num_stages)]
    stage_devices = [set(st.devices) for st in sg.stages]
    # The device each micro-batch of a stage runs on: None (every replica) unless the stage is round-robin.
    owners = [st.round_robin_groups if st.round_robin else None for st in sg.stages]
    kinds = frozenset("FBIW")
    # Where each (stage, kind, mb) sits on each device: position index (an Action is that tuple).
    positions: list[dict[tuple[int, str, int], int]] = [dict() for _ in range(num_devices)]
    # A list already checked for another device (generators share one tuple among a stage's replicas, thousands
    # of them at scale) holds for this one too when every stage it names runs here, in the same round-robin
    # group as there where the stage is round-robin.
    checked: dict[int, tuple[dict, set[int], int]] = {}
    group_of: dict[int, dict[int, int]] = {}  # round-robin stage -> device -> its group

    def same_group(s: int, d: int, other: int) -> bool:
        if owners[s] is None:
            return True
        if s not in group_of:
            size = sg.stages[s].group_size
            group_of[s] = {dev: i // size for i, dev in enumerate(sg.stages[s].devices)}
        return group_of[s][d] == group_of[s][other]

    for d, acts in enumerate(schedule.device_actions):
        prior = checked.get(id(acts))
        if prior is not None and all(d in stage_devices[s] and same_group(s, d, prior[2]) for s in prior[1]):
            positions[d] = prior[0]
            continue
        seen = positions[d]
        for k, a in enumerate(acts):
            s, kind, mb = a
            if (kind not in kinds or not 0 <= s < len(num_mbs) or not 0 <= mb < num_mbs[s]
                    or d not in stage_devices[s] or (owners[s] is not None and d not in owners[s][mb % len(owners[s])])
                    or a in seen):
                _explain_action(sg, schedule, num_mbs, stage_devices, d, k, a, seen)
            seen[a] = k
        checked[id(acts)] = (seen, {a[0] for a in acts}, d)
    for st in sg.stages:
        sid = st.id
        done: set[int] = set()  # positions (shared by replicas with one list) this stage's loop has checked
        for r, d in enumerate(st.devices):
            pos = positions[d]
            if id(pos) in done:  # the check below depends on the positions alone (and, round-robin, on the
                continue  # group, which devices sharing positions share)
            done.add(id(pos))
            for j in (range(r // st.group_size, num_mbs[sid], st.num_groups) if st.round_robin
                      else range(num_mbs[sid])):
                f_at, b_at = pos.get((sid, "F", j)), pos.get((sid, "B", j))
                if (f_at is not None and b_at is not None and f_at < b_at and (sid, "I", j) not in pos
                        and (sid, "W", j) not in pos):
                    continue  # an F, then its B, no split backward beside it: the common case
                grad = "I" if _check_split(schedule, sid, j, d, pos) else "B"
                for kind in ("F", grad):
                    if (sid, kind, j) not in pos:
                        owners = st.replica_of(j) if st.round_robin else st.devices
                        _fail(schedule, f"device {d} never runs {Action(sid, kind, j)}: stage {sid} has "
                                        f"{num_mbs[sid]} micro-batches and every one needs an F and a B on each "
                                        f"of {'the devices that take it' if st.round_robin else 'its devices'} "
                                        f"{list(owners)}")
                f_at, b_at = pos[(sid, "F", j)], pos[(sid, grad, j)]
                if b_at < f_at:
                    _fail(schedule, f"device {d} runs {Action(sid, grad, j)} before {Action(sid, 'F', j)} "
                                    f"(backward before its forward)", [(d, b_at)])
    # Replicas agree on the stage's relative order.
    orders = []
    for st in sg.stages:
        if st.round_robin:  # each group has its own micro-batches: no common order; links checked per pair below,
            for group in st.round_robin_groups:  # but the devices of one group split each of its micro-batches
                if len(group) > 1:
                    _same_order(schedule, st.id, group, positions, "devices of a round-robin group")
            orders.append(None)
            continue
        orders.append(_same_order(schedule, st.id, st.devices, positions, "replicas"))
    _check_link_order(sg, schedule, orders, positions)


def _same_order(schedule: Schedule, stage_id: int, devices: Sequence[int], positions, who: str) -> list[Action]:
    """Stage ``stage_id``'s actions as ``devices`` list them, failing where two of them differ (each runs its
    shard of the same micro-batches, so they must run them in one order)."""
    mine: dict[int, list[Action]] = {}  # by list identity: replicas sharing one list filter it once
    per_device = []
    for d in devices:
        acts = schedule.device_actions[d]
        if id(acts) not in mine:
            mine[id(acts)] = [a for a in acts if a.stage_id == stage_id]
        per_device.append(mine[id(acts)])
    for d, order in zip(devices[1:], per_device[1:]):
        if order is not per_device[0] and order != per_device[0]:
            d0 = devices[0]  # the structure checks gave both the same actions: they differ in order
            k = next(i for i, (x, y) in enumerate(zip(per_device[0], order)) if x != y)
            _fail(schedule, f"{who} of stage {stage_id} disagree: device {d0} runs {per_device[0][k]} where "
                            f"device {d} runs {order[k]} ({who} must list the stage's actions in the same order)",
                  [(d0, positions[d0][_key(per_device[0][k])]), (d, positions[d][_key(order[k])])])
    return per_device[0]


def _explain_action(sg: StageGraph, schedule: Schedule, num_mbs: Sequence[int], stage_devices: Sequence[set],
                    d: int, k: int, a: Action, seen: dict) -> None:
    """Raise the error of device ``d``'s step ``k``, an action that failed :func:`check_structure`'s per-action
    test: the first of its conditions it breaks, named."""
    if a.kind not in ("F", "B", "I", "W"):
        _fail(schedule, f"device {d} step {k}: action {a} has kind {a.kind!r}; expected F, B, I or W", [(d, k)])
    if not 0 <= a.stage_id < sg.num_stages:
        _fail(schedule, f"device {d} step {k}: action {a} names stage {a.stage_id}, the plan has stages "
                        f"0..{sg.num_stages - 1}", [(d, k)])
    if not 0 <= a.mb_id < num_mbs[a.stage_id]:
        _fail(schedule, f"device {d} step {k}: action {a} names micro-batch {a.mb_id}, stage {a.stage_id} has "
                        f"{num_mbs[a.stage_id]} (batch {sg.batch_size} / micro-batch size "
                        f"{sg.stages[a.stage_id].micro_batch_size})", [(d, k)])
    if sg.stages[a.stage_id].round_robin and d not in sg.stages[a.stage_id].replica_of(a.mb_id):
        owner = sg.stages[a.stage_id].replica_of(a.mb_id)
        _fail(schedule, f"device {d} step {k}: action {a} belongs to device"
                        f"{'s ' + str(list(owner)) if len(owner) > 1 else ' ' + str(owner[0])}: round-robin stage "
                        f"{a.stage_id} runs micro-batch i on {_taker(sg.stages[a.stage_id])} i mod "
                        f"{sg.stages[a.stage_id].num_groups}",
              [(d, k)])
    if d not in stage_devices[a.stage_id]:
        _fail(schedule, f"device {d} step {k}: action {a} belongs to stage {a.stage_id}, which runs on devices "
                        f"{list(sg.stages[a.stage_id].devices)}, not on device {d}", [(d, k)])
    _fail(schedule, f"device {d} runs {a} twice (steps {seen[a]} and {k}); each (stage, mb) needs "
                    f"exactly one F and one B per device", [(d, seen[a]), (d, k)])


def _check_split(schedule: Schedule, stage_id: int, mb_id: int, device: int, seen: dict) -> bool:
    """Zero bubble's split backward of ``(stage_id, mb_id)`` on ``device``: I then W, never beside a B.

    True when the backward is split (the caller then checks the I like a B).
    """
    i_key, w_key, b_key = (stage_id, "I", mb_id), (stage_id, "W", mb_id), (stage_id, "B", mb_id)
    i_at, w_at = seen.get(i_key), seen.get(w_key)
    if i_at is None and w_at is None:
        return False
    i_act, w_act = Action(*i_key), Action(*w_key)
    if b_key in seen:
        _fail(schedule, f"device {device} runs {Action(*b_key)} and a split backward ({i_act}/{w_act}) of the same "
                        f"micro-batch; run either B or I then W",
              [(device, seen[b_key]), (device, i_at if i_at is not None else w_at)])
    if w_at is None:
        _fail(schedule, f"device {device} runs {i_act} without a later {w_act}: the weight gradients of a split "
                        f"backward must be computed by a W after its I", [(device, i_at)])
    if i_at is None:
        _fail(schedule, f"device {device} runs {w_act} without its {i_act}: a W needs the I of its micro-batch "
                        f"first", [(device, w_at)])
    if w_at < i_at:
        _fail(schedule, f"device {device} runs {w_act} before {i_act} (weight gradients before the input "
                        f"gradients they reuse)", [(device, w_at)])
    return True


def _key(a: Action) -> tuple[int, str, int]:
    return (a.stage_id, a.kind, a.mb_id)


def _check_link_order(sg: StageGraph, schedule: Schedule, orders: Sequence[Sequence[Action]],
                      positions: Sequence[dict]) -> None:
    """Check 5: per stage edge, the order messages are sent equals the order they are needed."""
    for p, c in sg.edges:
        if orders[p] is None or orders[c] is None:
            continue  # round-robin: one channel per replica pair, each message matched by its micro-batch id
        # Forward: the producer sends mb i when its F(i) ends; the consumer first needs it at its F(j).
        sent = [a.mb_id for a in orders[p] if a.kind == "F"]
        if sg.stages[p].micro_batch_size == sg.stages[c].micro_batch_size:  # mb j needs mb j, and only it
            need_at = {a.mb_id: a for a in orders[c] if a.kind == "F"}
            _compare_orders(sg, schedule, positions, p, c, sent, list(need_at), need_at)
            grads_sent = [a.mb_id for a in orders[c] if a.kind in ("B", "I")]
        else:
            needed: list[int] = []
            need_at = {}
            for a in orders[c]:
                if a.kind != "F":
                    continue
                for i in sg.consumed_mbs(p, c, a.mb_id):
                    if i not in need_at:
                        needed.append(i)
                        need_at[i] = a
            _compare_orders(sg, schedule, positions, p, c, sent, needed, need_at)
            # Backward: the gradient of producer mb i is complete after the last covering consumer B.
            left = {i: len(covering_consumer_mbs(sg, p, c, i)) for i in range(sg.num_micro_batches(p))}
            grads_sent = []
            for a in orders[c]:
                if a.kind not in ("B", "I"):
                    continue
                for i in sg.consumed_mbs(p, c, a.mb_id):
                    left[i] -= 1
                    if left[i] == 0:
                        grads_sent.append(i)
        grads_needed = [a.mb_id for a in orders[p] if a.kind in ("B", "I")]
        if grads_sent != grads_needed:
            k = next(i for i, (x, y) in enumerate(zip(grads_sent, grads_needed)) if x != y)
            kind = next(a.kind for a in orders[p] if a.kind in ("B", "I") and a.mb_id == grads_needed[k])
            wanted = Action(p, kind, grads_needed[k])
            d = sg.stages[p].devices[0]
            _fail(schedule, f"link {c}->{p} (gradients) out of order: stage {c} completes the gradient of stage {p}'s "
                            f"micro-batch {grads_sent[k]} next, but stage {p} runs {wanted} next; messages on a link "
                            f"arrive in the order sent, so order stage {p}'s B like stage {c}'s",
                  [(d, positions[d][_key(wanted)])])


def _compare_orders(sg: StageGraph, schedule: Schedule, positions: Sequence[dict], p: int, c: int,
                    sent: list[int], needed: list[int], need_at: dict[int, Action]) -> None:
    if sent == needed:
        return
    k = next(i for i, (x, y) in enumerate(zip(sent, needed)) if x != y)
    culprit = need_at[needed[k]]
    d = sg.stages[c].devices[0]
    _fail(schedule, f"link {p}->{c} (activations) out of order: stage {p} sends micro-batch {sent[k]} next, but stage {c}'s "
                    f"{culprit} needs micro-batch {needed[k]} first; messages on a link arrive in the order sent, so "
                    f"order stage {c}'s F like stage {p}'s", [(d, positions[d][_key(culprit)])])


def validate_schedule(sg: StageGraph, schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a valid, deadlock-free schedule of ``sg``.

    See the module docstring for the checks. Deadlock freedom does not
    depend on durations (no resource is shared but the device's own order),
    so the engine runs with zero times, on one device of each class of equal
    action lists (:func:`~graphpipe.sched.engine.lockstep_classes`: the
    replicas of a stage that splits its micro-batches wait on the same
    completions, so one of them blocks exactly where all of them do: a plan
    on thousands of devices is checked on a few hundred).
    """
    check_structure(sg, schedule)
    reps, _, replicas = lockstep_classes(sg, schedule)
    zero = lambda *_: 0.0  # noqa: E731
    result = run_engine(sg, [schedule.device_actions[d] for d in reps], zero, zero, zero, replicas)
    if result.stuck:
        raise_deadlock(schedule, [replace(s, device=reps[s.device]) for s in result.stuck])


def raise_deadlock(schedule: Schedule, stuck) -> None:
    """Raise :class:`DeadlockError` naming every blocked action and what it waits for."""
    waits = "; ".join(f"device {s.device} blocked at {s.action} waiting for {s.waits_for}" for s in stuck)
    _fail(schedule, f"schedule {schedule.name!r} deadlocks: {waits}", [(s.device, s.position) for s in stuck],
          cls=DeadlockError)


def validate_plan(plan) -> None:
    """Validate a :class:`~graphpipe.plan.Plan`'s schedule against its stage graph and cluster."""
    sg, cluster = plan.stage_graph, plan.cluster
    if sg.num_devices != cluster.num_devices:
        raise ScheduleError(f"plan's stage graph uses {sg.num_devices} devices but its cluster has "
                            f"{cluster.num_devices}; regenerate the plan for this cluster")
    _check_stage_devices(plan)
    validate_schedule(sg, plan.schedule)


def _check_stage_devices(plan) -> None:
    """A hand-edited plan whose stage moved device keeps the schedule of the old placement: say so in the plan
    file's terms (``stages[i].devices``) and how to regenerate it, not in the validator's."""
    sg, schedule = plan.stage_graph, plan.schedule
    holds = [frozenset(st.devices) for st in sg.stages]
    listed: dict[int, list[Action]] = {}  # per distinct action list (replicas share one): its first action per stage
    for d, actions in enumerate(schedule.device_actions):
        if id(actions) not in listed:
            firsts: dict[int, Action] = {}
            for a in actions:
                firsts.setdefault(a.stage_id, a)
            listed[id(actions)] = list(firsts.values())
        for a in listed[id(actions)]:
            if 0 <= a.stage_id < sg.num_stages and d not in holds[a.stage_id]:
                stage = sg.stages[a.stage_id]
                raise ScheduleError(
                    f"the plan's schedule no longer matches stages[{stage.id}].devices ({list(stage.devices)}): it "
                    f"runs stage {stage.id}'s {a} on device {d}. Regenerate the schedule for the stages as they are: "
                    f"graphpipe simulate PLAN.json --schedule {schedule.name} --out PLAN.json")


def _taker(st) -> str:
    """What takes a round-robin stage's micro-batches in turn: a replica, or a group of ``split`` replicas."""
    return f"group (of {st.split} replicas)" if st.split > 1 else "replica"
