"""``graphpipe run PLAN.json``: execute a plan on one process per device (torch.distributed).

Examples::

    graphpipe run plan.json                                # gloo on CPU, 5 steps, summary
    graphpipe run plan.json --steps 10 --check --json      # + loss/gradient check vs one process
    graphpipe run plan.json --gantt run.png --trace run.trace.json --gantt-pair sim-vs-real.png
    graphpipe run plan.json --baseline torch --json        # same plan on torch.distributed.pipelining
    graphpipe run plan.json --baseline torch --schedule-csv zb.csv --check   # a torch schedule CSV in torch's runtime

Exit codes: 0 success; 1 a rank failed (message ``rank R failed: ...``) or
``--check`` found a mismatch; 2 bad input (unreadable plan, plan that does not
match its model, torch baseline of a non-sequential plan), refused before
any process starts.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from graphpipe.errors import InputError
from graphpipe.runtime.flags import add_run_arguments

if TYPE_CHECKING:
    from graphpipe.runtime.results import RunDevices

log = logging.getLogger(__name__)

__all__ = ["register", "run", "run_device"]


def register(sub) -> None:
    p = sub.add_parser("run", help="execute a plan for real on torch.distributed (one process per device)",
                       description="Run PLAN.json on one process per device (gloo on CPU, NCCL with one GPU per "
                                   "rank), time every action, and compare with the plan's prediction.")
    p.add_argument("plan", metavar="PLAN.json", help="a graphpipe.plan/1 file whose model is a zoo spec or file.py:factory")
    add_run_arguments(p)
    p.add_argument("--schedule-csv", default=None, metavar="IN.csv",
                   help="run the schedule of a torch.distributed.pipelining CSV instead of the plan's (validated "
                        "against the plan; with --baseline torch, torch's _PipelineScheduleRuntime executes it)")
    p.add_argument("--trace", default=None, metavar="OUT.json", help="Chrome/Perfetto trace of a measured iteration")
    p.add_argument("--gantt", default=None, metavar="OUT.png", help="Gantt chart of a measured iteration")
    p.add_argument("--gantt-pair", default=None, metavar="OUT.png", help="simulated and measured Gantt charts side by side")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from graphpipe.runtime import RuntimeFailure, run_plan
    from graphpipe.runtime.measure import format_summary
    from graphpipe.runtime.flags import options_from_args

    from graphpipe.cli.common import IMAGE_SUFFIXES, JSON_SUFFIXES, check_outputs

    _check_steps(args)
    options = options_from_args(args)
    check_outputs((args.trace, "--trace", JSON_SUFFIXES), (args.gantt, "--gantt", IMAGE_SUFFIXES),
                  (args.gantt_pair, "--gantt-pair", IMAGE_SUFFIXES))  # before the run, not after it
    from graphpipe.sched.complete import read_plan_completed

    plan = read_plan_completed(args.plan, say=lambda line: print(f"graphpipe: {line}", file=sys.stderr))
    if args.schedule_csv is not None:
        import os

        from graphpipe.sched.torch_csv import micro_batch_note, plan_with_torch_csv

        before = plan.stage_graph
        plan = plan_with_torch_csv(plan, args.schedule_csv)
        note = micro_batch_note(before, plan.stage_graph, os.path.basename(args.schedule_csv))
        if note:
            sys.stderr.write(f"graphpipe: note: {note}\n")
    planned = plan.search.get("precision")
    source = plan.search.get("precision_from")
    if source in ("profile", "capture") and planned != options.precision:
        what = "profiled" if source == "profile" else "measured (activation bytes)"
        sys.stderr.write(f"graphpipe: warning: the plan's costs were {what} at {planned}; this run trains at "
                         f"{options.precision} (--precision {planned} to match)\n")
    if options.precision == "bf16" and not (source == "capture" and planned == "bf16"):
        sys.stderr.write("graphpipe: note: the plan's activation bytes are fp32 saves; plan with --precision bf16 "
                         "to measure them under autocast\n")
    from graphpipe.runtime.launch import check_host_capacity

    check_host_capacity(plan.cluster.num_devices)
    log.info("running %s (%s, %s) on %d ranks, %d steps", args.plan, plan.model, plan.schedule.name,
             plan.cluster.num_devices, options.steps)
    if options.compile:  # the first step waits for inductor on every rank: say so before the silence
        from graphpipe.progress import note

        note("--compile: each rank compiles its stages' forward and backward with torch.compile before its first "
             "step (tens of seconds on a CPU); the step count starts after that")
    try:
        summary = run_plan(plan, options)
    except RuntimeFailure as exc:  # a rank failed: 1; out of memory or refusing its stage: 2, an input to change
        sys.stderr.write(f"graphpipe: error: {exc}\n")
        return 2 if exc.out_of_memory or exc.refused else 1
    log.info("all ranks finished")
    # after the run: beside the prediction error it explains
    summary = replace(summary, devices=_note_device(plan, options))
    _write_outputs(args, plan, summary.timeline)
    if args.json:
        json.dump(summary.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_summary(summary))
    return 1 if summary.check is not None and not summary.check.passed else 0


def _check_steps(args) -> None:
    """--steps/--warmup that would report something else than asked are refused (not clamped, as the API does);
    every other option is checked by :class:`~graphpipe.runtime.options.RunOptions` itself."""
    if args.steps >= 1 and args.warmup_steps >= args.steps:
        if args.steps == 1 and args.warmup_steps == 1:  # the default warm-up with one step: measure that step
            sys.stderr.write("graphpipe: note: --steps 1 leaves no warm-up step; the one step is measured\n")
            args.warmup_steps = 0
        else:
            raise InputError(f"--warmup {args.warmup_steps} leaves nothing to measure of --steps {args.steps}; "
                             f"use --steps {args.warmup_steps + 1} or more, or a smaller --warmup")


def run_device(backend: str, num_ranks: int) -> str:
    """What a run of ``num_ranks`` ranks executes on: the GPU's name under NCCL, else the host CPU."""
    import platform

    import torch

    if backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks:
        return torch.cuda.get_device_name(0)
    if backend == "nccl":
        return "GPU"
    return f"CPU ({platform.processor() or platform.machine()})"


def _same_device(planned: str, actual: str) -> bool:
    """``V100-16GB`` vs ``Tesla V100-SXM2-16GB``: the first word of the plan's device in the run's name."""
    key = planned.lower().replace("-", " ").split()
    return bool(key) and key[0] in actual.lower()


def _note_device(plan, options) -> RunDevices:
    from graphpipe.runtime.results import RunDevices

    actual = run_device(options.backend, plan.cluster.num_devices)
    planned = plan.cluster.device.name
    measured = str(plan.search.get("profile_device") or "")  # the plan's op costs were measured there
    if not _same_device(planned, actual) and not (measured and _same_device(measured.split("(")[-1], actual)):
        fix = "--cluster cpu" if actual.startswith("CPU") else "a profile or a cluster file"
        sys.stderr.write(f"graphpipe: note: the plan was made for {planned}; this run is on {actual}. The predicted "
                         "figures are for the planned device, so the prediction error below compares two devices "
                         f"(plan for this host with {fix} to compare like with like)\n")
    return RunDevices(planned=planned, run=actual)


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
