"""A plan runs on the ranks it uses (``Plan.num_ranks``): ``plan`` prints the torchrun line, and a job started
with another number of ranks stops on every rank, before any collective, in one line naming the plan's rank
count and the flag (exit code 2, no traceback from graphpipe's ranks).

Oracle for the launch: the README's training loop (``AdamW(pipe.parameters())``, step, clip, ``opt.step``) on a
model planned on 4 devices that uses 3, started as ``plan`` says; the same job started with 4 ranks, as the user
asked the planner, refused on all 4.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOOP = '''
import sys
import torch
import graphpipe
sys.path.insert(0, {examples!r})
from two_tower import BATCH, TwoTower, clicks, loss_fn

torch.manual_seed(0)
pipe = graphpipe.Pipeline(sys.argv[1], TwoTower(), loss_fn)
opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
user, item, clicked = clicks(2 * BATCH, seed=1)
for i in range(0, 2 * BATCH, BATCH):
    loss = pipe.step((user[i:i + BATCH], item[i:i + BATCH]), clicked[i:i + BATCH])
    pipe.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
with open(f"{{sys.argv[2]}}/rank{{pipe.rank}}", "w") as f:  # a file each: ranks' stdout lines may interleave
    f.write(f"{{float(loss)}}")
pipe.close()
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(devices: tuple[int, ...], num_devices: int, per_node: int | None = None):
    """transformer:small in one stage replicated over ``devices`` of ``num_devices``."""
    from dataclasses import replace

    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.plan import Plan
    from graphpipe.sched.generators import gpipe
    from graphpipe.stages import Stage, StageGraph

    graph = zoo.load_graph("transformer:small")
    cluster = preset("v100", num_devices)
    if per_node is not None:
        cluster = replace(cluster, devices_per_node=per_node)
    mb = 2 * len(devices)  # 2 rows per replica
    sg = StageGraph.build(graph, [Stage(0, tuple(range(len(graph.ops))), devices, mb)], 2 * mb, num_devices)
    return Plan(model="transformer:small", stage_graph=sg, cluster=cluster, strategy="custom", schedule=gpipe(sg))


def test_num_ranks_and_the_torchrun_flags():
    """Ranks up to the last device holding a stage; flags laid on the cluster's nodes."""
    from graphpipe.plan import torchrun_flags

    assert _plan((0,), 4).num_ranks == 1 and torchrun_flags(_plan((0,), 4)) == "--nproc-per-node 1"
    assert _plan((0, 1, 2), 4).num_ranks == 3
    assert torchrun_flags(_plan(tuple(range(16)), 16, per_node=8)) == "--nnodes 2 --nproc-per-node 8"
    uneven = _plan(tuple(range(12)), 16, per_node=8)
    assert torchrun_flags(uneven) == "--nnodes 2 --nproc-per-node 8 (4 on the last node)"


def test_a_job_of_another_size_is_refused_before_the_process_group(tmp_path, monkeypatch, capsys):
    """In one process: WORLD_SIZE=2 for a plan on one rank. The error is a PlanError (a script may catch it)
    and, uncaught, a SystemExit of status 2; the process group was never started."""
    import torch.distributed as dist

    from graphpipe.errors import LaunchError, PlanError
    from graphpipe.plan import write_plan
    from graphpipe.runtime.api import Pipeline

    path = str(tmp_path / "one.json")
    write_plan(path, _plan((0,), 4))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(LaunchError) as info:
        Pipeline(path)
    assert isinstance(info.value, PlanError) and isinstance(info.value, SystemExit) and info.value.code == 2
    assert str(info.value) == (f"{path} runs on 1 rank (its stages are on device 0), torchrun started 2: "
                               "start it with `torchrun --nproc-per-node 1`")
    assert capsys.readouterr().err == f"graphpipe: error: rank 1: {info.value}\n"
    assert not dist.is_initialized()
    from graphpipe.runtime.api import _check_world_size

    _check_world_size(_plan((0,), 4), path, idle_ranks=True)  # an elastic job's extra ranks, asked for: let in
    with pytest.raises(LaunchError, match=r"runs on 3 ranks \(its stages are on devices 0-2\), torchrun started 2"):
        _check_world_size(_plan((0, 1, 2), 4), path, idle_ranks=True)  # too few: never


@pytest.mark.slow
def test_a_plan_on_3_of_4_devices_trains_on_3_ranks_and_stops_on_4(tmp_path):
    """The issue's trap: the two-tower model planned on 4 devices uses 3. Started with the printed line, the
    README's loop trains; started with 4 ranks, every rank stops with the one line, exit status 2, and no rank
    reaches a collective (no gloo "Connection closed", no traceback of ours)."""
    plan = subprocess.run([sys.executable, "-m", "graphpipe", "plan", "examples/two_tower.py:factory", "--devices",
                           "4", "--batch-size", "64", "--out", str(tmp_path / "tt.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    assert "uses 3 of 4 devices" in plan.stderr
    line = re.search(r"^train it on 3 ranks: torchrun (--nproc-per-node 3) your_script\.py", plan.stdout, re.M)
    assert line, plan.stdout
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(examples=os.path.join(ROOT, "examples")))

    def launch(flag: str):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", *flag.split(), "--master-addr",
                               "127.0.0.1", "--master-port", str(_port()), str(script), str(tmp_path / "tt.json"),
                               str(tmp_path)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})

    good = launch(line.group(1))
    assert good.returncode == 0, good.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0", "rank1", "rank2"]  # every rank trained
    bad = launch("--nproc-per-node 4")
    assert bad.returncode != 0
    want = (f"{tmp_path / 'tt.json'} runs on 3 ranks (its stages are on devices 0-2), torchrun started 4: "
            "start it with `torchrun --nproc-per-node 3`")
    # every rank refuses before any collective; torchrun may stop the others once the first has exited, so at
    # least one rank's line is there, and no rank reached a collective (below)
    assert any(f"graphpipe: error: rank {rank}: {want}" in bad.stderr for rank in range(4)), bad.stderr[-3000:]
    assert "exitcode  : 2" in bad.stderr
    assert "Connection closed" not in bad.stderr and "graphpipe/runtime" not in bad.stderr
    assert "optimizer got an empty parameter list" not in bad.stderr
