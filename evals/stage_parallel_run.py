"""Throughput of one model on CPU ranks as a pipeline only, and with FSDP or tensor parallelism inside stages.

A chain of wide MLP blocks (Megatron column/row pairs) is cut into two stages of two ranks each, with three
layouts of the same four ranks: ``pp`` (each stage two whole-copy replicas, gradients all-reduced), ``pp-fsdp``
(each stage FSDP-sharded over its two ranks: ``fully_shard``, one unit per op resharded after forward, or
``pp-fsdp-step``: one unit gathered once per step) and ``pp-tp`` (each stage one TP 2 group: DTensor
parameters). All plans run in one set of processes (``run_plans``), interleaved ``--reps`` times; each row
is the median of the reps' median step times. Each rank's share of its stage's parameters is reported beside.

Usage::

    python -m graphpipe.evals.stage_parallel_run --out evals      # writes evals/results/stage-parallel-run.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch
import torch.nn as nn

__all__ = ["wide_mlp", "run", "main"]

WIDTH, BLOCKS, BATCH = 512, 4, 32
SPEC = f"{os.path.abspath(__file__)}:wide_mlp"
LAYOUTS = {"pp": (1, "none"), "pp-fsdp": (1, "fsdp"), "pp-fsdp-step": (1, "fsdp"), "pp-tp": (2, "none")}
"""Layout -> (tp, shard); ``pp-fsdp`` reshards after forward (one FSDP unit per op, gathered and reduce-scattered
per micro-batch), ``pp-fsdp-step`` gathers once per step (the planner's FSDP choice)."""


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def wide_mlp():
    """``BLOCKS`` residual MLP blocks of width ``WIDTH`` (4x hidden), a mean-square loss."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(WIDTH) for _ in range(BLOCKS)])
    return model, torch.randn(BATCH, WIDTH), lambda out: out.pow(2).mean()


def _plan(layout: str):
    from dataclasses import replace

    from graphpipe.cluster import preset
    from graphpipe.models import load_model
    from graphpipe.sched.generators import make_schedule
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan
    from graphpipe.stages import Stage, StageGraph

    source = load_model(SPEC)
    base = make_plan(source.model_id, source.graph, preset("v100", 4), BATCH, "gpipe",
                     SearchOptions(micro_batch_size=8))
    graph = base.stage_graph.graph
    half = len(graph.ops) // 2
    tp, shard = LAYOUTS[layout]
    stages = [Stage(i, tuple(range(i * half, (i + 1) * half if i == 0 else len(graph.ops))), (2 * i, 2 * i + 1), 8,
                    tp=tp, shard=shard, reshard_after_forward=layout != "pp-fsdp-step") for i in range(2)]
    sg = StageGraph.build(graph, stages, BATCH, 4)
    return replace(base, stage_graph=sg, schedule=make_schedule("1f1b", sg), predicted={}, strategy="custom")


def run(reps: int = 3, steps: int = 6) -> list[dict[str, Any]]:
    from graphpipe.runtime import RunOptions, run_plans

    plans = {name: _plan(name) for name in LAYOUTS}
    options = RunOptions(steps=steps, warmup_steps=2, num_threads=1)
    order = [name for _ in range(reps) for name in LAYOUTS]
    results = run_plans([(plans[name], options) for name in order])
    times: dict[str, list[float]] = {}
    for name, result in zip(order, results):
        times.setdefault(name, []).append(result.measured.iteration_time_s)
    params = sum(p.numel() for p in wide_mlp()[0].parameters())
    rows = []
    for name in LAYOUTS:
        med = statistics.median(times[name])
        tp, shard = LAYOUTS[name]
        rows.append({"layout": name, "tp": tp, "shard": shard, "iteration_s": med, "samples_per_s": BATCH / med,
                     "reps_s": times[name], "params_per_rank": params / 2 / (2 if name != "pp" else 1)})
    base = next(r for r in rows if r["layout"] == "pp")["iteration_s"]
    for r in rows:
        r["vs_pp"] = base / r["iteration_s"]
    return rows


def main(argv: list[str] | None = None) -> None:
    from graphpipe.evals.common import write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="evals")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    rows = run(args.reps, args.steps)
    for r in rows:
        print(f"{r['layout']:8s} {r['iteration_s'] * 1e3:8.1f} ms  {r['samples_per_s']:8.1f} samples/s  "
              f"x{r['vs_pp']:.2f} vs pp")
    print(write_result(args.out, "stage-parallel-run", {"model": "evals/stage_parallel_run.py:wide_mlp", "width": WIDTH, "blocks": BLOCKS, "batch": BATCH,
                                                   "reps": args.reps, "steps": args.steps, "ranks": 4}, rows))


if __name__ == "__main__":
    main()
