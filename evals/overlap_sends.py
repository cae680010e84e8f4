"""Receives posted one action ahead against receives posted at use, on two NCCL ranks (two GPUs).

::

    python -m graphpipe.evals.overlap_sends --out OUT     # OUT/results/overlap_sends.json, OUT/overlap-trace-rank{0,1}.json

A two-stage 1f1b plan (8 micro-batches) of a GPT-style transformer, trained through :class:`graphpipe.Pipeline` on two
ranks with one GPU each. A CUDA rank's mailbox posts the next action's receives before computing the current
one (:meth:`graphpipe.runtime.comm.Mailbox.prefetch`); here the steps alternate between that and posting
each receive where it is consumed (``mailbox.post_early`` switched on the executor between steps), so both
are measured side by side in one run (no optimizer step: both modes must give the same loss, reported). The figure is the ratio of median step times (posted-at-use over
posted-early; above 1.0 is a gain). A ``torch.profiler`` trace of two early-posting steps per rank shows the
NCCL ``SendRecv`` kernels on their own streams beside the compute kernels. Benchmarks are not tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

__all__ = ["main"]

MODEL = "transformer:small,layers=8,hidden=1024,seq=256,heads=16,ffn=4096,vocab=1024"


def _rank(rank: int, port: int, out: str, steps: int, batch: int, mbs: int, plan_path: str, model: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    from graphpipe.frontend import zoo
    from graphpipe.runtime.api import Pipeline

    pipe = Pipeline(plan_path, seed=0)
    mailbox = pipe.rank_setup.executor.mailbox
    x = tuple(t.to(pipe.device) for t in zoo.build(model, seed=0).make_inputs(batch, 0))
    cuda = pipe.device.type == "cuda"

    def sync() -> None:
        if cuda:
            sync()
    times = {True: [], False: []}
    losses = {True: set(), False: set()}  # no optimizer step: every step's loss is the same in both modes
    for i in range(4 + 2 * steps):
        early = i % 2 == 0
        mailbox.post_early = early
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        loss = pipe.step(x)
        for p in pipe.parameters():  # gradients accumulate otherwise; the step's work is the same either way
            p.grad = None
        sync()
        if i >= 4:
            times[early].append(time.perf_counter() - t0)
            losses[early].add(loss.item())
    mailbox.post_early = True
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(2):
            pipe.step(x)
        sync()
    prof.export_chrome_trace(os.path.join(out, f"overlap-trace-rank{rank}.json"))
    if rank == 0:
        early, lazy = statistics.median(times[True]), statistics.median(times[False])
        row = {"model": model, "batch_size": batch, "micro_batch_size": mbs, "schedule": "1f1b", "ranks": 2,
               "device_name": torch.cuda.get_device_name(0) if cuda else "cpu (gloo)", "steps_each": steps, "early_step_s": times[True],
               "at_use_step_s": times[False], "early_median_s": early, "at_use_median_s": lazy,
               "gain_ratio": lazy / early, "losses_equal": losses[True] == losses[False] and len(losses[True]) == 1}
        from .common import write_result

        write_result(out, "overlap_sends" if cuda else "overlap_sends-cpu", {"model": model, "batch_size": batch,
                                                                            "steps": steps}, [row],
                     {"gain_ratio": row["gain_ratio"], "losses_equal": row["losses_equal"]})
        print(f"{model} batch {batch} mb {mbs} 1f1b on 2 x {row['device_name']}: receives posted early "
              f"{early * 1e3:.2f} ms/step, posted at use {lazy * 1e3:.2f} ms/step, gain {lazy / early:.3f} "
              f"(median of {steps} alternating steps each); "
              f"same loss in both modes: {row['losses_equal']}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="evals")
    parser.add_argument("--model", default=MODEL, help="a zoo spec (a smaller one smoke-tests the script on CPU ranks)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.plan import write_plan
    from graphpipe.runtime.launch import free_port

    from .bench_runtime import torch_comparable_plan

    os.makedirs(args.out, exist_ok=True)
    plan = torch_comparable_plan(args.model, zoo.load_graph(args.model), preset("h100", 2), args.batch_size)  # 2-stage chain
    path = os.path.join(args.out, "overlap-plan.json")
    write_plan(path, plan)
    mp.spawn(_rank, args=(free_port(), args.out, args.steps, args.batch_size, args.batch_size // 8, path, args.model), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
