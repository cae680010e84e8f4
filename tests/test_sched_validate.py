"""The one validator: each broken schedule is refused with a message naming the problem and a marked grid."""

from __future__ import annotations

import pytest

from graphpipe.actions import Action, Schedule
from graphpipe.errors import DeadlockError, ScheduleError
from graphpipe.stages import Stage, StageGraph
from graphpipe.sched import format_grid, make_schedule, one_f_one_b, validate_plan, validate_schedule
from graphpipe.plan import Plan

from test_sched_common import free_cluster, make_op_graph_diamond, uniform_chain


def _text(sg, text):
    return Schedule.from_text("t", text, sg.num_devices)


def test_valid_schedule_passes():
    sg = uniform_chain(2, 2)
    validate_schedule(sg, _text(sg, "0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1"))


@pytest.mark.parametrize("text,match,marked", [
    ("0: 0F0 0F1 0B0\n1: 1F0 1B0 1F1 1B1", "device 0 never runs 0B1", None),
    ("0: 0F0 0F1 0B0 0B1 0B1\n1: 1F0 1B0 1F1 1B1", "device 0 runs 0B1 twice", ">0B1<"),
    ("0: 0F0 0F1 0B0 0B1 1F0\n1: 1F0 1B0 1F1 1B1", "belongs to stage 1, which runs on devices \\[1\\]", ">1F0<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1 1F2", "names micro-batch 2, stage 1 has 2", ">1F2<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1B1 1F1 1B0", "runs 1B1 before 1F1", ">1B1<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1 3F0", "names stage 3", ">3F0<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1I0 1B0 1F1 1B1", "runs 1B0 and a split backward \\(1I0/1W0\\)", ">1I0<"),
    # Zero bubble's split backward: W after its I, every I with a W, no W without its I.
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1W0 1I0 1F1 1B1", "runs 1W0 before 1I0", ">1W0<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1I0 1F1 1B1", "runs 1I0 without a later 1W0", ">1I0<"),
    ("0: 0F0 0F1 0B0 0W1 0B1\n1: 1F0 1B0 1F1 1B1", "runs 0B1 and a split backward \\(0I1/0W1\\)", ">0W1<"),
    ("0: 0F0 0F1 0B0 0W1\n1: 1F0 1B0 1F1 1B1", "runs 0W1 without its 0I1", ">0W1<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1I0 1W0 1F0 1F1 1B1", "runs 1I0 before 1F0", ">1I0<"),
    ("0: 0F0 0F1 0B0 0B1\n1: 1F0 1F1 1I1 1W1 1I0 1W0", "link 1->0 \\(gradients\\) out of order", ">0B0<"),
    ("0: 0F1 0F0 0B0 0B1\n1: 1F0 1B0 1F1 1B1", "link 0->1 \\(activations\\) out of order", ">1F0<"),
    ("0: 0F0 0F1 0B1 0B0\n1: 1F0 1B0 1F1 1B1", "link 1->0 \\(gradients\\) out of order", ">0B1<"),
])
def test_malformed_schedules_name_the_problem(text, match, marked):
    sg = uniform_chain(2, 2)
    with pytest.raises(ScheduleError, match=match) as info:
        validate_schedule(sg, _text(sg, text))
    message = str(info.value)
    assert "device 0:" in message and "device 1:" in message  # the grid
    if marked:
        assert marked in message


def test_deadlock_is_found_and_blocked_actions_named():
    """Stage 0 waits for 0B0 before sending 0F1 while stage 1 needs 1F1 before it sends back 1B0."""
    sg = uniform_chain(2, 2)
    schedule = _text(sg, "0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1")
    with pytest.raises(DeadlockError, match="device 0 blocked at 0B0 waiting for 1B0; device 1 blocked at 1F1 "
                                            "waiting for 0F1") as info:
        validate_schedule(sg, schedule)
    assert ">0B0<" in str(info.value) and ">1F1<" in str(info.value)


def test_split_backward_waits_for_the_consumers_input_gradient():
    """Stage 0's I of mb 0 needs stage 1's I of mb 0, which stage 1 runs after its F of mb 1, which stage 0
    sends only after its I of mb 0: a deadlock, named with I (slot 1 of the engine is B or I)."""
    sg = uniform_chain(2, 2)
    validate_schedule(sg, _text(sg, "0: 0F0 0F1 0I0 0I1 0W1 0W0\n1: 1F0 1I0 1F1 1I1 1W0 1W1"))
    schedule = _text(sg, "0: 0F0 0I0 0F1 0I1 0W0 0W1\n1: 1F0 1F1 1I0 1W0 1I1 1W1")
    with pytest.raises(DeadlockError, match="device 0 blocked at 0I0 waiting for 1I0; device 1 blocked at 1F1 "
                                            "waiting for 0F1") as info:
        validate_schedule(sg, schedule)
    assert ">0I0<" in str(info.value)


def test_replicas_with_equal_lists_are_checked_once_with_the_verdict_of_every_device():
    """validate_schedule runs the engine on one device per class of equal action lists (the replicas of a stage
    that splits its micro-batches must list the same order). Its verdict (deadlock or not, and what the blocked
    devices wait for) equals the engine run on every device, over every order of a chain of three stages of two
    replicas each at three micro-batches that keeps each link in order (5 per stage, 125 schedules)."""
    import itertools

    from graphpipe.sched.engine import run_engine

    g = uniform_chain(3, 6).graph
    sg = StageGraph.build(g, [Stage(i, (i,), (2 * i, 2 * i + 1), 2) for i in range(3)], 6, 6)

    def orders(stage):  # F0 F1 F2 and B0 B1 B2 interleaved, each B after its F
        for slots in itertools.combinations(range(6), 3):
            acts, f, b = [], 0, 0
            for k in range(6):
                kind = "F" if k in slots else "B"
                if kind == "B" and b >= f:
                    break
                acts.append(Action(stage, kind, f if kind == "F" else b))
                f, b = (f + 1, b) if kind == "F" else (f, b + 1)
            else:
                yield tuple(acts)

    zero = lambda *_: 0.0  # noqa: E731
    outcomes = []
    for picks in itertools.product(*(list(orders(s)) for s in range(3))):
        schedule = Schedule("r", tuple(acts for acts in picks for _ in range(2)))  # replicas share their list
        every = run_engine(sg, schedule.device_actions, zero, zero, zero)
        try:
            validate_schedule(sg, schedule)
            folded = None
        except DeadlockError as exc:
            folded = str(exc).splitlines()[0]
        assert (folded is None) == (not every.stuck)
        for stuck in every.stuck:
            line = f"device {stuck.device} blocked at {stuck.action} waiting for {stuck.waits_for}"
            partner = stuck.device ^ 1  # its replica: the folded run names one device of the two
            assert line in folded or line.replace(f"device {stuck.device} ", f"device {partner} ", 1) in folded
        outcomes.append(folded is None)
    assert len(outcomes) == 125 and 0 < sum(outcomes) < 125


def test_wrong_device_count():
    sg = uniform_chain(2, 2)
    with pytest.raises(ScheduleError, match="lists 3 devices, the stage graph has 2"):
        validate_schedule(sg, Schedule.from_text("t", "0: 0F0", 3))


def test_replicas_must_agree():
    g = make_op_graph_diamond()
    stages = [Stage(0, (0,), (0, 1), 2), Stage(1, (1,), (2,), 2), Stage(2, (2,), (3,), 2), Stage(3, (3,), (4,), 2)]
    sg = StageGraph.build(g, stages, 4, 5)
    good = make_schedule("graph-1f1b", sg)
    validate_schedule(sg, good)
    lists = [list(a) for a in good.device_actions]
    lists[1] = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 1), Action(0, "B", 0)]
    with pytest.raises(ScheduleError, match="replicas of stage 0 disagree: device 0 runs 0B0 where device 1 runs 0B1"):
        validate_schedule(sg, Schedule.from_lists("t", lists))


def test_mixed_micro_batch_link_order():
    """A consumer with micro-batch 4 needs producer mbs 0 and 1 together; order checks use samples."""
    g = make_op_graph_diamond()
    sizes = [2, 2, 2, 4]
    sg = StageGraph.build(g, [Stage(i, (i,), (i,), sizes[i]) for i in range(4)], 8, 4)
    validate_schedule(sg, make_schedule("graph-1f1b", sg))
    validate_schedule(sg, make_schedule("1f1b", sg))
    validate_schedule(sg, make_schedule("gpipe", sg))


def test_grid_window_keeps_long_schedules_readable():
    sg = uniform_chain(2, 64)
    schedule = one_f_one_b(sg)
    grid = format_grid(schedule, [(1, 100)])
    assert ">1F50<" in grid  # 1F1B on the last stage alternates F, B: step 100 is F50
    assert grid.count("\n") == 1 and grid.count("...") == 4
    assert len(grid.splitlines()[0]) < 200


def test_validate_plan_checks_schedule_against_plan():
    sg = uniform_chain(2, 2)
    cluster = free_cluster(2)
    plan = Plan(model="m", stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=_text(sg, "0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1"))
    with pytest.raises(ScheduleError, match="device 1 never runs 1B1"):
        validate_plan(plan)
    validate_plan(Plan(model="m", stage_graph=sg, cluster=cluster, strategy="custom",
                       schedule=make_schedule("1f1b", sg, cluster)))


def _round_robin_chain() -> StageGraph:
    """Stage 0 on device 0; stage 1 round-robin on devices 1 and 2 (micro-batch i on device 1 + i mod 2)."""
    sg = uniform_chain(2, 4)
    stages = (sg.stages[0], Stage(1, (1,), (1, 2), 1, replica_mode="round-robin"))
    return StageGraph.build(sg.graph, stages, 4, 3)


ROUND_ROBIN_OK = "0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3\n1: 1F0 1B0 1F2 1B2\n2: 1F1 1B1 1F3 1B3"


@pytest.mark.parametrize("text,match,marked", [
    (ROUND_ROBIN_OK.replace("1: 1F0 1B0 1F2 1B2", "1: 1F0 1B0 1F2 1B2 1F1"), "1F1 belongs to device 2: round-robin",
     ">1F1<"),
    (ROUND_ROBIN_OK.replace(" 1B3", ""), "device 2 never runs 1B3", None),
    (ROUND_ROBIN_OK.replace("2: 1F1 1B1", "2: 1B1 1F1"), "device 2 runs 1B1 before 1F1", ">1B1<"),
])
def test_round_robin_replicas_own_their_micro_batches(text, match, marked):
    sg = _round_robin_chain()
    validate_schedule(sg, _text(sg, ROUND_ROBIN_OK))
    with pytest.raises(ScheduleError, match=match) as info:
        validate_schedule(sg, _text(sg, text))
    if marked:
        assert marked in str(info.value)


def test_link_order_between_micro_batch_sizes():
    """Stage 1's micro-batch of 2 needs stage 0's micro-batches 0 and 1 (size 1), in that order on the link; their
    gradients complete together at stage 1's B of it, and are sent as 0 then 1."""
    sg = uniform_chain(2, 4)
    sg = StageGraph.build(sg.graph, (sg.stages[0], Stage(1, (1,), (1,), 2)), 4, 2)
    validate_schedule(sg, _text(sg, "0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3\n1: 1F0 1F1 1B0 1B1"))
    with pytest.raises(ScheduleError, match="link 0->1 \\(activations\\) out of order: stage 0 sends micro-batch 2"):
        validate_schedule(sg, _text(sg, "0: 0F0 0F2 0F1 0F3 0B0 0B1 0B2 0B3\n1: 1F0 1F1 1B0 1B1"))
    with pytest.raises(ScheduleError, match="link 1->0 \\(gradients\\) out of order"):
        validate_schedule(sg, _text(sg, "0: 0F0 0F1 0F2 0F3 0B1 0B0 0B2 0B3\n1: 1F0 1F1 1B0 1B1"))


def test_an_action_of_unknown_kind_is_named():
    sg = uniform_chain(2, 2)
    schedule = _text(sg, "0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1")
    bad = Schedule("t", (schedule.device_actions[0], schedule.device_actions[1][:3] + (Action(1, "X", 1),)))
    with pytest.raises(ScheduleError, match="device 1 step 3: action .* has kind 'X'; expected F, B, I or W"):
        validate_schedule(sg, bad)
