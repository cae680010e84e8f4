"""Real multi-process runs on CPU/gloo.

Oracle: the loss and every parameter gradient of the first iteration equal a
single-process run of the same model on the whole mini-batch
(``RunOptions.check``: ``|a - b| <= atol + rtol*|b|`` with assert_close's
fp32 tolerances, every parameter compared exactly once). Process start-up
dominates on a 2-core box, so all correctness plans run as jobs of one
spawned 4-rank world.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.plan import Plan, write_plan
from graphpipe.runtime import RunOptions, RuntimeFailure, run_plans
from graphpipe.sched import make_schedule, round_robin_chain
from graphpipe.stages import Stage, StageGraph

pytestmark = pytest.mark.slow

SMALL = ("mmt:small", "dlrm:small", "candle-uno:small", "transformer:small", "twobranch:small")
STRATEGIES = ("gpp", "pipedream", "gpipe")
SCHEDULES = ("gpipe", "1f1b", "graph-1f1b")
BATCH = 8


def planned(spec: str, strategy: str, num_devices: int, schedule: str | None = None) -> Plan:
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    graph = zoo.load_graph(spec)
    plan = make_plan(zoo.canonical_spec(spec), graph, preset("v100", num_devices), BATCH, strategy,
                     SearchOptions(micro_batch_size=2))
    if schedule is not None and schedule != plan.schedule.name:
        plan = plan.with_schedule(make_schedule(schedule, plan.stage_graph, plan.cluster))
    return plan


def hand_built(spec, groups, devices, mbs, num_devices, schedule, shared=False):
    graph = zoo.load_graph(spec)
    stages = [Stage(i, tuple(graph.op_id(n) for n in ops), tuple(devs), mb)
              for i, (ops, devs, mb) in enumerate(zip(groups, devices, mbs))]
    sg = StageGraph.build(graph, stages, BATCH, num_devices, allow_shared_devices=shared)
    cluster = preset("v100", num_devices)
    return Plan(model=zoo.canonical_spec(spec), stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule(schedule, sg, cluster))


def correctness_plans() -> dict[str, Plan]:
    plans = {}
    for i, spec in enumerate(SMALL):
        for j, strategy in enumerate(STRATEGIES):
            n = 2 + (i + j) % 3  # 2-4 devices
            for schedule in SCHEDULES:  # the strategy's own schedule and the two others on its stages
                plans[f"{spec}/{strategy}/{n}dev/{schedule}"] = planned(spec, strategy, n, schedule)
    mmt = ["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]
    # per-stage micro-batch sizes: the join takes two producer micro-batches from one branch, one from the other
    plans["mmt/per-stage-mb"] = hand_built("mmt:small", mmt, [(0,), (1,), (2,)], [2, 4, 4], 3, "graph-1f1b")
    # a replicated (data-parallel) join stage, consumer micro-batch smaller than a producer's
    plans["mmt/replicated"] = hand_built("mmt:small", mmt, [(0,), (1,), (2, 3)], [4, 2, 4], 4, "graph-1f1b")
    uno = ["branch0.layer0", "branch0.layer1", "branch1.layer0"], ["branch1.layer1"], ["concat", "head.layer0", "head.layer1"]
    plans["uno/replicated-producer"] = hand_built("candle-uno:small", uno, [(0, 1), (2,), (3,)], [4, 2, 2], 4, "gpipe")
    tb = ["embed"], ["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]
    plans["twobranch/fan-out"] = hand_built("twobranch:small", tb, [(0,), (1,), (2,), (3,)], [2, 2, 2, 4], 4, "graph-1f1b")
    # interleaved virtual stages: 4 stages round-robin on 2 devices
    graph = zoo.load_graph("transformer:small")
    sg = round_robin_chain(graph, 2, 2, BATCH, 2)
    cluster = preset("v100", 2)
    plans["transformer/interleaved"] = Plan(model="transformer:small", stage_graph=sg, cluster=cluster, strategy="custom",
                                            schedule=make_schedule("interleaved", sg, cluster))
    return plans


def run_checked(plans: dict, names: list[str], ranks: int = 4) -> list[dict]:
    """Run each named plan for 2 steps with ``--check`` on ``ranks`` ranks; assert that every one equals
    single-process training with all its parameters checked. Returns the results in ``names`` order."""
    results = run_plans([(plans[n], RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=120)) for n in names],
                        ranks)
    failures = {name: result.check for name, result in zip(names, results)
                if not (result.check.passed
                        and result.check.num_params_checked == result.check.num_params > 0)}
    assert not failures, failures
    return results


def test_every_model_strategy_and_schedule_matches_single_process():
    plans = correctness_plans()
    names = sorted(plans)
    results = run_checked(plans, names)
    for name, result in zip(names, results):
        assert result.records, name
        kinds = {r["kind"] for r in result.records}
        assert {"F", "B"} <= kinds, name
    # the data-parallel stages all-reduced their gradients
    replicated = results[names.index("mmt/replicated")]
    assert any(r["kind"] == "AR" for r in replicated.records)
    for name in ("mmt/replicated", "twobranch/fan-out", "transformer/interleaved", "dlrm:small/pipedream/4dev/1f1b"):
        check_measured_timeline(plans[name], results[names.index(name)].records)


def check_measured_timeline(plan, records):
    """The measured iteration as a sched Timeline: every scheduled action once, in schedule order, causal."""
    from graphpipe.runtime.measure import measured_timeline
    from graphpipe.runtime.routing import edge_pieces

    tl = measured_timeline(plan, records)
    sg = plan.stage_graph
    assert tl.source == "measured" and tl.iteration_time_s > 0
    for d, acts in enumerate(plan.schedule.device_actions):
        ran = [r.action for r in tl.actions if r.device == d]
        assert ran == list(acts)  # each rank ran its list in order
    end = {(r.device, r.action.stage_id, r.action.kind, r.action.mb_id): r.end for r in tl.actions}
    for r in tl.actions:
        assert 0 <= r.start <= r.end <= tl.iteration_time_s
        s, j = r.action.stage_id, r.action.mb_id
        if r.action.kind == "F":  # causality along stage edges (one host: one clock)
            k = sg.stages[s].devices.index(r.device)
            for p in sg.preds(s):
                needed = [piece for piece in edge_pieces(sg, p, s) if (piece.consumer_mb, piece.consumer_replica) == (j, k)]
                assert needed and {piece.producer_mb for piece in needed} <= set(sg.consumed_mbs(p, s, j))
                for piece in needed:
                    assert end[(sg.stages[p].devices[piece.producer_replica], p, "F", piece.producer_mb)] <= r.start
        else:
            assert end[(r.device, s, "F", j)] <= r.start
    assert {a.stage_id for a in tl.allreduces} == {st.id for st in sg.stages if st.num_replicas > 1}


def test_cli_run_writes_trace_and_gantt(tmp_path, capsys):
    from graphpipe.cli import main

    write_plan(str(tmp_path / "p.json"), hand_built("candle-uno:small", (["branch0.layer0", "branch0.layer1"],
               ["branch1.layer0", "branch1.layer1"], ["concat", "head.layer0", "head.layer1"]), [(0,), (1,), (2,)], [2, 2, 4], 3,
               "graph-1f1b"))
    code = main(["run", str(tmp_path / "p.json"), "--steps", "2", "--json", "--trace", str(tmp_path / "t.json"),
                 "--gantt", str(tmp_path / "g.png"), "--gantt-pair", str(tmp_path / "pair.png")])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["measured"]["throughput"] == pytest.approx(BATCH / doc["measured"]["iteration_time_s"])
    assert doc["predicted"]["iteration_time_s"] > 0 and "check" not in doc
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert any(n and n.startswith("F") for n in names) and any(n and n.startswith("B") for n in names)
    for png in ("g.png", "pair.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_rank_ends_the_run_with_its_message(tmp_path, monkeypatch, capsys):
    from graphpipe.cli import main

    plan = planned("transformer:small", "pipedream", 3)
    write_plan(str(tmp_path / "p.json"), plan)
    monkeypatch.setenv("GRAPHPIPE_FAIL_RANK", "1")
    monkeypatch.setenv("GRAPHPIPE_FAIL_AT", "F")
    timeout = 60
    started = time.monotonic()
    code = main(["run", str(tmp_path / "p.json"), "--timeout", str(timeout), "--steps", "2"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1
    assert "rank 1 failed" in err and "injected failure" in err and "GRAPHPIPE_FAIL_AT=F" in err
    assert elapsed < timeout  # liveness: the other ranks were stopped, nobody waited for the timeout


def test_a_silent_rank_makes_its_peers_time_out(tmp_path, monkeypatch):
    plan = planned("transformer:small", "pipedream", 3)
    monkeypatch.setenv("GRAPHPIPE_FAIL_RANK", "1")
    monkeypatch.setenv("GRAPHPIPE_FAIL_AT", "hang")
    timeout = 5.0
    started = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        run_plans([(plan, RunOptions(steps=1, timeout_s=timeout))])
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "rank 1" in message and "5 s" in message, message  # a peer names the silent rank and the timeout
    assert elapsed < 120  # start-up + one timeout, never an endless wait


def test_torch_baseline_refuses_fan_out_before_launch(tmp_path, capsys):
    from graphpipe.cli import main

    tb = ["embed"], ["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]
    write_plan(str(tmp_path / "p.json"), hand_built("twobranch:small", tb, [(0,), (1,), (2,), (3,)], [2] * 4, 4, "1f1b"))
    assert main(["run", str(tmp_path / "p.json"), "--baseline", "torch"]) == 2
    err = capsys.readouterr().err
    assert "torch.distributed.pipelining cannot run this plan" in err and "fans out" in err


def test_torch_baseline_matches_our_runtime_on_a_sequential_plan():
    plan = planned("transformer:small", "pipedream", 2, "1f1b")
    assert plan.stage_graph.is_chain()
    # Pinned to one CPU each where the host has two (CI's has): pinning changes where ranks run, never what they compute.
    pin = 1 if len(os.sched_getaffinity(0)) >= 2 else 0
    ours, theirs, unmeasured = run_plans([(plan, RunOptions(steps=3, check=True, cpus_per_rank=pin)),
                                          (plan, RunOptions(steps=3, check=True, baseline="torch", cpus_per_rank=pin)),
                                          (plan, RunOptions(steps=3, check=True, cpus_per_rank=pin, measure=False))], 2)
    assert ours.check.passed and theirs.check.passed, (ours.check, theirs.check)
    # --no-measure (the API's path: no per-action synchronisation, no saved-tensor meter) computes the same steps
    assert unmeasured.check.passed and unmeasured.losses == ours.losses, unmeasured.check
    assert ours.measured.peak_activation_bytes is not None and unmeasured.measured.peak_activation_bytes is None
    if pin:
        allowed = sorted(os.sched_getaffinity(0))
        assert ours.rank_cpus == theirs.rank_cpus == ((allowed[0],), (allowed[1],))
    assert theirs.baseline.endswith("Schedule1F1B")
    import torch

    # Same model, data and SGD updates: the losses of every step agree.
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-5, atol=1e-6)


def test_torchrun_entry_point_runs_one_rank(tmp_path):
    """``python -m graphpipe.runtime`` reads torchrun's environment (here a world of one)."""
    from graphpipe.runtime.launch import free_port

    plan = planned("candle-uno:small", "gpp", 1)
    write_plan(str(tmp_path / "p.json"), plan)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("GRAPHPIPE_FAIL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "graphpipe.runtime", str(tmp_path / "p.json"), "--steps", "2",
                           "--check", "--json", "--cpus-per-rank", "1"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["check"]["passed"] and doc["measured"]["throughput"] > 0
    assert doc["rank_cpus"] == [[min(os.sched_getaffinity(0))]]  # local rank 0 pinned to the first allowed CPU
    assert set(doc["predicted"]) >= {"iteration_time_s", "throughput"}


@pytest.mark.gpu
def test_nccl_run_matches_single_process_when_every_rank_has_a_gpu():
    """The same check on NCCL (one GPU per rank); skipped on CPU-only machines."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    plans = [planned("transformer:small", "pipedream", 2, "1f1b"), planned("mmt:small", "gpp", 2)]
    results = run_plans([(p, RunOptions(steps=2, check=True, backend="nccl")) for p in plans], 2)
    for result in results:
        assert result.backend == "nccl" and result.check.passed, result.check


def test_torchrun_entry_point_refuses_pinning_beyond_the_hosts_cpus(tmp_path):
    from graphpipe.runtime.launch import free_port

    plan = planned("candle-uno:small", "gpp", 1)
    write_plan(str(tmp_path / "p.json"), plan)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("GRAPHPIPE_FAIL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "graphpipe.runtime", str(tmp_path / "p.json"), "--steps", "1",
                           "--cpus-per-rank", "100000"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--cpus-per-rank 100000: rank 0 needs" in proc.stderr
