"""Surviving a failure: step checkpoints, resume under torchrun's restarts after a real kill -9, and on fewer ranks.

The oracle is the same training never interrupted: dropout masks are drawn from (seed, step, op, row) and the data
order from the global generator, which the checkpoints carry, so a resumed run must end with the same weights.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

from graphpipe.cluster import preset
from graphpipe.plan import Plan, write_plan
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "resume_script.py")
SPEC = os.path.join(HERE, "resume_models.py") + ":factory"
STEPS = 8


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(tmp_path, layout: str) -> str:
    """gpp-shaped plans by hand: ``four``: the stem replicated on ranks 0 and 1, the two branches side by side on
    2 and 3 (the head with the right one); ``three``: the same cut with the stem on one rank."""
    from graphpipe.models import load_model

    import resume_models as rm

    graph = load_model(SPEC).graph
    groups = [["stem"], ["left.0", "left.3"], ["right.0", "right.2", "head.1"]]
    devices = {"four": [(0, 1), (2,), (3,)], "three": [(0,), (1,), (2,)]}[layout]
    num_devices = max(d for devs in devices for d in devs) + 1
    stages = [Stage(i, tuple(graph.op_id(n) for n in ops), devs, 4) for i, (ops, devs) in enumerate(zip(groups, devices))]
    sg = StageGraph.build(graph, stages, rm.BATCH, num_devices)
    cluster = preset("v100", num_devices)
    plan = Plan(model=SPEC, stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule("graph-1f1b", sg, cluster))
    path = str(tmp_path / f"{layout}.json")
    write_plan(path, plan)
    return path


def _torchrun(plan, ckpt, out, ranks, *extra, restarts=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--max-restarts",
           str(restarts), "--master-addr", "127.0.0.1", "--master-port", str(_port()), SCRIPT, plan, ckpt, out,
           str(STEPS), "2", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False), proc


def _assert_same_weights(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The oracle: the ``four`` plan trained ``STEPS`` steps without interruption, saving synchronously (how a
    checkpoint is written does not change the training)."""
    tmp = tmp_path_factory.mktemp("straight")
    done, _ = _torchrun(_plan(tmp, "four"), str(tmp / "ck"), str(tmp / "straight.pt"), 4)
    assert done["start"] == 0 and sorted(done["losses"]) == list(range(STEPS))
    return done


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_rank_killed_mid_run_is_restarted_and_ends_with_the_uninterrupted_weights(tmp_path, async_save, straight):
    plan = _plan(tmp_path, "four")
    extra = ["--async-save"] if async_save else []
    killed, proc = _torchrun(plan, str(tmp_path / "ck"), str(tmp_path / "killed.pt"), 4, "--kill-rank", "2",
                             "--kill-at", "5", *extra, restarts=1)
    assert killed["attempt"] == 1, "torchrun did not restart the job"
    assert killed["start"] in ((2, 4) if async_save else (4,))  # the newest sealed checkpoint before the kill
    assert "Signals.SIGKILL" in proc.stderr or "SIGKILL" in proc.stderr or "-9" in proc.stderr
    for step, loss in killed["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], rel=1e-6, abs=1e-7)
    _assert_same_weights(killed["weights"], straight["weights"])
    kept = sorted(os.listdir(tmp_path / "ck"))
    assert kept == ["step-6", "step-8"]  # keep=2, and no temporary folder left behind


@pytest.mark.slow
def test_resuming_on_fewer_ranks_from_the_larger_plans_checkpoint(tmp_path, straight):
    """A host is lost for good: train 4 steps on 4 ranks, re-plan for 3, resume from step 4 and finish; the same
    weights as 8 steps on 4 ranks straight (every plan of the model trains the same algorithm)."""
    four, three = _plan(tmp_path, "four"), _plan(tmp_path, "three")
    ckpt = str(tmp_path / "ck")
    # stop after step 4 on 4 ranks: a run of 4 steps writes step-2 and step-4
    cmd_steps = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
                 "--master-port", str(_port()), SCRIPT, four, ckpt, str(tmp_path / "first.pt"), "4", "2"]
    proc = subprocess.run(cmd_steps, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed, _ = _torchrun(three, ckpt, str(tmp_path / "resumed.pt"), 3)
    assert resumed["start"] == 4 and sorted(resumed["losses"]) == list(range(4, STEPS))
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(straight["losses"][step], rel=1e-5, abs=1e-6)
    _assert_same_weights(resumed["weights"], straight["weights"])


def _graphpipe(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "graphpipe", *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_graphpipe_run_restarts_a_killed_rank_and_checks_the_resumed_steps(tmp_path):
    """graphpipe run --checkpoint-dir --max-restarts: rank 1 is SIGKILLed at the end of step 2; every rank starts
    again from step-2 and the resumed steps' losses and gradients equal the single-process run's (--check)."""
    import json

    plan = tmp_path / "p.json"
    made = _graphpipe("plan", "twobranch:small", "--devices", "3", "--batch-size", "12", "--micro-batch-size", "4",
                      "--out", str(plan))
    assert made.returncode == 0, made.stderr
    ckpt = tmp_path / "ck"
    kill = {"GRAPHPIPE_FAIL_RANK": "1", "GRAPHPIPE_FAIL_AT": "kill"}
    # --timeout 300: a loaded host (a parallel suite) must not fail the first attempt before the kill for a slow peer
    proc = _graphpipe("run", str(plan), "--steps", "5", "--check", "--checkpoint-dir", str(ckpt), "--max-restarts",
                      "1", "--json", "--timeout", "300", env=kill)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["check"]["passed"] and summary["resumed_from_step"] == 2 and summary["restarts"] == 1, proc.stderr
    assert len(summary["losses"]) == 3  # steps 2, 3 and 4
    assert "was killed by SIGKILL" in proc.stderr and "restarting every rank (1 of --max-restarts 1)" in proc.stderr
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-5"]
    again = _graphpipe("run", str(plan), "--steps", "5", "--checkpoint-dir", str(ckpt))  # nothing left to run
    assert again.returncode == 2 and "already holds step 5" in again.stderr
    no_restart = _graphpipe("run", str(plan), "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck2"), env=kill)
    assert no_restart.returncode in (1, 2) and "killed by SIGKILL" in no_restart.stderr


def test_max_restarts_needs_a_checkpoint_dir(tmp_path):
    proc = _graphpipe("run", str(tmp_path / "missing.json"), "--max-restarts", "2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--max-restarts needs --checkpoint-dir" in proc.stderr
