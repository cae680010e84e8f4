"""Benchmark of the schedule simulator: 32 stages x 256 micro-batches (median of 5 runs).

Usage::

    python -m graphpipe.evals.bench_simulator            # prints one JSON object
    python -m graphpipe.evals.bench_simulator --stages 64 --micro-batches 512 --repeats 7

Cases, each on a V100 preset cluster with one device per stage:

* ``chain-1f1b``: a 32-stage chain, 1F1B (the task's reference case);
* ``chain-gpipe``: the same chain, fill-drain;
* ``branches-graph-1f1b``: 4 parallel branches of 8 stages, graph-1F1B;
* ``chain-interleaved``: 8 devices x 4 virtual stages, interleaved 1F1B.

For each: median seconds of ``simulate`` (which includes the structural
checks), of ``validate_schedule`` (structure + zero-time deadlock check),
and of generating the schedule, plus the number of actions. The
environment (versions, git SHA) is printed beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys

from .common import environment, median_time
from graphpipe.cluster import preset
from graphpipe.graph import Affine, Op, OpGraph
from graphpipe.sched import make_schedule, round_robin_chain, simulate, validate_schedule
from graphpipe.stages import Stage, StageGraph

__all__ = ["main", "run"]


def _op(name: str) -> Op:
    # ~1 ms forward per sample, backward twice that; 4 MB of parameters, 100 kB saved per sample.
    return Op(name, "layer", Affine(2e-5, 1e-3), Affine(4e-5, 2e-3), 4e6, 1e5, 1e4)


def _chain(num_stages: int, micro_batches: int) -> StageGraph:
    g = OpGraph.build("chain", [_op(f"l{i}") for i in range(num_stages)],
                      [(f"l{i}", f"l{i + 1}", 1e4) for i in range(num_stages - 1)])
    return StageGraph.build(g, [Stage(i, (i,), (i,), 1) for i in range(num_stages)], micro_batches, num_stages)


def _branches(num_stages: int, micro_batches: int, num_branches: int = 4) -> StageGraph:
    depth = max(1, (num_stages - 2) // num_branches)
    ops, edges = [_op("in")], []
    for b in range(num_branches):
        prev = "in"
        for j in range(depth):
            ops.append(_op(f"b{b}_{j}"))
            edges.append((prev, f"b{b}_{j}", 1e4))
            prev = f"b{b}_{j}"
        edges.append((prev, "out", 1e4))
    ops.append(_op("out"))
    g = OpGraph.build("branches", ops, edges)
    return StageGraph.build(g, [Stage(i, (i,), (i,), 1) for i in range(g.num_ops)], micro_batches, g.num_ops)


def run(num_stages: int = 32, micro_batches: int = 256, repeats: int = 5) -> dict:
    cases = {
        "chain-1f1b": (_chain(num_stages, micro_batches), "1f1b"),
        "chain-gpipe": (_chain(num_stages, micro_batches), "gpipe"),
        "branches-graph-1f1b": (_branches(num_stages, micro_batches), "graph-1f1b"),
    }
    virtual = 4 if num_stages % 4 == 0 else 1
    g = OpGraph.build("chain", [_op(f"l{i}") for i in range(num_stages)],
                      [(f"l{i}", f"l{i + 1}", 1e4) for i in range(num_stages - 1)])
    cases["chain-interleaved"] = (round_robin_chain(g, num_stages // virtual, virtual, micro_batches, 1), "interleaved")
    rows = []
    for label, (sg, name) in cases.items():
        cluster = preset("v100", sg.num_devices)
        gen_s, schedule = median_time(lambda: make_schedule(name, sg, cluster), repeats)
        sim_s, timeline = median_time(lambda: simulate(sg, schedule, cluster), repeats)
        val_s, _ = median_time(lambda: validate_schedule(sg, schedule), repeats)
        rows.append({"case": label, "schedule": name, "stages": sg.num_stages, "devices": sg.num_devices,
                     "micro_batches": sg.num_micro_batches(0),
                     "actions": sum(len(a) for a in schedule.device_actions),
                     "simulate_s": sim_s, "validate_s": val_s, "make_schedule_s": gen_s,
                     "iteration_time_s": timeline.iteration_time_s})
    return {"benchmark": "simulator", "config": {"stages": num_stages, "micro_batches": micro_batches,
                                                  "repeats": repeats, "statistic": "median"},
            "rows": rows, "environment": environment()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphpipe.evals.bench_simulator", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.stages < 2 or args.micro_batches < 1 or args.repeats < 1:
        parser.error("--stages >= 2, --micro-batches >= 1 and --repeats >= 1")
    json.dump(run(args.stages, args.micro_batches, args.repeats), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
