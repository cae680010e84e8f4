"""Training-step speed of ``graphpipe.Pipeline`` against a plain PyTorch loop, side by side in one process.

::

    python -m graphpipe.evals.bench_api                                  # CPU (or the GPU when there is one), fp32
    python -m graphpipe.evals.bench_api --precision bf16 --out evals     # writes OUT/results/bench_api-bf16.json

    python -m graphpipe.evals.bench_api --ranks 4 --schedules 1f1b,zb-h1 --out evals   # vs torch's runtime, 4 CPU ranks

One rank, one stage (a gpipe plan of the zoo model on one device, fixed micro-batch size): the API's step
(forward and backward over the micro-batches, then AdamW) against the loop a user would write for the same
micro-batching (each micro-batch's loss scaled by its share of the mini-batch, backward, one AdamW step), with
one autocast region per step at bf16 in both. The two alternate step by step after warm-up; the figure is the
ratio of median step times (API throughput / loop throughput; 1.0 is parity). Benchmarks are not tests.

``--ranks N``: our runtime as the API trains (no per-action synchronisation, no memory meter:
``RunOptions(measure=False)``) against ``torch.distributed.pipelining``'s ``Schedule1F1B`` on the same even
chain of ``bench_runtime``'s transformer (one stage per rank, 8 micro-batches, the same data), on N gloo ranks
of this host pinned to CPUs of their own. The jobs alternate in one world; the figure is the median over
rounds of each round's throughput ratio (ours / torch), as ``bench_runtime`` (c). ``--schedules``: other
schedules (``zb-h1``...) are written as torch's CSV and read back, so both runtimes execute the same file
(torch's ``_PipelineScheduleRuntime``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

__all__ = ["run", "main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(model: str = "transformer:small", batch_size: int = 32, micro_batch_size: int = 8, steps: int = 20,
        warmup: int = 3, precision: str = "fp32") -> dict:
    """Median step seconds of the API and of the plain loop, and their throughput ratio."""
    import torch
    import torch.distributed as dist

    from graphpipe import zoo
    from graphpipe.cluster import preset
    from graphpipe.runtime.api import Pipeline
    from graphpipe.runtime.jobs import autocast
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    plan = make_plan(zoo.canonical_spec(model), zoo.load_graph(model), preset("v100", 1), batch_size, "gpipe",
                     SearchOptions(micro_batch_size=micro_batch_size, recompute="none"))
    built = zoo.build(model, seed=0)
    pipe = Pipeline(plan, built.module, built.loss_fn, precision=precision)
    device = pipe.device
    reference = zoo.build(model, seed=0).module.to(device)
    reference.load_state_dict(built.module.state_dict())
    opt_api = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    opt_loop = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    inputs = built.make_inputs(batch_size, 0)
    on_device = tuple(x.to(device) for x in inputs)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def api_step() -> float:
        sync()
        t0 = time.perf_counter()
        pipe.step(inputs)
        opt_api.step()
        opt_api.zero_grad()
        sync()
        return time.perf_counter() - t0

    def loop_step() -> float:
        sync()
        t0 = time.perf_counter()
        with autocast(precision, device):
            for lo in range(0, batch_size, micro_batch_size):
                mb = tuple(x[lo:lo + micro_batch_size] for x in on_device)
                loss = built.loss_fn(reference(*mb)) * (micro_batch_size / batch_size)
                loss.backward()
        opt_loop.step()
        opt_loop.zero_grad()
        sync()
        return time.perf_counter() - t0

    times = {"api": [], "loop": []}
    for i in range(warmup + steps):
        for name, fn in (("api", api_step), ("loop", loop_step)) if i % 2 == 0 else (("loop", loop_step), ("api", api_step)):
            t = fn()
            if i >= warmup:
                times[name].append(t)
    api, loop = statistics.median(times["api"]), statistics.median(times["loop"])
    dist.destroy_process_group()
    return {"model": model, "batch_size": batch_size, "micro_batch_size": micro_batch_size, "precision": precision,
            "device": str(device), "steps": steps, "api_step_s": api, "loop_step_s": loop,
            "throughput_ratio": loop / api}


def vs_torch(ranks: int = 2, rounds: int = 5, steps: int = 8, batch_size: int = 32,
             schedules: tuple[str, ...] = ("1f1b",)) -> list[dict]:
    """Throughput of our runtime (the API's path) over torch.distributed.pipelining's on ``ranks`` CPU ranks, one
    row per schedule: ``1f1b`` runs torch's ``Schedule1F1B`` class; any other schedule is written as torch's CSV
    and read back, so our executor and torch's ``_PipelineScheduleRuntime`` run the same file."""
    import tempfile

    from graphpipe import zoo
    from graphpipe.cluster import preset
    from graphpipe.runtime import RunOptions, run_plans
    from graphpipe.sched import make_schedule
    from graphpipe.sched.torch_csv import plan_with_torch_csv, write_torch_csv

    from .bench_runtime import GPT, auto_cpus_per_rank, torch_comparable_plan

    base = torch_comparable_plan(GPT, zoo.load_graph(GPT), preset("v100", ranks), batch_size)
    pin = auto_cpus_per_rank(ranks)
    common = dict(steps=steps, warmup_steps=2, timeout_s=300, cpus_per_rank=pin)
    plans = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in schedules:
            if name == "1f1b":
                plans[name] = base
                continue
            path = os.path.join(tmp, f"{name}.csv")
            write_torch_csv(path, base.stage_graph, make_schedule(name, base.stage_graph, base.cluster))
            plans[name] = plan_with_torch_csv(base, path)
    jobs = []
    for _ in range(rounds):
        for name in schedules:
            jobs += [(plans[name], RunOptions(**common, measure=False)),
                     (plans[name], RunOptions(**common, baseline="torch"))]
    results = run_plans(jobs, ranks)
    rows = []
    for i, name in enumerate(schedules):
        mine = results[2 * i::2 * len(schedules)]
        theirs = results[2 * i + 1::2 * len(schedules)]
        ours = [r["measured"]["iteration_time_s"] for r in mine]
        torch_s = [r["measured"]["iteration_time_s"] for r in theirs]
        rows.append({"model": GPT, "ranks": ranks, "batch_size": batch_size, "micro_batch_size": batch_size // 8,
                     "schedule": name, "torch_runs": theirs[0]["baseline"], "cpus_per_rank": pin, "rounds": rounds,
                     "steps": steps, "ours_iteration_s": ours, "torch_iteration_s": torch_s,
                     "ours_median_ms": statistics.median(ours) * 1e3, "torch_median_ms": statistics.median(torch_s) * 1e3,
                     "throughput_ratio": statistics.median(t / o for o, t in zip(ours, torch_s))})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer:small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--ranks", type=int, default=0,
                        help="compare with torch.distributed.pipelining on this many CPU ranks instead")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schedules", default="1f1b",
                        help="with --ranks: comma-separated schedules; 1f1b runs torch's Schedule1F1B, others "
                             "(zb-h1, gpipe...) run from the same CSV in both runtimes")
    parser.add_argument("--out", default=None, help="write OUT/results/bench_api[-bf16|-torch].json")
    args = parser.parse_args(argv)
    import torch

    if args.ranks:
        rows = vs_torch(args.ranks, args.rounds, args.steps, schedules=tuple(args.schedules.split(",")))
        for r in rows:
            print(f"{r['model']} on {args.ranks} CPU ranks, {r['schedule']} ({r['torch_runs']}): ours/torch "
                  f"throughput {r['throughput_ratio']:.3f} (median of {args.rounds} rounds)")
        if args.out:
            from .common import write_result

            summary = {f"throughput_ratio_{r['schedule']}": r["throughput_ratio"] for r in rows}
            config = {**vars(args), "model": rows[0]["model"], "batch_size": rows[0]["batch_size"],
                      "micro_batch_size": rows[0]["micro_batch_size"]}  # what ran (bench_runtime's chain)
            print(f"wrote {write_result(args.out, 'bench_api-torch', config, rows, summary)}")
        return 0

    torch.set_num_threads(1)
    result = run(args.model, args.batch_size, args.micro_batch_size, args.steps, precision=args.precision)
    print(f"{result['model']} batch {result['batch_size']} micro-batch {result['micro_batch_size']} "
          f"{result['precision']} on {result['device']}: API {result['api_step_s'] * 1e3:.2f} ms/step, plain loop "
          f"{result['loop_step_s'] * 1e3:.2f} ms/step, throughput ratio {result['throughput_ratio']:.3f}")
    if args.out:
        from .common import write_result

        name = "bench_api" if args.precision == "fp32" else f"bench_api-{args.precision}"
        print(f"wrote {write_result(args.out, name, vars(args), [result], {'throughput_ratio': result['throughput_ratio']})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
