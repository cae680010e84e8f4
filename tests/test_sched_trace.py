"""Trace and Gantt outputs: every simulated event appears exactly where the timeline says."""

from __future__ import annotations

import json
import os

import pytest

from graphpipe.cluster import preset
from graphpipe.sched import make_schedule, plot_gantt, plot_gantt_pair, round_robin_chain, simulate, write_trace
from graphpipe.sched.trace import trace_document
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.stages import Stage, StageGraph

from test_sched_common import make_op_graph_diamond, uniform_chain


def _replicated_diamond():
    g = make_op_graph_diamond(fwd=1e-3)
    stages = [Stage(0, (0,), (0, 1), 2), Stage(1, (1,), (2,), 2), Stage(2, (2,), (3,), 2), Stage(3, (3,), (4,), 2)]
    sg = StageGraph.build(g, stages, 8, 5)
    cluster = preset("v100", 5)
    return simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)


def test_trace_has_every_action_transfer_and_allreduce(tmp_path):
    tl = _replicated_diamond()
    path = tmp_path / "trace.json"
    write_trace(tl, str(path))
    doc = json.loads(path.read_text())
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {d: f"device {d}" for d in range(5)}
    compute = {(e["pid"], e["args"]["action"]): (e["ts"], e["dur"]) for e in events if e.get("cat") in ("F", "B")}
    assert len(compute) == len(tl.actions)
    for r in tl.actions:
        ts, dur = compute[(r.device, str(r.action))]
        assert ts == pytest.approx(r.start * 1e6) and dur == pytest.approx((r.end - r.start) * 1e6)
    sends = [e for e in events if e.get("cat", "").startswith("transfer-")]
    # Each non-free message appears once per sending device (stage 0 has two replicas).
    expected = sum(len(t.src_devices) for t in tl.transfers if t.end > t.start)
    assert len(sends) == expected > 0
    assert all(e["tid"] == 1 for e in sends) and all(e["tid"] == 0 for e in events if e.get("cat") in ("F", "B"))
    allreduce = [e for e in events if e.get("cat") == "allreduce"]
    assert sorted(e["pid"] for e in allreduce) == [0, 1]
    assert doc["otherData"]["iteration_time_s"] == tl.iteration_time_s


def test_round_robin_messages_leave_and_reach_the_devices_that_ran_them():
    """A round-robin stage's micro-batch runs on one group of its devices, so its messages come from and go to that
    group alone (before, every device of the stage was listed, and a trace of 2,000 round-robin devices at 4,096
    micro-batches held 40 events per message and ran out of memory)."""
    g = make_op_graph_diamond(fwd=1e-3)
    rr = {"replica_mode": "round-robin"}
    stages = [Stage(0, (0,), (0, 1), 1, **rr), Stage(1, (1,), (2, 3, 4), 1, **rr), Stage(2, (2,), (5,), 1),
              Stage(3, (3,), (6, 7), 2)]
    sg = StageGraph.build(g, stages, 12, 8)
    cluster = preset("v100", 8)
    tl = simulate(sg, make_schedule("graph-1f1b", sg, cluster), cluster)
    ran: dict[tuple, set[int]] = {}
    for r in tl.actions:
        ran.setdefault((r.action.kind, r.action.stage_id, r.action.mb_id), set()).add(r.device)
    assert tl.transfers
    for t in tl.transfers:
        sender, receiver = ("F", "B") if t.direction == "fwd" else ("B", "F")
        assert set(t.src_devices) == set().union(*(ran[(sender, t.src_stage, i)] for i in t.src_mbs))
        assert set(t.dst_devices) == set().union(*(ran[(receiver, t.dst_stage, i)] for i in t.dst_mbs))
    sends = [e for e in trace_document(tl)["traceEvents"] if e.get("cat", "").startswith("transfer-")]
    assert len(sends) == sum(len(t.src_devices) for t in tl.transfers if t.end > t.start)
    assert any(len(t.dst_devices) == 2 for t in tl.transfers)  # stage 3 splits each micro-batch over two devices


def test_trace_names_follow_the_convention():
    sg = uniform_chain(2, 2)
    cluster = preset("v100", 2)
    doc = trace_document(simulate(sg, make_schedule("1f1b", sg, cluster), cluster))
    names = {e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"}
    assert {"F s0 mb0", "B s1 mb1", "fwd s0->s1 mb1", "bwd s1->s0 mb0"} <= names


def _png_size(path):
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_gantt_png_rows_scale_with_devices(tmp_path):
    pytest.importorskip("matplotlib")
    small, large = tmp_path / "s.png", tmp_path / "l.png"
    sg2, sg8 = uniform_chain(2, 4), uniform_chain(8, 16)
    plot_gantt(simulate(sg2, make_schedule("1f1b", sg2), preset("v100", 2)), str(small), title="two")
    plot_gantt(simulate(sg8, make_schedule("1f1b", sg8), preset("v100", 8)), str(large))
    (w1, h1), (w2, h2) = _png_size(small), _png_size(large)
    assert w1 == w2 and h2 > h1
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []


def test_gantt_labels_only_bars_wide_enough():
    """Every bar of a short schedule is labelled; of 512 bars on one row only the wide ones are."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from graphpipe.sched.gantt import _draw

    for m, all_labelled in ((4, True), (256, False)):
        sg = uniform_chain(2, m)
        tl = simulate(sg, make_schedule("1f1b", sg), preset("v100", 2))
        fig, ax = plt.subplots()
        _draw(ax, tl, "t", tl.iteration_time_s * 1e3, 1400)
        labels = [t.get_text() for t in ax.texts]
        plt.close(fig)
        if all_labelled:
            assert sorted(labels) == sorted(str(r.action.mb_id) for r in tl.actions)
        else:
            assert len(labels) < len(tl.actions) // 4


def test_gantt_pair_and_virtual_stages(tmp_path):
    pytest.importorskip("matplotlib")
    g = OpGraph.build("c", [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3)) for i in range(8)],
                      [(f"l{i}", f"l{i + 1}", 1e4) for i in range(7)])
    rr = round_robin_chain(g, 4, 2, 8, 1)
    inter = simulate(rr, make_schedule("interleaved", rr), preset("v100", 4))
    chain = round_robin_chain(g, 4, 1, 8, 1)
    plain = simulate(chain, make_schedule("1f1b", chain), preset("v100", 4))
    path = tmp_path / "pair.png"
    plot_gantt_pair(plain, inter, str(path), titles=["1F1B", "interleaved 1F1B, v=2"])
    w, h = _png_size(path)
    assert h > 300
    from graphpipe.errors import InputError

    with pytest.raises(InputError, match="two titles"):
        plot_gantt_pair(plain, inter, str(path), titles=["only one"])
