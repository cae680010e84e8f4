"""Do checkpoint segments lower real memory? Peak RSS of one forward + backward, outside graphpipe's meter.

The whole model runs as one stage (a data-parallel stage with one
micro-batch in flight) in a fresh process per mode: no re-materialization,
whole-stage re-materialization (one ``torch.utils.checkpoint``), and the
segments :func:`graphpipe.costs.best_checkpoints` places (one checkpoint
each). Each process pre-allocates the gradients, then reports how far its
peak resident set grew over the step (``ru_maxrss``), beside the
activation bytes the cost model predicts for the mode. RSS also holds the
backward's transient buffers and the allocator's slack, so compare modes
with each other, not with the model, and use large activations.

Usage::

    python -m graphpipe.evals.segments_rss "twobranch:small,hidden=512,seq=64,ffn=2048" --batch-size 64
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys

MODES = ("none", "all", "segments")


def measure(spec: str, batch_size: int, mode: str) -> dict:
    """In this process: RSS growth over one F+B of ``spec`` as one stage in ``mode``, and the model's bytes."""
    import torch
    import torch.utils.checkpoint as cp

    from graphpipe import costs

    from graphpipe.frontend import zoo
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.stage_modules import split_model
    from graphpipe.stages import Stage, StageGraph

    torch.set_num_threads(1)
    runnable = load_runnable(spec, seed=0)
    graph = zoo.load_graph(spec)
    ops = tuple(range(graph.num_ops))
    cuts = costs.best_checkpoints(graph, ops, 0.0, 1) if mode == "segments" else ()
    sg = StageGraph.build(graph, [Stage(0, ops, (0,), batch_size, recompute=mode != "none", checkpoints=cuts)],
                          batch_size, 1)
    prog = split_model(runnable.gm, runnable.op_nodes, sg).programs[0]
    inputs = runnable.make_inputs(batch_size, 3)
    args = [inputs[dict(prog.model_inputs)[n]] for n in prog.input_names]

    def loss_of(out):
        return (out.float() ** 2).mean()

    def whole(*xs):
        return loss_of(prog.module(*xs)[1])

    def in_segments(*xs):
        env = dict(zip(prog.input_names, xs))
        for seg in prog.segments:
            got = cp.checkpoint(seg.module, *(env[n] for n in seg.input_names), use_reentrant=False)
            env.update(zip(seg.output_names, got))
        return loss_of(prog.assemble(*(env[n] for n in prog.gathers))[1])

    for p in prog.module.parameters():  # gradients are model state, not activations
        p.grad = torch.zeros_like(p)
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "none":
        loss = whole(*args)
    elif mode == "all":
        loss = cp.checkpoint(whole, *args, use_reentrant=False)
    else:
        loss = in_segments(*args)
    loss.backward()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024  # ru_maxrss is in KiB on Linux
    if mode == "none":
        stash, working = costs.stage_sums(graph, ops).act, 0.0
    else:
        stash, working = costs.segment_bytes(graph, ops, cuts, 0.0)
    return {"mode": mode, "segments": len(cuts) + 1 if mode != "none" else 0, "rss_growth_bytes": grown,
            "model_bytes": (stash + working) * batch_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # the child's own run
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(measure(args.model, args.batch_size, args.mode)))
        return 0
    print(f"{args.model}, batch {args.batch_size}, one stage, one micro-batch in flight")
    print(f"{'mode':<10} {'segments':>8} {'RSS growth MB':>14} {'model MB':>9}")
    for mode in MODES:
        out = subprocess.run([sys.executable, "-m", "graphpipe.evals.segments_rss", args.model,
                              "--batch-size", str(args.batch_size), "--mode", mode],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{mode:<10} {row['segments']:>8} {row['rss_growth_bytes'] / 2**20:>14.1f} "
              f"{row['model_bytes'] / 2**20:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
