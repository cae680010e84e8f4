"""The dependency engine's table-driven loop and the graph-1F1B sequence built by slices, against plain oracles.

``run_engine`` keeps per-stage dependency tables and per-(stage, slot, mb)
waiting lists so that a search's thousands of simulations allocate nothing
per action; the oracle here re-derives every action's time from the
semantics alone (its dependencies from :meth:`StageGraph.consumed_mbs` and
the samples each consumer micro-batch covers, a stage-level end as the
latest replica end) by repeated passes over the devices. Both compute each
time with the same additions and maxima, so they agree to the bit.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from graphpipe.actions import Action
from graphpipe.errors import GraphpipeError
from graphpipe.sched import make_schedule
from graphpipe.sched.engine import run_engine
from graphpipe.sched.graph1f1b import one_f_one_b_sequence
from graphpipe.sched.simulator import _engine_inputs
from graphpipe.stages import Stage, StageGraph

from test_sched_common import latency_cluster, make_op_graph_diamond, random_stage_graph

_SLOT = {"F": 0, "B": 1, "I": 1, "W": 2}


def _covering(sg: StageGraph, producer: int, consumer: int, producer_mb: int) -> list[int]:
    """Consumer micro-batches sharing a sample with ``producer_mb`` (by sample intervals, not index arithmetic)."""
    bp, bc = sg.stages[producer].micro_batch_size, sg.stages[consumer].micro_batch_size
    lo, hi = producer_mb * bp, (producer_mb + 1) * bp
    return [k for k in range(sg.num_micro_batches(consumer)) if k * bc < hi and lo < (k + 1) * bc]


def _plain_times(sg: StageGraph, device_actions, duration, delay, replicas):
    """(starts, ends, stage_end) by passes over the devices until none advances (None left where stuck)."""
    deps = {}
    for acts in device_actions:
        for a in acts:
            s, j = a.stage_id, a.mb_id
            if a.kind == "W":
                deps[a] = [((s, 1, j), 0.0)]
            elif a.kind == "F":
                deps[a] = [((p, 0, i), delay(p, s)) for p in sg.preds(s) for i in sg.consumed_mbs(p, s, j)]
            else:
                deps[a] = [((s, 0, j), 0.0)] + [((c, 1, k), delay(s, c)) for c in sg.succs(s)
                                                 for k in _covering(sg, s, c, j)]
    starts = [[] for _ in device_actions]
    ends = [[] for _ in device_actions]
    latest, runs = {}, {}
    done = {}
    moved = True
    while moved:
        moved = False
        for d, acts in enumerate(device_actions):
            while len(ends[d]) < len(acts):
                a = acts[len(ends[d])]
                if any(key not in done for key, _ in deps[a]):
                    break
                ready = max([ends[d][-1] if ends[d] else 0.0] + [done[key] + dl for key, dl in deps[a]])
                end = ready + duration(a.stage_id, a.kind)
                starts[d].append(ready)
                ends[d].append(end)
                key = (a.stage_id, _SLOT[a.kind], a.mb_id)
                latest[key] = max(latest.get(key, end), end)
                runs[key] = runs.get(key, 0) + 1
                if runs[key] == replicas[a.stage_id]:
                    done[key] = latest[key]
                moved = True
    return starts, ends, done


def _cases():
    """(stage graph, schedule name): random SP graphs with mixed and equal micro-batch sizes, and a diamond
    whose middle stages are replicated (split and round-robin)."""
    for seed in range(6):
        for mixed in (True, False):
            yield random_stage_graph(seed, num_ops=5, batch_size=16, mixed=mixed)
    g = make_op_graph_diamond()
    devices = ((0,), (1, 2), (3, 4), (5,))
    for mode in ("split", "round-robin"):
        stages = [Stage(i, (i,), devices[i], 2 if i in (1, 2) else 4) for i in range(4)]
        if mode == "round-robin":
            stages = [replace(st, replica_mode=mode) if len(st.devices) > 1 else st for st in stages]
        yield StageGraph.build(g, stages, 16, 6)


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b", "graph-1f1b", "zb-h1"])
def test_run_engine_equals_the_plain_pass_oracle_to_the_bit(schedule_name):
    compared = 0
    for sg in _cases():
        cluster = latency_cluster(sg.num_devices, 0.013, 3e6)
        try:
            schedule = make_schedule(schedule_name, sg, cluster)
        except GraphpipeError:
            continue  # a schedule this stage graph cannot have
        _, duration, delay = _engine_inputs(sg, cluster)
        replicas = [1 if st.round_robin else len(st.devices) for st in sg.stages]
        got = run_engine(sg, schedule.device_actions, duration, delay, delay)
        starts, ends, done = _plain_times(sg, schedule.device_actions, duration, delay, replicas)
        assert not got.stuck and not got.gave_up
        assert [list(x) for x in got.starts] == starts
        assert [list(x) for x in got.ends] == ends
        for s, per_stage in enumerate(got.stage_end):
            for k, per_slot in enumerate(per_stage):
                for j, t in enumerate(per_slot):
                    assert t == done[(s, k, j)] if (s, k, j) in done else t != t  # nan: never run (W without I)
        compared += 1
    assert compared >= (2 if schedule_name == "zb-h1" else 6)  # zero bubble: the chains among them


def test_give_up_only_past_the_real_end():
    """A run told to give up after its own end runs to the end with the same times; told a little before the
    end, it gives up."""
    for sg in _cases():
        cluster = latency_cluster(sg.num_devices, 0.013, 3e6)
        schedule = make_schedule("gpipe", sg, cluster)
        _, duration, delay = _engine_inputs(sg, cluster)
        full = run_engine(sg, schedule.device_actions, duration, delay, delay)
        end = max(e[-1] for e in full.ends if e)
        same = run_engine(sg, schedule.device_actions, duration, delay, delay, give_up_after=end)
        assert repr(same) == repr(full)  # repr: the nan of a slot never run differs from itself
        assert run_engine(sg, schedule.device_actions, duration, delay, delay, give_up_after=end * 0.999).gave_up


def test_run_engine_names_the_blocked_actions_of_a_deadlock():
    sg = random_stage_graph(0, num_ops=2, batch_size=2, mixed=False)
    cluster = latency_cluster(sg.num_devices, 0.0)
    _, duration, delay = _engine_inputs(sg, cluster)
    bad = [(Action(0, "B", 0), Action(0, "F", 0)), (Action(1, "F", 0), Action(1, "B", 0))]
    got = run_engine(sg, bad, duration, delay, delay)
    assert {(s.device, s.position, str(s.action), str(s.waits_for)) for s in got.stuck} == \
        {(0, 0, "0B0", "0F0"), (1, 0, "1F0", "0F0")}  # a B waits for its own F first


def test_one_f_one_b_sequence_equals_its_definition():
    """``warmup`` forwards, then B_k followed by F_{warmup + k} while there is one, for every warm-up."""
    rng = random.Random(3)
    for _ in range(200):
        m, warmup = rng.randint(1, 40), rng.randint(-2, 45)
        w = max(1, min(warmup, m))
        plain = [Action(7, "F", j) for j in range(w)]
        for k in range(m):
            plain.append(Action(7, "B", k))
            if w + k < m:
                plain.append(Action(7, "F", w + k))
        got = one_f_one_b_sequence(7, m, warmup)
        assert got == plain and all(type(a) is Action for a in got)
