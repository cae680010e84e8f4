"""``graphpipe simulate PLAN.json``: validate a plan's schedule (or make a new one) and simulate it.

Examples::

    graphpipe simulate plan.json                          # summary table
    graphpipe simulate plan.json --json                   # one JSON object
    graphpipe simulate plan.json --schedule 1f1b --gantt 1f1b.png --trace 1f1b.trace.json
    graphpipe simulate plan.json --schedule cpsat --time-limit 30 --out plan-cpsat.json
    graphpipe simulate plan.json --host-cores 2            # the plan's ranks time-share 2 CPU cores
    graphpipe simulate plan.json --schedule zb-h1 --torch-csv zb.csv   # torch.distributed.pipelining's CSV
    graphpipe simulate plan.json --schedule-csv zb.csv     # validate and simulate a torch schedule CSV

Every plan read from disk goes through the one validator
(:func:`graphpipe.sched.validate_plan`); a malformed plan (non-convex stage,
overlapping devices, missing backward, unknown format) exits 2 with one line
naming the problem. Files are written atomically.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

from graphpipe.cli.async_flags import add_async_arguments, async_requested, to_async
from graphpipe.cli.common import MAX_TIME_LIMIT_S, device_ranges
from graphpipe.errors import InputError, ScheduleError

__all__ = ["register", "run", "format_summary"]

logger = log = logging.getLogger(__name__)


TRACE_DEVICES = 1024
"""Past this many devices ``--trace`` writes each stage's first device only (``--all-devices``: every one): a
trace of Llama-3.1-405B's plan on 16,384 devices is 22 GB, more than a trace viewer opens."""

GANTT_ROWS = 64
"""Past this many devices ``--gantt`` draws a row per stage (its first device) unless ``--all-devices``: a row
per device of 16,384 is a chart 5,000 inches tall, which matplotlib did not finish drawing in 15 minutes."""


def shown_devices(timeline, limit: int, everything: bool, what: str) -> tuple[int, ...] | None:
    """The devices ``what`` (--trace, --gantt) shows: None (all) up to ``limit`` devices or with ``everything``,
    else each stage's first device, said on stderr."""
    if everything or timeline.num_devices <= limit:
        return None
    devices = timeline.stage_first_devices()
    sys.stderr.write(f"graphpipe: note: {what} shows each stage's first device, {len(devices):,} of the plan's "
                     f"{timeline.num_devices:,} (a stage's other devices run the same actions on other micro-batches, "
                     f"or the same ones split); --all-devices shows every one\n")
    return devices


def register(sub) -> None:
    p = sub.add_parser("simulate", help="validate and simulate a plan's schedule (trace, Gantt chart)",
                       description="Read PLAN.json, validate its schedule (or regenerate it with --schedule), "
                                   "simulate one iteration and print iteration time, throughput, bubbles and memory.")
    p.add_argument("plan", metavar="PLAN.json", help="a graphpipe.plan/1 file (graphpipe plan --out)")
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help="replace the plan's schedule: gpipe, 1f1b, interleaved, graph-1f1b, zb-h1, graph-zb, zbv, dualpipev, "
                        "interleaved-zb, cpsat, 1f1b-async or 2bw")
    p.add_argument("--schedule-csv", default=None, metavar="IN.csv",
                   help="use the schedule of a torch.distributed.pipelining CSV (one row per rank, cells like 2F0, "
                        "1I3, 0W1; compute-and-comms files too; (F;B)OVERLAP_F_B pairs read as F then B), validated "
                        "against the plan; the file's micro-batch count wins: the stages' micro-batch sizes follow it "
                        "(a note says so), or a count the batch does not split into is refused")
    p.add_argument("--torch-csv", default=None, metavar="OUT.csv",
                   help="write the schedule as torch.distributed.pipelining's compute-only CSV (chain plans)")
    add_async_arguments(p)
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                   help="CP-SAT time limit in seconds for --schedule cpsat (default 10)")
    p.add_argument("--host-cores", type=int, default=None, metavar="N",
                   help="the devices time-share N cores of one host (CPU ranks on a smaller machine): while k "
                        "compute at once, each runs max(1, k/N) times slower")
    p.add_argument("--trace", default=None, metavar="OUT.json",
                   help=f"write a Chrome/Perfetto trace; past {TRACE_DEVICES:,} devices, of each stage's first device "
                        f"(a note says so)")
    p.add_argument("--gantt", default=None, metavar="OUT.png",
                   help=f"write a Gantt chart; past {GANTT_ROWS} devices, a row per stage (its first device)")
    p.add_argument("--all-devices", action="store_true",
                   help="--trace/--gantt of every device however many (Llama-3.1-405B's plan on 16,384 H100s: a "
                        "22 GB trace, against 0.17 GB a stage per row)")
    p.add_argument("--out", default=None, metavar="PLAN.json", help="write the plan with this schedule and its figures")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    """Validator messages carry a device x step grid; the CLI keeps its error to one line and logs the grid."""
    try:
        return _run(args)
    except ScheduleError as exc:
        headline, _, grid = str(exc).partition("\n")
        if grid:
            logger.info("schedule grid (offending actions marked >..<):\n%s", grid)
            headline += " (run 'graphpipe -v simulate ...' to see the device x step grid)"
        raise type(exc)(headline) from None


def _run(args) -> int:
    from graphpipe.plan import write_plan
    from graphpipe.cli.common import shared_host
    from graphpipe.sched import make_schedule, validate_plan

    from graphpipe.cli.common import IMAGE_SUFFIXES, JSON_SUFFIXES, check_outputs

    host = shared_host(args.host_cores)
    check_outputs((args.out, "--out", JSON_SUFFIXES), (args.trace, "--trace", JSON_SUFFIXES),
                  (args.gantt, "--gantt", IMAGE_SUFFIXES), (args.torch_csv, "--torch-csv", (".csv",)))
    if args.schedule_csv is not None and args.schedule is not None:
        raise InputError("--schedule and --schedule-csv both choose the schedule: give one")
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
    if args.schedule is None and (args.vertical_sync or args.update_every is not None or args.no_stash):
        args.schedule = plan.schedule.name  # the plan's own schedule, with other asynchronous options
    wants_async = async_requested(args)
    log.info("read %s: %s (%s), %d stages on %d devices", args.plan, plan.model, plan.strategy,
             plan.stage_graph.num_stages, plan.cluster.num_devices)
    if args.schedule is None:
        validate_plan(plan)  # a --schedule-csv schedule too
    elif args.schedule.lower() == "cpsat":
        if not 0 < args.time_limit <= MAX_TIME_LIMIT_S:
            raise InputError(f"--time-limit must be > 0 and at most {MAX_TIME_LIMIT_S:g} seconds, got {args.time_limit}")
        from graphpipe.search.cpsat import optimize_plan, progress_writer  # lazy: sched never imports search, the CLI may

        plan = optimize_plan(plan, time_limit_s=args.time_limit, progress=progress_writer(sys.stderr))
        validate_plan(plan)
    elif wants_async:
        plan = to_async(plan, args, host)
    else:
        schedule = make_schedule(args.schedule, plan.stage_graph, plan.cluster)
        plan = replace(plan.with_schedule(schedule), asynchrony={})  # a flushing schedule has no versions
    from graphpipe.sched.async_pipe import plan_spec
    from graphpipe.sched.predict import predict

    spec = plan_spec(plan)
    log.info("simulating schedule %s (%d actions)", plan.schedule.name,
             sum(len(a) for a in plan.schedule.device_actions))
    # validated above, or generated just now; the records only for a trace or a chart
    timeline, figures = predict(plan, host, validate=False, timeline=bool(args.trace or args.gantt))
    from graphpipe.search.tied import charge_plan

    figures = charge_plan(figures, plan)  # tied weights split over stages: charged as graphpipe plan charges them
    if args.trace:
        from graphpipe.sched.trace import write_trace

        write_trace(timeline, args.trace, shown_devices(timeline, TRACE_DEVICES, args.all_devices, "--trace"))
        sys.stderr.write(f"wrote {args.trace}\n")
    if args.gantt:
        from graphpipe.sched.gantt import plot_gantt

        title = f"{plan.model} — {plan.strategy}, {plan.schedule.name}, {plan.cluster.num_devices} x {plan.cluster.device.name}"
        plot_gantt(timeline, args.gantt, title=title,
                   devices=shown_devices(timeline, GANTT_ROWS, args.all_devices, "--gantt"))
        sys.stderr.write(f"wrote {args.gantt}\n")
    if args.torch_csv:
        from graphpipe.sched.torch_csv import write_torch_csv

        if spec is not None:
            raise InputError(f"--torch-csv: schedule {plan.schedule.name!r} is asynchronous (weight versions, no "
                             "flush); torch's schedule files describe flushing schedules")
        write_torch_csv(args.torch_csv, plan.stage_graph, plan.schedule)
        sys.stderr.write(f"wrote {args.torch_csv}\n")
    if args.out:
        write_plan(args.out, plan.with_schedule(plan.schedule, {**dict(plan.predicted), **figures}))
        sys.stderr.write(f"wrote {args.out}\n")
    if args.json:
        from graphpipe.cli.common import print_json

        print_json({"model": plan.model, "strategy": plan.strategy, "num_stages": plan.stage_graph.num_stages,
                    "search": dict(plan.search), **figures})
    else:
        sys.stdout.write(format_summary(plan, figures) + "\n")
    return 0


def format_summary(plan, figures: dict) -> str:
    """Human-readable summary: headline figures, one row per device, one row per stage."""
    sg = plan.stage_graph
    stages = f"{sg.num_stages} stage{'s' if sg.num_stages != 1 else ''}"
    lines = [
        f"plan: {plan.model} ({plan.strategy}), schedule {figures['schedule']}, {stages} "
        f"(depth {sg.depth()}) on {plan.cluster.num_devices} x {plan.cluster.device.name}, batch {sg.batch_size}",
        f"iteration time: {figures['iteration_time_s'] * 1e3:.4g} ms   throughput: {figures['throughput']:.4g} samples/s"
        f"   mean bubble (devices in use): {figures['mean_bubble_fraction']:.3f}",
        "",
    ]
    capacity = plan.cluster.memory_bytes
    rows: list[tuple[list[int], str]] = []  # consecutive devices whose rows read the same share one (0-7)
    for d in range(plan.cluster.num_devices):
        stages = ",".join(map(str, sg.stages_on_device(d))) or "-"
        mem = figures["peak_memory_bytes"][d]
        flag = "  > capacity" if mem > capacity else ""
        row = f"{stages:<10} {figures['bubble_fraction'][d]:>7.3f}  {mem / 1e9:>16.3f}{flag}"
        if rows and rows[-1][1] == row:
            rows[-1][0].append(d)
        else:
            rows.append(([d], row))
    labels = [device_ranges(ds) for ds, _ in rows]
    width = max(6, *map(len, labels))
    lines.append(f"{'device':>{width}}  {'stages':<10} {'bubble':>7}  {'peak memory (GB)':>16}")
    lines += [f"{label:>{width}}  {row}" for label, (_, row) in zip(labels, rows)]
    lines += ["", f"{'stage':>6}  {'devices':<12} {'mb size':>7}  {'in flight':>9}"]
    for st in sg.stages:
        lines.append(f"{st.id:>6}  {device_ranges(st.devices):<12} {st.micro_batch_size:>7}  "
                     f"{figures['in_flight'][st.id]:>9}")
    if plan.search.get("lower_bound_s") is not None:
        lines.append(f"\nCP-SAT lower bound: {plan.search['lower_bound_s'] * 1e3:.4g} ms "
                     f"(gap {plan.search.get('gap', float('nan')):.3f})")
    return "\n".join(lines)
