"""Steps of varying length on CPU ranks against padding every batch to the longest, and the cost of the shapes.

A token model (an embedding, a position table, residual MLP blocks applied per token, a per-token head) is cut
into two stages on two CPU ranks. Each step draws its length in ``LO..HI`` (``graphpipe run --vary-shapes``,
from the seed, so both runs see the same lengths): ``varying`` runs every step at its own length, ``padded``
pads every batch to ``HI`` (what a runtime that takes one shape must do). Both runs are timed in one set of
processes, interleaved ``--reps`` times; the figure is the time per real token (the timed steps' time over the
tokens they hold before padding), each rep's, then the median. The shape handling each rank does per step is
timed on its own in this process: binding the step's sizes from its inputs and refusing what the model
cannot take (every step), and sizing every value crossing the cut plus the routing of a partial batch (once
per new size, then cached).

Usage::

    python -m graphpipe.evals.varying_shapes --out evals      # writes evals/results/varying-shapes.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.nn as nn

__all__ = ["token_model", "run", "shape_cost", "main"]

VOCAB, WIDTH, BLOCKS, BATCH, LO, HI = 512, 256, 4, 16, 16, 128
SPEC = f"{os.path.abspath(__file__)}:token_model"


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(HI, WIDTH)
        self.blocks = nn.Sequential(*[_Block(WIDTH) for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))))


def token_model():
    """The model, a batch at the longest length, next-token cross-entropy and its labels."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, HI))

    def loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    return TokenModel(), ids, loss, torch.randint(0, VOCAB, (BATCH, HI))


def _plan():
    from dataclasses import replace

    from graphpipe.cluster import preset
    from graphpipe.models import load_model
    from graphpipe.sched.generators import make_schedule
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan
    from graphpipe.stages import Stage, StageGraph

    source = load_model(SPEC)
    base = make_plan(source.model_id, source.graph, preset("cpu", 2), BATCH, "gpipe",
                     SearchOptions(micro_batch_size=4))
    graph = base.stage_graph.graph
    half = len(graph.ops) // 2
    stages = [Stage(0, tuple(range(half)), (0,), 4), Stage(1, tuple(range(half, len(graph.ops))), (1,), 4)]
    sg = StageGraph.build(graph, stages, BATCH, 2)
    return replace(base, stage_graph=sg, schedule=make_schedule("1f1b", sg), predicted={}, strategy="custom")


def _lengths(seed: int, steps: int, warmup: int) -> list[int]:
    """The timed steps' drawn lengths (the batch symbol and the one length, as the run draws them)."""
    from graphpipe.frontend.shapes import ShapeDraw

    draw = ShapeDraw.parse(f"{LO}:{HI}")
    return [draw.sizes(seed, k, "b", ("len",), BATCH)["len"] for k in range(warmup, steps)]


def run(reps: int = 3, steps: int = 10, warmup: int = 2) -> list[dict[str, Any]]:
    from graphpipe.runtime import RunOptions, run_plans

    plan = _plan()
    modes = {"varying": f"{LO}:{HI}", "padded": f"{HI}:{HI}"}
    order = [m for _ in range(reps) for m in modes]
    results = run_plans([(plan, RunOptions(steps=steps, warmup_steps=warmup, num_threads=1,
                                           vary_shapes=modes[m], measure=False)) for m in order])
    tokens = BATCH * sum(_lengths(0, steps, warmup))  # real tokens of the timed steps, the same in both runs
    per: dict[str, list[float]] = {}
    for mode, result in zip(order, results):
        per.setdefault(mode, []).append(sum(result.measured.step_times_s) / tokens)
    rows = [{"mode": m, "us_per_token": statistics.median(v) * 1e6, "reps_us_per_token": [x * 1e6 for x in v],
             "tokens": tokens} for m, v in per.items()]
    padded = next(r for r in rows if r["mode"] == "padded")["us_per_token"]
    for r in rows:
        r["padded_over_this"] = padded / r["us_per_token"]
    return rows


def shape_cost(repeats: int = 200) -> dict[str, float]:
    """Microseconds of the per-step shape work on this model's capture, each a median of ``repeats``."""
    from graphpipe.runtime.routing import Routing
    from graphpipe.runtime.runnable import load_runnable
    from graphpipe.runtime.setup import _edge_values
    from graphpipe.frontend.shapes import ShapeRules
    from graphpipe.runtime.stage_modules import boundary_meta, split_model

    plan = _plan()
    r = load_runnable(SPEC, 0, "cpu")
    split = split_model(r.gm, r.op_nodes, plan.stage_graph)
    meta = boundary_meta(r.gm, split.boundary_values, r.make_inputs, "fp32")
    rules = ShapeRules(r.gm)
    edges = _edge_values(split)
    routing = Routing(plan.stage_graph, plan.schedule, edges, [v for v in meta if meta[v].needs_grad])
    flat = r.make_inputs(BATCH, 0)

    def median_us(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    bindings = rules.bind(flat).bindings
    return {"bind_us": median_us(lambda: rules.bind(flat)),
            "size_values_us": median_us(lambda: {v: m.at(bindings) for v, m in meta.items()}),
            "partial_routing_us": median_us(lambda: routing.at_rows(BATCH - 3)),
            "boundary_values": len(meta)}


def main(argv: list[str] | None = None) -> None:
    from graphpipe.evals.common import write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="evals")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    rows = run(args.reps, args.steps)
    cost = shape_cost()
    for r in rows:
        print(f"{r['mode']:8s} {r['us_per_token']:8.2f} us/token  padded/this x{r['padded_over_this']:.2f}")
    print(f"shape work per step: bind {cost['bind_us']:.1f} us, size {cost['boundary_values']} values "
          f"{cost['size_values_us']:.1f} us (new size), partial routing {cost['partial_routing_us']:.1f} us (new rows)")
    print(write_result(args.out, "varying-shapes", {"model": "evals/varying_shapes.py:token_model", "width": WIDTH,
                                                    "blocks": BLOCKS, "batch": BATCH, "lengths": [LO, HI],
                                                    "reps": args.reps, "steps": args.steps, "ranks": 2},
                       rows, summary=cost))


if __name__ == "__main__":
    main()
