"""A real two-tower model: Hugging Face CLIP through gpp, PipeDream, Piper, GPipe and torch.distributed.pipelining.

::

    python -m graphpipe.evals.clip_pipelines --out evals              # writes OUT/results/clip.json and clip.png

(a) *Measured on CPU ranks.* The small CLIP (:func:`graphpipe.evals.clip_model.small`) is
profiled as a user would (``graphpipe profile``: op times at several
micro-batch sizes), planned by each strategy on ``--ranks`` CPU ranks of
this host (a link measured between local gloo processes, the ranks sharing
the host's cores: ``--host-cores``), and every plan runs on the same batch
with the same data. torch.distributed.pipelining is given a chain of the
same model: both towers' embeddings in stage 0 (torch feeds the inputs to
stage 0 only), the rest in topological order split evenly, 1F1B, each rank
one stage; where a later stage still reads a model input (CLIP's text layers
read the attention mask, its pooling the token ids) torch cannot run it, and
the row records torch's refusal.
All plans run in one set of processes, ``--reps`` times in turn; a plan's
figure is the median over reps of each run's median step. Beside each, the
simulator's prediction for the plan.

(b) *Paper scale, simulated.* CLIP ViT-B/16's shape (:func:`graphpipe.evals.clip_model.paper`)
planned by each strategy on 8 to 64 V100s (the paper's cluster preset) at a
batch of 32 per device: predicted throughput.

Benchmarks are not tests; figures go to REPORT.md through ``graphpipe eval``'s report.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

__all__ = ["measure_cpu", "simulate_paper", "main", "STRATEGIES"]

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = os.path.join(HERE, "clip_model.py") + ":small"
PAPER = os.path.join(HERE, "clip_model.py") + ":paper"
STRATEGIES = ("gpp", "pipedream", "piper", "gpipe")


def torch_chain(graph, cluster, batch_size: int, micro_batch_size: int):
    """The chain torch.distributed.pipelining can run: every source op (the towers' embeddings) in stage 0, the
    other ops in id order (topological) cut into equal runs, one stage per device, 1F1B."""
    from graphpipe.plan import Plan
    from graphpipe.sched import make_schedule
    from graphpipe.stages import Stage, StageGraph

    sources = [i for i in range(graph.num_ops) if not graph.preds(i)]
    rest = [i for i in range(graph.num_ops) if i not in sources]
    k = cluster.num_devices - 1
    runs = [rest[round(i * len(rest) / k):round((i + 1) * len(rest) / k)] for i in range(k)]
    stages = [Stage(i, tuple(ops), (i,), micro_batch_size) for i, ops in enumerate([sources, *runs])]
    sg = StageGraph.build(graph, stages, batch_size, cluster.num_devices, sequential=True)
    return Plan(model=SMALL, stage_graph=sg, cluster=cluster, strategy="torch-chain",
                schedule=make_schedule("1f1b", sg, cluster))


def measure_cpu(ranks: int = 4, batch_size: int = 16, steps: int = 6, reps: int = 3,
                host_cores: int | None = None) -> list[dict[str, Any]]:
    """(a): per strategy (and torch's chain), measured median step and the simulator's prediction."""
    from graphpipe.cluster import cluster_from_dict
    from graphpipe.models import load_model
    from graphpipe.frontend.profile import apply_profile, profile_model
    from graphpipe.errors import GraphpipeError
    from graphpipe.runtime import RunOptions, preflight, run_plans
    from graphpipe.sched import SharedHost, predicted_figures, simulate
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    from . import bench_runtime as br

    import torch

    host = SharedHost.cores(host_cores or len(os.sched_getaffinity(0)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:  # a median of 7 timings per op and size: this host is shared, single timings jump
        profile = profile_model(SMALL, "cpu", batch_sizes=(2, 4, 8, 16), repeats=7)
    finally:
        torch.set_num_threads(threads)
    graph = apply_profile(load_model(SMALL).graph, profile)
    cluster = cluster_from_dict(br.cpu_cluster_doc(br.measure_link(ranks=ranks, repeats=5), ranks))
    plans = {s: make_plan(SMALL, graph, cluster, batch_size, s, SearchOptions(host=host)) for s in STRATEGIES}
    refused = {}
    try:  # torch feeds the inputs to stage 0 only; a model whose later layers read them cannot run there
        chain = torch_chain(graph, cluster, batch_size, batch_size // 4)
        preflight(chain, RunOptions(baseline="torch"))
        plans["torch"] = chain
    except GraphpipeError as exc:
        refused["torch"] = str(exc).splitlines()[0]
    names = list(plans)
    runs: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(reps):
        results = run_plans([(plans[n], RunOptions(steps=steps, warmup_steps=1, timeout_s=300,
                                                   baseline="torch" if n == "torch" else None)) for n in names],
                            ranks)
        for n, res in zip(names, results):
            runs[n].append(res.measured.iteration_time_s)
    rows = []
    for n in names:
        plan = plans[n]
        predicted = (predicted_figures(simulate(plan.stage_graph, plan.schedule, plan.cluster, host=host))
                     if n == "torch" else plan.predicted)
        measured = statistics.median(runs[n])
        sg = plan.stage_graph
        rows.append({"part": "cpu", "strategy": n, "devices": len(sg.devices_used()), "stages": sg.num_stages,
                     "depth": sg.depth(), "micro_batch": max(s.micro_batch_size for s in sg.stages),
                     "batch_size": batch_size, "measured_s": measured, "measured_runs_s": runs[n],
                     "measured_throughput": batch_size / measured,
                     "predicted_s": predicted["iteration_time_s"],
                     "predicted_throughput": batch_size / predicted["iteration_time_s"]})
    rows += [{"part": "cpu", "strategy": n, "batch_size": batch_size, "error": why} for n, why in refused.items()]
    return rows


def simulate_paper(device_counts=(8, 16, 32, 64), per_device_batch: int = 32) -> list[dict[str, Any]]:
    """(b): per device count and strategy, the planner's predicted throughput (or its one-line refusal)."""
    from graphpipe.cluster import preset
    from graphpipe.errors import GraphpipeError
    from graphpipe.models import load_model
    from graphpipe.search.planner import make_plan

    graph = load_model(PAPER).graph
    rows = []
    for n in device_counts:
        for s in STRATEGIES:
            row: dict[str, Any] = {"part": "paper", "strategy": s, "devices": n, "batch_size": per_device_batch * n}
            try:
                plan = make_plan(PAPER, graph, preset("v100", n), per_device_batch * n, s)
                row.update(predicted_throughput=plan.predicted["throughput"], stages=plan.stage_graph.num_stages,
                           depth=plan.stage_graph.depth(), devices_used=len(plan.stage_graph.devices_used()))
            except GraphpipeError as exc:
                row["error"] = str(exc).splitlines()[0]
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cpu = [r for r in rows if r["part"] == "cpu" and "error" not in r]
    xs = range(len(cpu))
    left.bar([x - 0.2 for x in xs], [r["measured_throughput"] for r in cpu], 0.4, label="measured")
    left.bar([x + 0.2 for x in xs], [r["predicted_throughput"] for r in cpu], 0.4, label="simulated")
    left.set_xticks(list(xs), [r["strategy"] for r in cpu])
    left.set_ylabel("samples / s")
    left.set_title(f"small CLIP, {cpu[0]['batch_size']} samples per step, CPU ranks" if cpu else "")
    left.legend()
    paper = [r for r in rows if r["part"] == "paper" and "predicted_throughput" in r]
    for s in STRATEGIES:
        pts = [(r["devices"], r["predicted_throughput"]) for r in paper if r["strategy"] == s]
        if pts:
            right.plot(*zip(*pts), marker="o", label=s)
    right.set_xscale("log", base=2)
    right.set_xlabel("V100s (simulated)")
    right.set_ylabel("samples / s")
    right.set_title("CLIP ViT-B/16 shape, 32 samples per device")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from .common import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="evals")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--host-cores", type=int, default=None)
    args = p.parse_args(argv)
    rows = measure_cpu(args.ranks, args.batch_size, args.steps, args.reps, args.host_cores) + simulate_paper()
    config = {"ranks": args.ranks, "batch_size": args.batch_size, "steps": args.steps, "reps": args.reps,
              "host_cores": args.host_cores or len(os.sched_getaffinity(0)), "paper_devices": [8, 16, 32, 64],
              "paper_per_device_batch": 32}
    write_result(args.out, "clip", config, rows)
    plot(rows, os.path.join(args.out, "clip.png"))
    for r in rows:
        print({k: v for k, v in r.items() if k != "measured_runs_s"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
