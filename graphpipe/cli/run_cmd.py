"""``graphpipe run PLAN.json``: execute a plan on one process per device (torch.distributed).

Examples::

    graphpipe run plan.json                                # gloo on CPU, 5 steps, summary
    graphpipe run plan.json --steps 10 --check --json      # + loss/gradient check vs one process
    graphpipe run plan.json --gantt run.png --trace run.trace.json --gantt-pair sim-vs-real.png
    graphpipe run plan.json --baseline torch --json        # same plan on torch.distributed.pipelining

Exit codes: 0 success; 1 a rank failed (message ``rank R failed: ...``) or
``--check`` found a mismatch; 2 bad input (unreadable plan, plan that does not
match its model, torch baseline of a non-sequential plan), refused before
any process starts.
"""

from __future__ import annotations

import json
import sys

from graphpipe.errors import InputError

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser("run", help="execute a plan for real on torch.distributed (one process per device)",
                       description="Run PLAN.json on one process per device (gloo on CPU, NCCL with one GPU per "
                                   "rank), time every action, and compare with the plan's prediction.")
    p.add_argument("plan", metavar="PLAN.json", help="a graphpipe.plan/1 file whose model is a zoo spec or file.py:factory")
    p.add_argument("--steps", type=int, default=5, help="training iterations (default 5; the first is a warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="iterations excluded from the measurement (default 1)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="auto: nccl when every rank has its own GPU, else gloo")
    p.add_argument("--check", action="store_true",
                   help="compare the first iteration's loss and every gradient with a single-process run")
    p.add_argument("--baseline", default=None, choices=("torch",),
                   help="run on torch.distributed.pipelining instead (sequential plans only)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="process-group timeout in seconds: a rank waiting longer fails the run (default 60)")
    p.add_argument("--seed", type=int, default=0, help="model weights and data seed (default 0)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--cpus-per-rank", type=int, default=0, metavar="N",
                   help="pin each rank to N CPUs of its own (default 0: no pinning); steadier CPU timings")
    p.add_argument("--trace", default=None, metavar="OUT.json", help="Chrome/Perfetto trace of a measured iteration")
    p.add_argument("--gantt", default=None, metavar="OUT.png", help="Gantt chart of a measured iteration")
    p.add_argument("--gantt-pair", default=None, metavar="OUT.png", help="simulated and measured Gantt charts side by side")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from graphpipe.plan import read_plan
    from graphpipe.runtime import RunOptions, RuntimeFailure, run_plan

    if args.threads < 1:
        raise InputError(f"--threads must be >= 1, got {args.threads}")
    plan = read_plan(args.plan)
    options = RunOptions(steps=args.steps, warmup_steps=args.warmup, backend=args.backend, check=args.check,
                         timeout_s=args.timeout, seed=args.seed, lr=args.lr, num_threads=args.threads,
                         cpus_per_rank=args.cpus_per_rank, baseline=args.baseline)
    try:
        summary = run_plan(plan, options)
    except RuntimeFailure as exc:
        sys.stderr.write(f"graphpipe: error: {exc}\n")
        return 1
    timeline = summary.pop("timeline", None)
    _write_outputs(args, plan, timeline)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(_format(summary))
    check = summary.get("check")
    return 1 if check is not None and not check["passed"] else 0


def _write_outputs(args, plan, timeline) -> None:
    wanted = [x for x in (args.trace, args.gantt, args.gantt_pair) if x]
    if not wanted:
        return
    if timeline is None:
        sys.stderr.write("graphpipe: note: the torch baseline records no per-action timeline; "
                         "--trace/--gantt skipped\n")
        return
    from graphpipe.sched import simulate
    from graphpipe.sched.gantt import plot_gantt, plot_gantt_pair
    from graphpipe.sched.trace import write_trace

    title = f"{plan.model} {plan.strategy} {plan.schedule.name} (measured)"
    if args.trace:
        write_trace(timeline, args.trace)
        sys.stderr.write(f"wrote {args.trace}\n")
    if args.gantt:
        plot_gantt(timeline, args.gantt, title=title)
        sys.stderr.write(f"wrote {args.gantt}\n")
    if args.gantt_pair:
        simulated = simulate(plan.stage_graph, plan.schedule, plan.cluster)
        plot_gantt_pair(simulated, timeline, args.gantt_pair, titles=("simulated", "measured"))
        sys.stderr.write(f"wrote {args.gantt_pair}\n")


def _format(summary: dict) -> str:
    m, p = summary["measured"], summary.get("predicted", {})
    lines = [f"plan: {summary['plan']['model']} strategy={summary['plan']['strategy']} "
             f"schedule={summary['plan']['schedule']} devices={summary['plan']['num_devices']} "
             f"batch={summary['plan']['batch_size']} backend={summary.get('backend')}"
             + (f" baseline={summary['baseline']}" if summary.get("baseline") else ""),
             f"measured:  iteration {m['iteration_time_s'] * 1e3:.3f} ms  throughput {m['throughput']:.1f} samples/s"
             f"  (median of {len(m['step_times_s'])} steps after {m['warmup_steps']} warm-up)"]
    if "iteration_time_s" in p:
        lines.append(f"predicted: iteration {p['iteration_time_s'] * 1e3:.3f} ms  throughput {p['throughput']:.1f} samples/s"
                     f"  (error {summary.get('prediction_error', float('nan')) * 100:.1f}% of measured)")
    if summary.get("losses"):
        lines.append("loss per step: " + " ".join(f"{x:.6g}" for x in summary["losses"]))
    if "check" in summary:
        c = summary["check"]
        lines.append(f"check: {'PASSED' if c['passed'] else 'FAILED'}  max_abs_diff {c['max_abs_diff']:.3g}  "
                     f"loss {c['loss']:.6g} vs {c['reference_loss']:.6g}  params {c['num_params_checked']}/{c['num_params']}"
                     f"  mismatches {c['num_mismatches']} (rtol {c['rtol']:g}, atol {c['atol']:g})")
    return "\n".join(lines) + "\n"
