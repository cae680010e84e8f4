"""The README's training script, run exactly as the README says, trains as one process would."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_losses(module, epochs: int) -> list[float]:
    """The script's loop in one process with plain PyTorch: the oracle for its per-epoch mean losses."""
    torch.manual_seed(0)
    model = module.TwoTower()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    user, item, clicked = module.clicks(4096, seed=1)
    means = []
    for _ in range(epochs):
        total = 0.0
        for i in range(0, len(user), module.BATCH):
            loss = module.loss_fn(model(user[i:i + module.BATCH], item[i:i + module.BATCH]), clicked[i:i + module.BATCH])
            loss.backward()
            total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        means.append(total / (len(user) // module.BATCH))
    return means


@pytest.mark.slow
def test_two_tower_example_runs_as_the_readme_says(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    commands = list(dict.fromkeys(re.findall(r"^(graphpipe plan examples/two_tower\.py:factory .*|torchrun .*two_tower"
                                             r"\.py.*)$", readme, re.M)))  # the plan line is shown twice
    assert len(commands) == 2, commands
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    plan_cmd = commands[0].split()
    plan = subprocess.run([sys.executable, "-m", "graphpipe", *plan_cmd[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    doc = json.loads((tmp_path / "two_tower.json").read_text())
    devices = {d for stage in doc["stages"] for d in stage["devices"]}
    run_cmd = commands[1].split()
    assert run_cmd[1:3] == ["--nproc-per-node", str(len(devices))]  # every rank the README starts has a stage
    assert len(doc["stages"]) >= 3  # the towers are stages of their own
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", *run_cmd[1:3], "--master-addr", "127.0.0.1",
                          "--master-port", str(_port()), *run_cmd[3:]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"epoch \d+: mean loss ([0-9.]+)", run.stdout)]
    spec = importlib.util.spec_from_file_location("two_tower", tmp_path / "examples" / "two_tower.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = _single_process_losses(module, len(losses))
    assert len(losses) == 3 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=2e-4)  # printed to 4 places
    assert (tmp_path / "two_tower_ckpt").is_dir()


@pytest.mark.slow
def test_elastic_example_resumes_on_fewer_ranks(tmp_path):
    """examples/elastic.py as its docstring says: plans per world size; 60 steps on 3 ranks, then the job goes on
    on 2 ranks (a host lost) from the newest checkpoint, with the 2-rank plan."""
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    (tmp_path / "plans").mkdir()
    for n in (2, 3):
        made = subprocess.run([sys.executable, "-m", "graphpipe", "plan", "examples/two_tower.py:factory", "--devices",
                               str(n), "--batch-size", "64", "--out", f"plans/{n}.json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr

    def run(ranks, steps):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                               "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(_port()),
                               "examples/elastic.py", "plans", "ckpt"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "STEPS": str(steps)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    first = run(3, 60)
    assert "3 ranks, starting at step 0" in first and "step 60: loss" in first
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-40", "step-60"]
    second = run(2, 100)
    assert "2 ranks, starting at step 60" in second and "step 100: loss" in second and "step 40:" not in second
