"""Where one training step of ``graphpipe.Pipeline`` spends device and host time, beside the plain loop's step.

::

    python -m graphpipe.evals.profile_api --model transformer:small --precision bf16 --compile --out /tmp/prof

A diagnostic for ``bench_api``'s ratios, not a benchmark: the same one-rank, one-stage set-up (a gpipe plan,
fixed micro-batch size, AdamW), warmed up, then ``--steps`` steps of each contestant under ``torch.profiler``.
For each it prints the kernels' total device time and count per step, the host time per step, and the
operators with the largest device (CPU: self) time; ``--out`` also writes each contestant's Chrome trace.
A ratio below 1.0 in ``bench_api`` is then either more device work (the kernel totals differ) or a device
left idle (equal kernel totals, longer steps).

Two clocks, kept apart: each contestant's steps are first timed without the profiler (the median step: the
figure comparable with ``bench_api``), then profiled. Under ``torch.profiler`` every ATen call is recorded,
so the profiled step is longer (a user's report: 39.5 and 37.8 ms/step against bench_api's 15-28 ms on a
2-core host), and the profiler's first session starts Kineto up, which an earlier version timed inside the
first contestant's steps (the same report's 813 ms/step on a first run, most likely that): an empty session
now runs first. The last line is a summary of both clocks. On a host shared with other work both clocks
move together; their ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="transformer:small")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="profile the compiled API and compiled loop instead")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=None, help="write OUT/profile_api-<contestant>.json traces")
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from graphpipe.frontend import zoo
    from graphpipe.runtime.api import Pipeline

    from .bench_api import api_step_of, loop_step_of, one_rank_plan

    cuda = torch.cuda.is_available()
    batch, micro = args.batch_size, args.micro_batch_size
    plan = one_rank_plan(args.model, batch, micro)
    built = zoo.build(args.model, seed=0)
    pipe = Pipeline(plan, built.module, built.loss_fn, precision=args.precision, compile=args.compile)
    device = pipe.device
    plain = zoo.build(args.model, seed=0).module.to(device)
    plain.load_state_dict(built.module.state_dict())
    module = torch.compile(plain) if args.compile else plain
    x = tuple(t.to(device) for t in built.make_inputs(batch, 0))
    api_step = api_step_of(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-4))
    loop_step = loop_step_of(module, torch.optim.AdamW(plain.parameters(), lr=1e-4), built.loss_fn, batch, micro,
                             args.precision, device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        api_step(x)
        loop_step(x)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    plain_ms: dict[str, float] = {}
    for name, fn in (("api", api_step), ("loop", loop_step)):  # unprofiled first: bench_api's clock
        times = []
        for _ in range(max(3, args.steps)):
            t0 = time.perf_counter()
            fn(x)
            sync()
            times.append(time.perf_counter() - t0)
        plain_ms[name] = statistics.median(times) * 1e3
    with profile(activities=activities):  # Kineto's start-up, outside every contestant's steps
        pass
    profiled_ms: dict[str, float] = {}
    for name, fn in (("api", api_step), ("loop", loop_step)):
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn(x)
            issued = time.perf_counter() - t0
            sync()
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        profiled_ms[name] = wall / args.steps * 1e3
        if cuda:
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            device_us = sum(getattr(e, "device_time", None) or e.cuda_time for e in kernels) / args.steps
            print(f"{name}: {wall / args.steps * 1e3:.2f} ms/step under the profiler (host issued it in "
                  f"{issued / args.steps * 1e3:.2f} ms), kernels {len(kernels) / args.steps:.0f}/step "
                  f"taking {device_us / 1e3:.2f} ms/step")
            print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
        else:
            print(f"{name}: {wall / args.steps * 1e3:.2f} ms/step under the profiler")
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.out, f"profile_api-{name}.json"))
    pipe.close()
    print(f"summary: {args.model} batch {batch} micro-batch {micro} {args.precision}"
          f"{' compiled' if args.compile else ''}: unprofiled (median of {max(3, args.steps)} steps) api "
          f"{plain_ms['api']:.2f} ms/step, loop {plain_ms['loop']:.2f} ms/step, ratio loop/api "
          f"{plain_ms['loop'] / plain_ms['api']:.2f}; under the profiler api {profiled_ms['api']:.2f}, loop "
          f"{profiled_ms['loop']:.2f} ms/step (recording every op inflates both; compare bench_api with the "
          "unprofiled figures)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
