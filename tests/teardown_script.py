"""Run by tests/test_teardown.py: ``graphpipe run``'s rank loop (``run_rank``) on RANKS spawned CPU ranks, then
report per rank how many gloo worker threads it ran during the job and how many outlive ``run_rank``.

    python tests/teardown_script.py PLAN.json RANKS OUT.json
"""

import json
import os
import sys

import torch.multiprocessing as mp


def child(rank: int, world: int, plan_doc: dict, init_method: str, queue) -> None:
    from graphpipe.runtime import RunOptions
    from graphpipe.runtime.teardown import gloo_threads
    from graphpipe.runtime.worker import run_rank

    during = []
    run_rank(rank, world, [(plan_doc, RunOptions(steps=2, num_threads=1))], init_method,
             lambda index, result: during.append(gloo_threads()))
    queue.put((rank, during, gloo_threads()))


def main() -> None:
    from graphpipe.runtime.launch import free_port

    plan_path, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(plan_path) as f:
        plan_doc = json.load(f)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=child, args=(r, world, plan_doc, init, queue)) for r in range(world)]
    for p in procs:
        p.start()
    reports = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    with open(out, "w") as f:
        json.dump({"reports": sorted(reports), "exitcodes": [p.exitcode for p in procs]}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
