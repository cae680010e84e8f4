"""``graphpipe simulate`` end to end: summaries, JSON, trace, Gantt, and malformed plans refused with exit 2."""

from __future__ import annotations

import json

import pytest

from graphpipe.cli import main
from graphpipe.cluster import preset
from graphpipe.plan import Plan, plan_to_dict, write_plan
from graphpipe.stages import Stage, StageGraph
from graphpipe.sched import make_schedule, predicted_figures, simulate

from test_sched_common import make_op_graph_diamond


def _plan(schedule_name: str = "graph-1f1b") -> Plan:
    g = make_op_graph_diamond(fwd=1e-3)
    sg = StageGraph.build(g, [Stage(i, (i,), (i,), 2) for i in range(4)], 16, 4)
    cluster = preset("v100", 4)
    schedule = make_schedule(schedule_name, sg, cluster)
    return Plan(model="diamond", stage_graph=sg, cluster=cluster, strategy="custom", schedule=schedule,
                predicted=predicted_figures(simulate(sg, schedule, cluster)))


def _write(tmp_path, doc, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_json_output_matches_simulator(tmp_path, capsys):
    plan = _plan()
    path = str(tmp_path / "plan.json")
    write_plan(path, plan)
    assert main(["simulate", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = predicted_figures(simulate(plan.stage_graph, plan.schedule, plan.cluster))
    for key in ("iteration_time_s", "throughput", "bubble_fraction", "peak_memory_bytes", "in_flight"):
        assert out[key] == pytest.approx(expected[key])
    assert len(out["bubble_fraction"]) == len(out["peak_memory_bytes"]) == 4


def test_summary_trace_gantt_and_regenerated_schedule(tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    write_plan(path, _plan())
    trace, png, out_plan = tmp_path / "t.json", tmp_path / "g.png", tmp_path / "p2.json"
    assert main(["simulate", path, "--schedule", "gpipe", "--trace", str(trace), "--gantt", str(png),
                 "--out", str(out_plan)]) == 0
    text = capsys.readouterr().out
    assert "schedule gpipe" in text and "iteration time:" in text and "in flight" in text
    doc = json.loads(trace.read_text())
    names = {e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"}
    assert {"F s0 mb0", "B s3 mb7", "fwd s0->s1 mb0", "bwd s3->s1 mb7"} <= names
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(out_plan.read_text())
    assert saved["schedule"]["name"] == "gpipe"
    assert saved["predicted"]["in_flight"] == [8, 8, 8, 8]  # fill-drain keeps every micro-batch alive


def _png_height(path) -> int:
    return int.from_bytes(path.read_bytes()[20:24], "big")


def test_many_devices_show_a_row_per_stage(tmp_path, capsys, monkeypatch):
    """Past the CLI's limits the trace and the chart show each stage's first device (a note says so), with exactly
    that device's events; --all-devices shows every one. Here the limits are lowered to the plan's 6 devices."""
    from graphpipe.cli import simulate_cmd

    pytest.importorskip("matplotlib")
    g = make_op_graph_diamond(fwd=1e-3)
    rr = {"replica_mode": "round-robin"}
    stages = [Stage(0, (0,), (0, 1), 1, **rr), Stage(1, (1,), (2,), 1), Stage(2, (2,), (3, 4), 2),
              Stage(3, (3,), (5,), 1)]
    sg = StageGraph.build(g, stages, 8, 6)
    cluster = preset("v100", 6)
    schedule = make_schedule("graph-1f1b", sg, cluster)
    plan = Plan(model="diamond", stage_graph=sg, cluster=cluster, strategy="custom", schedule=schedule,
                predicted=predicted_figures(simulate(sg, schedule, cluster)))
    path = str(tmp_path / "plan.json")
    write_plan(path, plan)
    timeline = simulate(sg, schedule, cluster)
    monkeypatch.setattr(simulate_cmd, "TRACE_DEVICES", 4)
    monkeypatch.setattr(simulate_cmd, "GANTT_ROWS", 4)
    few, every = (tmp_path / "few.json", tmp_path / "few.png"), (tmp_path / "all.json", tmp_path / "all.png")
    assert main(["simulate", path, "--trace", str(few[0]), "--gantt", str(few[1])]) == 0
    err = capsys.readouterr().err
    assert err.count("shows each stage's first device, 4 of the plan's 6") == 2 and "--all-devices" in err
    assert main(["simulate", path, "--trace", str(every[0]), "--gantt", str(every[1]), "--all-devices"]) == 0
    assert "first device" not in capsys.readouterr().err
    shown = {0, 2, 3, 5}
    assert set(timeline.stage_first_devices()) == shown
    for trace, devices in ((few[0], shown), (every[0], set(range(6)))):
        events = json.loads(trace.read_text())["traceEvents"]
        assert {e["pid"] for e in events} == devices
        compute = sorted((e["pid"], e["args"]["action"]) for e in events if e.get("cat") in ("F", "B"))
        assert compute == sorted((r.device, str(r.action)) for r in timeline.actions if r.device in devices)
        sends = [e for e in events if e.get("cat", "").startswith("transfer-")]
        assert len(sends) == sum(sum(d in devices for d in t.src_devices) for t in timeline.transfers
                                 if t.end > t.start) > 0
    assert _png_height(few[1]) < _png_height(every[1])
    # the summary's device table: consecutive devices whose rows read the same share one row (3-4: the replicas
    # of stage 2, which split each micro-batch), and stages list their devices as runs
    assert main(["simulate", path]) == 0
    table = capsys.readouterr().out.split("\n\n")[1].splitlines()
    labels = [line.split()[0] for line in table[1:]]
    assert "3-4" in labels and "3" not in labels and "4" not in labels
    figures = predicted_figures(timeline)
    expected = {d: (figures["bubble_fraction"][d], figures["peak_memory_bytes"][d]) for d in range(6)}
    assert expected[3] == expected[4]
    covered = [d for label in labels for d in (range(int(label.split("-")[0]), int(label.split("-")[-1]) + 1))]
    assert covered == list(range(6))


@pytest.mark.parametrize("extra", [[], ["--schedule", "1f1b-async"], ["--host-cores", "1"]])
def test_figures_without_records_equal_the_timeline_s(tmp_path, capsys, extra):
    """Without --trace/--gantt, simulate sums the figures without building the timeline's records; they are the
    figures the timeline gives (flushing and asynchronous schedules, a shared host)."""
    path = str(tmp_path / "plan.json")
    write_plan(path, _plan("1f1b" if extra else "graph-1f1b"))
    outs = []
    for trace in ([], ["--trace", str(tmp_path / "t.json")]):
        assert main(["simulate", path, "--json", *extra, *trace]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] and outs[0]["throughput"] > 0


def test_plan_table_states_the_longest_step_collective():
    """graphpipe plan's "collectives" line: the longest step-end collective against the step, here stage 0's two
    replicas all-reducing its 4 MB on one V100 node (a ring: 2(r-1) latencies + 2(r-1)/r bytes / bandwidth)."""
    from graphpipe.cli.plan_cmd import format_plan

    stages = [Stage(0, (0,), (0, 1), 2), Stage(1, (1,), (2,), 2), Stage(2, (2,), (3,), 2), Stage(3, (3,), (4,), 2)]
    sg = StageGraph.build(make_op_graph_diamond(fwd=1e-3), stages, 16, 5)
    cluster = preset("v100", 5)
    schedule = make_schedule("graph-1f1b", sg, cluster)
    plan = Plan(model="diamond", stage_graph=sg, cluster=cluster, strategy="custom", schedule=schedule,
                predicted=predicted_figures(simulate(sg, schedule, cluster)))
    seconds = 2 * 1 * 5e-6 + 2 * 1 / 2 * 4e6 / 50e9  # the preset's intra-node link: 5 us, 50 GB/s
    line = next(x for x in format_plan(plan).splitlines() if x.startswith("collectives"))
    share = seconds / plan.predicted.iteration_time_s
    assert line == (f"collectives     longest step-end all-reduce {seconds * 1e3:.1f} ms ({share:.0%} of the step): "
                    f"stage 0's 0.004 GB of gradients over 2 replicas")
    assert not any(x.startswith("collectives") for x in format_plan(_plan()).splitlines())  # no replicas, no line


def _breakers():
    def non_convex(doc):
        # {in, out} in one stage: the path in -> a -> out leaves it and comes back.
        doc["stages"] = [{"id": 0, "ops": ["in", "out"], "devices": [0], "micro_batch_size": 2},
                         {"id": 1, "ops": ["a"], "devices": [1], "micro_batch_size": 2},
                         {"id": 2, "ops": ["b"], "devices": [2], "micro_batch_size": 2}]
        doc.pop("stage_edges", None)

    def overlapping(doc):
        doc["stages"][1]["devices"] = [1, 2]

    def missing_b(doc):
        doc["schedule"]["actions"]["2"].remove("2B3")

    def unknown_format(doc):
        doc["format"] = "graphpipe.plan/9"

    def bad_action(doc):
        doc["schedule"]["actions"]["1"][0] = "one-F-zero"

    def deadlock(doc):
        # a runs its B0 right after F0 (it needs out's B0), out runs F1 before B0 (it needs a's F1).
        a, out = doc["schedule"]["actions"]["1"], doc["schedule"]["actions"]["3"]
        a.remove("1B0")
        a.insert(1, "1B0")
        out.remove("3F1")
        out.insert(1, "3F1")

    return {
        "non_convex": (non_convex, "not convex"),
        "overlapping": (overlapping, "device 2 is used by more than one stage"),
        "missing_b": (missing_b, "device 2 never runs 2B3"),
        "unknown_format": (unknown_format, "unsupported format 'graphpipe.plan/9'"),
        "bad_action": (bad_action, "bad action 'one-F-zero'"),
        "deadlock": (deadlock, "device 1 blocked at 1B0 waiting for 3B0; device 2 blocked at 2B0"),
    }


@pytest.mark.parametrize("case", sorted(_breakers()))
def test_malformed_plan_exits_2_with_one_line(tmp_path, capsys, case):
    breaker, message = _breakers()[case]
    doc = plan_to_dict(_plan())
    breaker(doc)
    assert main(["simulate", _write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("graphpipe: error: ")
    assert message in err


def test_verbose_logs_the_marked_grid(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="graphpipe.cli.simulate_cmd")
    doc = plan_to_dict(_plan())
    _breakers()["deadlock"][0](doc)
    assert main(["-v", "simulate", _write(tmp_path, doc)]) == 2
    assert ">1B0<" in caplog.text and "device 3:" in caplog.text


def test_interleaved_refused_on_a_branchy_plan(tmp_path, capsys):
    doc = plan_to_dict(_plan())
    doc["stages"][3]["devices"] = [0]  # out shares device 0 with in: not round-robin over 3 groups
    doc["schedule"] = {"name": "custom", "actions": {}}
    assert main(["simulate", _write(tmp_path, doc), "--schedule", "interleaved"]) == 2
    assert "interleaved 1F1B needs" in capsys.readouterr().err


def test_missing_file_and_unknown_schedule(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = str(tmp_path / "plan.json")
    write_plan(path, _plan())
    assert main(["simulate", path, "--schedule", "zb-v"]) == 2
    assert "unknown schedule 'zb-v'" in capsys.readouterr().err


def test_cpsat_schedule_is_validated_and_no_worse(tmp_path, capsys):
    pytest.importorskip("ortools")
    cpsat = pytest.importorskip("graphpipe.search.cpsat")
    if not hasattr(cpsat, "optimize_plan"):
        pytest.skip("graphpipe.search.cpsat.optimize_plan not available")
    plan = _plan()
    path = str(tmp_path / "plan.json")
    write_plan(path, plan)
    assert main(["simulate", path, "--schedule", "cpsat", "--time-limit", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_s"] <= plan.predicted["iteration_time_s"] * (1 + 1e-6)


def test_host_cores_time_shares_the_devices(tmp_path, capsys):
    """--host-cores N simulates on SharedHost.cores(N); with one core the diamond's branches take turns."""
    from graphpipe.sched import SharedHost

    plan = _plan()
    path = str(tmp_path / "plan.json")
    write_plan(path, plan)
    times = {}
    for cores in (4, 1):
        assert main(["simulate", path, "--json", "--host-cores", str(cores)]) == 0
        times[cores] = json.loads(capsys.readouterr().out)["iteration_time_s"]
        host = SharedHost.cores(cores)
        assert times[cores] == pytest.approx(simulate(plan.stage_graph, plan.schedule, plan.cluster, host=host).iteration_time_s)
    assert times[4] == pytest.approx(plan.predicted["iteration_time_s"])
    assert times[1] > times[4]
    assert main(["simulate", path, "--host-cores", "0"]) == 2
    assert capsys.readouterr().err.strip() == "graphpipe: error: --host-cores must be at least 1, got 0"


def test_zero_bubble_schedules_from_the_cli(tmp_path, capsys):
    """graph-zb simulates a branchy plan; zb-h1 on it is one line pointing to graph-zb; a W before its I exits 2."""
    path = str(tmp_path / "plan.json")
    write_plan(path, _plan())
    assert main(["simulate", path, "--schedule", "graph-zb", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "graph-zb"
    assert main(["simulate", path, "--schedule", "zb-h1"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "use 'graph-zb'" in err
    doc = plan_to_dict(_plan("graph-zb"))
    acts = doc["schedule"]["actions"]["3"]
    first_w = next(i for i, a in enumerate(acts) if "W" in a)
    i_pos = acts.index(acts[first_w].replace("W", "I"))
    acts[i_pos], acts[first_w] = acts[first_w], acts[i_pos]
    assert main(["simulate", _write(tmp_path, doc)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "before" in err and "device x step grid" in err
