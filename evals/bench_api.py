"""Training-step speed of ``graphpipe.Pipeline`` against a plain PyTorch loop, side by side in one process.

::

    python -m graphpipe.evals.bench_api                                  # CPU (or the GPU when there is one), fp32
    python -m graphpipe.evals.bench_api --precision bf16 --out evals     # writes OUT/results/bench_api-bf16.json

    python -m graphpipe.evals.bench_api --ranks 4 --schedules 1f1b,zb-h1 --out evals   # vs torch's runtime, 4 CPU ranks

``--compile``: four contestants side by side, the API eager and compiled (``Pipeline(..., compile=True)``)
and the plain loop eager and compiled (``torch.compile`` of the model, inductor); ratios compiled API over
compiled loop, over eager API and over eager loop (medians of alternating steps after warm-up, which
includes the compilations).

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
import statistics
import sys
import time

__all__ = ["run", "main", "one_rank_plan", "api_step_of", "loop_step_of"]


def one_rank_plan(model: str, batch_size: int, micro_batch_size: int):
    """The one-rank gpipe plan of zoo ``model`` at a fixed micro-batch size (one stage, one device), with the
    environment of a one-process world set unless a process group exists."""
    import torch
    import torch.distributed as dist

    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.runtime.launch import free_port
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    cluster = preset("h100" if torch.cuda.is_available() else "v100", 1)  # paper-size mmt overflows one V100
    return make_plan(zoo.canonical_spec(model), zoo.load_graph(model), cluster, batch_size, "gpipe",
                     SearchOptions(micro_batch_size=micro_batch_size, recompute="none"))


def api_step_of(pipe, opt):
    """One training step through the API: ``pipe.step`` on the mini-batch, then the optimizer."""
    def api_step(x) -> None:
        pipe.step(x)
        opt.step()
        opt.zero_grad()
    return api_step


def loop_step_of(module, opt, loss_fn, batch_size: int, micro_batch_size: int, precision: str, device):
    """The plain loop a user would write around ``module`` (eager or compiled): each micro-batch's loss scaled by
    its share of the mini-batch, backward, one optimizer step, under one autocast region at bf16."""
    from graphpipe.runtime.runnable import autocast

    def loop_step(x) -> None:
        with autocast(precision, device):
            for lo in range(0, batch_size, micro_batch_size):
                mb = tuple(t[lo:lo + micro_batch_size] for t in x)
                loss = loss_fn(module(*mb)) * (micro_batch_size / batch_size)
                loss.backward()
        opt.step()
        opt.zero_grad()
    return loop_step


def run(model: str = "transformer:small", batch_size: int = 32, micro_batch_size: int = 8, steps: int = 20,
        warmup: int = 3, precision: str = "fp32", with_torch: bool = True, compile: bool = False) -> dict:
    """Median step seconds of the API, the plain loop and (``with_torch``) torch.distributed.pipelining's
    ``ScheduleGPipe`` with one stage, and the throughput ratios API/loop and API/torch. ``compile``: also the
    API and the loop compiled by ``torch.compile`` (module docstring)."""
    import torch
    import torch.distributed as dist

    from graphpipe.frontend import zoo
    from graphpipe.runtime.api import Pipeline

    plan = one_rank_plan(model, batch_size, micro_batch_size)
    built = zoo.build(model, seed=0)
    pipe = Pipeline(plan, built.module, built.loss_fn, precision=precision)
    device = pipe.device
    reference = zoo.build(model, seed=0).module.to(device)
    reference.load_state_dict(built.module.state_dict())
    opt_api = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    opt_loop = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    on_device = tuple(x.to(device) for x in built.make_inputs(batch_size, 0))  # time the step, not the copy

    def loop_of(module, opt):
        return loop_step_of(module, opt, built.loss_fn, batch_size, micro_batch_size, precision, device)

    api_step, loop_step = api_step_of(pipe, opt_api), loop_of(reference, opt_loop)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn):
        def step() -> float:
            sync()
            t0 = time.perf_counter()
            fn(on_device)
            sync()
            return time.perf_counter() - t0
        return step

    contestants = [("api", timed(api_step)), ("loop", timed(loop_step))]
    if compile:
        built_c = zoo.build(model, seed=0)
        built_c.module.load_state_dict(built.module.state_dict())
        pipe_c = Pipeline(plan, built_c.module, built_c.loss_fn, precision=precision, compile=True)
        opt_api_c = torch.optim.AdamW(pipe_c.parameters(), lr=1e-4)
        plain = zoo.build(model, seed=0).module.to(device)
        plain.load_state_dict(built.module.state_dict())
        loop_compiled = loop_of(torch.compile(plain), torch.optim.AdamW(plain.parameters(), lr=1e-4))
        contestants += [("api_compiled", timed(api_step_of(pipe_c, opt_api_c))), ("loop_compiled", timed(loop_compiled))]
    if with_torch:
        contestants.append(("torch", timed(_torch_one_stage(built, device, batch_size // micro_batch_size,
                                                            precision, batch_size))))
    times = {name: [] for name, _ in contestants}
    for i in range(warmup + steps):
        for name, fn in contestants[i % len(contestants):] + contestants[:i % len(contestants)]:  # rotate the order
            t = fn()
            if i >= warmup:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    dist.destroy_process_group()
    result = {"model": model, "batch_size": batch_size, "micro_batch_size": micro_batch_size, "precision": precision,
              "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch_version": torch.__version__, "steps": steps, "api_step_s": med["api"], "loop_step_s": med["loop"],
              "api_samples_per_s": batch_size / med["api"], "loop_samples_per_s": batch_size / med["loop"],
              "throughput_ratio": med["loop"] / med["api"]}
    if compile:
        result.update(api_compiled_step_s=med["api_compiled"], loop_compiled_step_s=med["loop_compiled"],
                      compiled_api_vs_compiled_loop=med["loop_compiled"] / med["api_compiled"],
                      compiled_api_vs_eager_api=med["api"] / med["api_compiled"],
                      compiled_api_vs_eager_loop=med["loop"] / med["api_compiled"])
    if "torch" in med:
        result.update(torch_step_s=med["torch"], torch_samples_per_s=batch_size / med["torch"],
                      throughput_ratio_vs_torch=med["torch"] / med["api"])
    return result


def _torch_one_stage(built, device, num_mbs: int, precision: str, batch_size: int):
    """One step of torch.distributed.pipelining's ``ScheduleGPipe`` with the whole model as its one stage (a
    third copy of the same weights) and AdamW: the runtime a torch user would reach for, on the same GPU."""
    import torch
    from torch.distributed import pipelining as pp

    from graphpipe.frontend import zoo
    from graphpipe.runtime.runnable import autocast

    module = zoo.build(built.name, seed=0).module.to(device)
    module.load_state_dict(built.module.state_dict())
    stage = pp.PipelineStage(module, 0, 1, device)
    schedule = pp.ScheduleGPipe(stage, num_mbs, loss_fn=lambda out, target: built.loss_fn(out), scale_grads=True)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    target = torch.zeros(batch_size, device=device)  # torch's last stage insists on a target; the loss ignores it

    def step(on_device) -> None:
        with autocast(precision, device):
            schedule.step(*on_device, target=target)
        opt.step()
        opt.zero_grad()
    return step


def vs_torch(ranks: int = 2, rounds: int = 5, steps: int = 8, batch_size: int = 32,
             schedules: tuple[str, ...] = ("1f1b",)) -> list[dict]:
    """Throughput of our runtime (the API's path) over torch.distributed.pipelining's on ``ranks`` CPU ranks, one
    row per schedule: ``1f1b`` runs torch's ``Schedule1F1B`` class; any other schedule is written as torch's CSV
    and read back, so our executor and torch's ``_PipelineScheduleRuntime`` run the same file."""
    import tempfile

    from graphpipe.frontend import zoo
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
        ours = [r.measured.iteration_time_s for r in mine]
        torch_s = [r.measured.iteration_time_s for r in theirs]
        rows.append({"model": GPT, "ranks": ranks, "batch_size": batch_size, "micro_batch_size": batch_size // 8,
                     "schedule": name, "torch_runs": theirs[0].baseline, "cpus_per_rank": pin, "rounds": rounds,
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
    parser.add_argument("--no-torch", action="store_true",
                        help="one-rank mode: leave out torch.distributed.pipelining's one-stage ScheduleGPipe")
    parser.add_argument("--compile", action="store_true",
                        help="one-rank mode: add the API and the plain loop compiled by torch.compile")
    parser.add_argument("--warmup", type=int, default=3, help="one-rank mode: untimed steps (compilations) first")
    parser.add_argument("--out", default=None, help="write OUT/results/bench_api[-bf16][-compile][-cuda].json")
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
    result = run(args.model, args.batch_size, args.micro_batch_size, args.steps, precision=args.precision,
                 with_torch=not args.no_torch, compile=args.compile, warmup=args.warmup)
    line = (f"{result['model']} batch {result['batch_size']} micro-batch {result['micro_batch_size']} "
            f"{result['precision']} on {result['device_name']}: API {result['api_step_s'] * 1e3:.2f} ms/step, plain "
            f"loop {result['loop_step_s'] * 1e3:.2f} ms/step, API/loop throughput {result['throughput_ratio']:.3f}")
    if "torch_step_s" in result:
        line += (f"; torch ScheduleGPipe (1 stage) {result['torch_step_s'] * 1e3:.2f} ms/step, API/torch "
                 f"{result['throughput_ratio_vs_torch']:.3f}")
    if "api_compiled_step_s" in result:
        line += (f"\ncompiled: API {result['api_compiled_step_s'] * 1e3:.2f} ms/step, plain loop "
                 f"{result['loop_compiled_step_s'] * 1e3:.2f} ms/step; compiled API throughput over compiled loop "
                 f"{result['compiled_api_vs_compiled_loop']:.3f}, over eager API {result['compiled_api_vs_eager_api']:.3f}, "
                 f"over eager loop {result['compiled_api_vs_eager_loop']:.3f}")
    print(line)
    if args.out:
        from .common import write_result

        summary = {k: result[k] for k in ("throughput_ratio", "throughput_ratio_vs_torch", "compiled_api_vs_compiled_loop",
                                           "compiled_api_vs_eager_api", "compiled_api_vs_eager_loop") if k in result}
        name = "bench_api" if args.precision == "fp32" else f"bench_api-{args.precision}"
        if args.compile:
            name = "bench_api-compile" if args.precision == "fp32" else f"bench_api-compile-{args.precision}"
        if result["device"].startswith("cuda"):
            name += "-cuda"
        print(f"wrote {write_result(args.out, name, vars(args), [result], summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
