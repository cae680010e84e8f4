"""A rank that trained to the end leaves no process group alive behind it.

Under gloo a group still alive when the interpreter finalises can abort the
rank after a successful run (SIGABRT, "terminate called without an active
exception"; :mod:`graphpipe.runtime.teardown`). It strikes rarely, so a
rerun proves nothing: the oracle is the cause itself, the gloo worker
threads a live group keeps. ``tests/api_script.py`` (every
torchrun test of the training API) exits non-zero if any outlives
``Pipeline.close()``; here the same holds for ``graphpipe run``'s rank loop,
with a replicated stage (a replicas' group) and a pipeline cut (messages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.plan import Plan, write_plan
from graphpipe.sched import make_schedule
from graphpipe.stages import Stage, StageGraph

HERE = os.path.dirname(os.path.abspath(__file__))


_COUNT_SCRIPT = """
import torch.distributed as dist
from graphpipe.runtime.launch import free_port
from graphpipe.runtime.teardown import gloo_threads
before = gloo_threads()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
dist.barrier()
alive = gloo_threads()
dist.destroy_process_group()
print(before, alive, gloo_threads())
"""


def test_gloo_threads_counts_a_live_group_and_nothing_after_it_is_freed():
    # in a fresh interpreter: a test process that ran other tests may keep groups of its own
    proc = subprocess.run([sys.executable, "-c", _COUNT_SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, alive, after = map(int, proc.stdout.split())
    assert before == 0 and alive > 0 and after == 0, (before, alive, after)


@pytest.mark.slow
def test_graphpipe_run_ranks_end_with_no_group_alive(tmp_path):
    graph = zoo.load_graph("mmt:small")
    groups = ["branch0.layer0", "branch0.layer1", "branch1.layer0", "branch1.layer1"], ["concat", "head"]
    stages = [Stage(i, tuple(graph.op_id(n) for n in names), devices, 2)
              for i, (names, devices) in enumerate(zip(groups, [(0, 1), (2,)]))]
    sg = StageGraph.build(graph, stages, 8, 3)
    cluster = preset("v100", 3)
    plan = Plan(model=zoo.canonical_spec("mmt:small"), stage_graph=sg, cluster=cluster, strategy="custom",
                schedule=make_schedule("1f1b", sg, cluster))
    path, out = str(tmp_path / "plan.json"), str(tmp_path / "out.json")
    write_plan(path, plan)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "teardown_script.py"), path, "3", out],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    assert report["exitcodes"] == [0, 0, 0]
    for rank, during, after in report["reports"]:
        assert during and during[0] > 0, f"rank {rank} ran no gloo group: the check would be vacuous"
        assert after == 0, f"rank {rank}: {after} gloo worker threads outlive run_rank"


_LEAVE_SCRIPT = """
import multiprocessing as mp
import multiprocessing.resource_tracker as rt
import os
import sys

def rank(results):
    held = mp.get_context("spawn").Lock()  # named, registered with the launcher's tracker, as tqdm's lock is
    results.put(held._semlock.name)
    from graphpipe.runtime.launch import _leave
    _leave(results, 0)

if __name__ == "__main__":
    rt.ensure_running()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=rank, args=(results,))
    child.start()
    name = results.get(timeout=120)
    child.join(timeout=120)
    results.close()
    results.join_thread()
    print(child.exitcode, os.path.exists("/dev/shm/sem." + name.lstrip("/")))
"""


def test_a_rank_leaving_unlinks_its_named_semaphores(tmp_path):
    """A rank ends with ``os._exit`` (no interpreter teardown), but multiprocessing's exit finalizers still run:
    a named semaphore the rank made (tqdm's lock, whenever fx's interpreter runs under spawn or the forkserver)
    is unlinked, and the launcher's resource tracker reports no leak at exit (``eval all`` reported 12)."""
    script = tmp_path / "leave.py"  # a file: a spawned child re-imports the parent's main module
    script.write_text(_LEAVE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(HERE), env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "False"], proc.stdout
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
