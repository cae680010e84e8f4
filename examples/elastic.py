"""Train the two-tower model so that a lost rank, or a lost host, costs only the steps since the last checkpoint.

Plan once per world size the job may run at, then start it under torchrun with restarts::

    mkdir -p plans
    for n in 2 3 4; do
        graphpipe plan examples/two_tower.py:factory --devices $n --batch-size 64 --out plans/$n.json
    done
    torchrun --nproc-per-node 4 --max-restarts 3 examples/elastic.py plans ckpt

The plan for a world size may use fewer devices than it was given (at batch
64 this model uses 3 of 4, and 1 of 2): ``Pipeline(..., idle_ranks=True)``
lets the ranks past the plan's join the job holding no stage, where a plain
``Pipeline`` refuses any world size but the plan's own (``plan`` prints it).

Every 20 steps each rank writes its stages into ``ckpt/step-N`` (the newest 2
are kept). When a rank dies (killed, out of memory), torchrun stops the others
and starts every rank again; ``pipe.resume`` finds the newest complete
checkpoint and the loop goes on from there, with the data order and dropout an
uninterrupted run would have had. On several hosts, start it with an elastic
node count (``torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3
--rdzv-backend c10d --rdzv-endpoint HOST:29400 ...``): when a host is lost for
good, the job restarts on the ranks left, this script picks the plan made for
that world size, and the checkpoint, keyed by parameter name, loads into it.
"""

import os
import sys

import torch

import graphpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_tower import BATCH, TwoTower, clicks, loss_fn  # noqa: E402

STEPS = int(os.environ.get("STEPS", 200))  # the whole run, counting steps done before a restart
EVERY = 20


def main(plans: str, ckpt: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    pipe = graphpipe.Pipeline(os.path.join(plans, f"{world}.json"), TwoTower(), loss_fn, idle_ranks=True)
    params = list(pipe.parameters())  # none on a rank the plan for this world size leaves idle
    opt = torch.optim.AdamW(params, lr=1e-3) if params else None
    user, item, clicked = clicks(4096, seed=1)
    torch.manual_seed(1)  # the data order below; the checkpoints carry its state across restarts
    start = pipe.resume(ckpt, optimizer=opt)
    if pipe.rank == 0:
        print(f"{world} ranks, starting at step {start}", flush=True)
    for step in range(start, STEPS):
        rows = torch.randint(0, len(user), (BATCH,))
        loss = pipe.step((user[rows], item[rows]), clicked[rows])
        pipe.clip_grad_norm_(1.0)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if (step + 1) % EVERY == 0:
            pipe.save(ckpt, optimizer=opt, step=step + 1, async_save=True)  # written while training goes on
            if pipe.rank == 0:
                print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    pipe.close()  # waits for the last checkpoint


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
