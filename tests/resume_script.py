"""Run under torchrun by tests/test_resume.py: train with step checkpoints, resume after a restart.

    torchrun --nproc-per-node N [--max-restarts R] tests/resume_script.py PLAN.json CKPT_DIR OUT.pt STEPS EVERY
        [--kill-rank R --kill-at K] [--async-save] [--keep K]

Every EVERY steps it saves ``CKPT_DIR/step-N``; on start it resumes from the newest. With ``--kill-rank``, that
rank SIGKILLs itself after step K of the first attempt (torchrun's restart count 0), as the out-of-memory killer
would; torchrun restarts the job and it goes on from its newest checkpoint. Rank 0 writes the losses of the steps
this attempt ran and the final weights.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resume_models as rm  # noqa: E402

import graphpipe  # noqa: E402
from graphpipe.runtime import teardown  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("plan")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--keep", type=int, default=2)
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    pipe = graphpipe.Pipeline(args.plan, rm.Branchy(), rm.loss_fn, timeout_s=300)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(1000)  # the data order's generator (the same on every rank), carried by the checkpoints
    x, y = rm.dataset()
    start = pipe.resume(args.ckpt, optimizer=opt)
    losses = {}
    for step in range(start, args.steps):
        xb, yb = rm.next_batch(x, y)
        losses[step] = pipe.step(xb, yb).item()
        pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            pipe.save(args.ckpt, optimizer=opt, step=step + 1, keep=args.keep, async_save=args.async_save)
        if attempt == 0 and pipe.rank == args.kill_rank and step + 1 == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9, mid-run
    pipe.wait_checkpoint()
    weights = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, weights)
    if pipe.rank == 0:
        merged = {}
        for w in gathered:
            merged.update(w)
        torch.save({"start": start, "attempt": attempt, "losses": losses, "weights": merged}, args.out)
    pipe.close()
    left = teardown.gloo_threads()  # a group alive at exit can abort the rank (graphpipe.runtime.teardown)
    if left:
        sys.exit(f"rank {pipe.rank}: {left} gloo worker thread(s) outlive Pipeline.close()")


if __name__ == "__main__":
    main()
