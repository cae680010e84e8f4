"""simulate(..., host=SharedHost): devices time-sharing one host's processors.

Oracles: with as many cores as devices it is the dedicated simulator; on one
core with free communication the host never idles while work is left, so the
iteration takes exactly the sum of every action's dedicated time; a small
pipeline is computed by hand.
"""

from __future__ import annotations

import pytest

from graphpipe.actions import Schedule
from graphpipe.errors import DeadlockError
from graphpipe.cluster import preset
from graphpipe.sched import SharedHost, make_schedule, predicted_figures, simulate
from graphpipe.sched.simulator import simulate_figures

from test_sched_common import free_cluster, random_stage_graph, uniform_chain

SCHEDULES = ["gpipe", "1f1b", "graph-1f1b"]


def _times(tl):
    return sorted((r.device, r.action.stage_id, r.action.kind, r.action.mb_id, r.start, r.end) for r in tl.actions)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", SCHEDULES)
def test_enough_cores_is_the_dedicated_simulator(seed, name):
    sg = random_stage_graph(seed, num_ops=5 + seed % 3)
    cluster = preset("v100", sg.num_devices)
    schedule = make_schedule(name, sg, cluster)
    dedicated = simulate(sg, schedule, cluster)
    shared = simulate(sg, schedule, cluster, host=SharedHost.cores(sg.num_devices))
    a, b = _times(dedicated), _times(shared)
    assert [x[:4] for x in a] == [x[:4] for x in b]
    assert [t for x in b for t in x[4:]] == pytest.approx([t for x in a for t in x[4:]], rel=1e-9, abs=1e-12)
    assert shared.iteration_time_s == pytest.approx(dedicated.iteration_time_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", SCHEDULES)
def test_one_core_runs_all_work_back_to_back(seed, name):
    """Free links: some action is always runnable until the end, and one core does one unit of work per second."""
    sg = random_stage_graph(seed, num_ops=5 + seed % 3)
    cluster = free_cluster(sg.num_devices)
    schedule = make_schedule(name, sg, cluster)
    dedicated = simulate(sg, schedule, cluster)
    shared = simulate(sg, schedule, cluster, host=SharedHost.cores(1))
    assert shared.iteration_time_s == pytest.approx(sum(dedicated.busy_s), rel=1e-9)
    # every dependency and the per-device order still hold
    ends = {(r.action.stage_id, r.action.kind, r.action.mb_id): r.end for r in shared.actions}
    for r in shared.actions:
        if r.action.kind == "B":
            assert r.start >= ends[(r.action.stage_id, "F", r.action.mb_id)] - 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_fewer_cores_never_faster(seed):
    sg = random_stage_graph(seed, num_ops=6)
    cluster = preset("v100", sg.num_devices)
    schedule = make_schedule("graph-1f1b", sg, cluster)
    times = [simulate(sg, schedule, cluster, host=SharedHost.cores(c)).iteration_time_s
             for c in range(sg.num_devices, 0, -1)]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_figures_without_records_equal_the_timelines_on_a_shared_host(seed):
    """simulate_figures (what the planner keeps) gives predicted_figures(simulate()) exactly on a shared host too."""
    sg = random_stage_graph(seed, num_ops=6)
    cluster = preset("v100", sg.num_devices)
    for name in SCHEDULES:
        schedule = make_schedule(name, sg, cluster)
        for cores in (1, 2):
            host = SharedHost.cores(cores)
            assert simulate_figures(sg, schedule, cluster, host=host) == \
                predicted_figures(simulate(sg, schedule, cluster, host=host)), (name, cores)


def test_two_stage_gpipe_on_one_core_by_hand():
    """F=1, B=2 per micro-batch, 2 micro-batches; concurrent actions split the core in half.

    d0 F0 [0,1]; d0 F1 and d1 F0 share [1,3]; d1 F1 [3,4]; then the backward
    in GPipe's order, two at a time where both devices have one ready.
    """
    sg = uniform_chain(2, 2)
    cluster = free_cluster(2)
    schedule = Schedule.from_text("gpipe", "0: 0F0 0F1 0B0 0B1\n1: 1F0 1F1 1B0 1B1", 2)
    tl = simulate(sg, schedule, cluster, host=SharedHost.cores(1))
    got = {(r.device, str(r.action)): (r.start, r.end) for r in tl.actions}
    assert got[(0, "0F0")] == pytest.approx((0, 1))
    assert got[(0, "0F1")] == pytest.approx((1, 3))
    assert got[(1, "1F0")] == pytest.approx((1, 3))
    assert got[(1, "1F1")] == pytest.approx((3, 4))
    assert got[(1, "1B0")] == pytest.approx((4, 6))
    assert got[(0, "0B0")] == pytest.approx((6, 10))  # shares the core with 1B1
    assert got[(1, "1B1")] == pytest.approx((6, 10))
    assert got[(0, "0B1")] == pytest.approx((10, 12))
    assert tl.iteration_time_s == pytest.approx(12)


def test_measured_table_interpolates_and_extrapolates():
    host = SharedHost(((1, 1.0), (2, 1.2), (4, 2.4)))
    assert [host.slowdown(k) for k in (1, 2, 3, 4, 8)] == pytest.approx([1.0, 1.2, 1.8, 2.4, 4.8])
    assert SharedHost.cores(4).slowdown(2) == 1.0
    assert SharedHost.cores(4).slowdown(6) == pytest.approx(1.5)


@pytest.mark.parametrize("points, match", [
    ((), "k = 1, 2"), (((2, 1.0),), "k = 1, 2"), (((1, 1.0), (1, 2.0)), "strictly ascending"),
    (((1, 1.0), (2, 0.0)), "positive and finite"), (((1, float("nan")),), "positive and finite"),
])
def test_bad_tables_are_refused(points, match):
    with pytest.raises(ValueError, match=match):
        SharedHost(points)
    with pytest.raises(ValueError, match="at least one core"):
        SharedHost.cores(0)


def test_deadlock_still_raises_on_a_shared_host():
    sg = uniform_chain(2, 2)
    schedule = Schedule.from_text("bad", "0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1", 2)
    with pytest.raises(DeadlockError, match="device 0 blocked at 0B0 waiting for 1B0"):
        simulate(sg, schedule, free_cluster(2), host=SharedHost.cores(1))
