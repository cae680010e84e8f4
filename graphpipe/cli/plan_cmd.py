"""``graphpipe plan MODEL --devices N --batch-size B``: search a plan, print it, optionally save it.

Examples::

    graphpipe plan mmt --devices 32 --batch-size 128                 # GraphPipe (gpp) on 32 V100s
    graphpipe plan dlrm --devices 16 --batch-size 256 --strategy pipedream --out plan.json
    graphpipe plan candle-uno --devices 32 --batch-size 256 --compare   # gpp vs pipedream/piper/gpipe
    graphpipe plan data/pipedream-profiles/vgg16 --devices 8 --batch-size 128 --json

The plan file (``--out``) is written atomically, and only when planning
succeeds, so an existing file is never half-overwritten or clobbered by a
failed run. Human-readable output goes to stdout; notes (unused devices) to
stderr; ``--json`` prints one JSON document.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from graphpipe.cli.async_flags import add_async_arguments, async_requested
from graphpipe.cli.common import MAX_TIME_LIMIT_S, device_ranges
from graphpipe.errors import DeviceMemoryError, InputError

__all__ = ["register", "run", "format_plan", "format_compare"]

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("plan", help="search a pipeline plan (gpp, pipedream, piper, gpipe) and simulate it",
                       description="Partition MODEL into a stage graph, schedule and simulate one iteration.")
    from graphpipe.cli.common import add_model_argument

    add_model_argument(p)
    from graphpipe.cli.common import add_capture_arguments

    add_capture_arguments(p)
    p.add_argument("--devices", "-n", type=int, required=True, metavar="N", help="number of devices (>= 1)")
    p.add_argument("--batch-size", "-b", type=int, required=True, metavar="B", help="mini-batch size (samples)")
    p.add_argument("--strategy", default="gpp", choices=("gpp", "pipedream", "piper", "gpipe"),
                   help="partitioner (default gpp, GraphPipe)")
    p.add_argument("--cluster", default="v100", metavar="PRESET|FILE",
                   help="v100 (default), a100, h100, cpu (CPU ranks under gloo, for graphpipe run and Pipeline on "
                        "CPU) or a JSON file")
    p.add_argument("--memory-gb", type=float, default=None, metavar="G", help="override device memory (GB)")
    p.add_argument("--micro-batch-size", type=int, default=None, metavar="K", help="force one micro-batch size")
    p.add_argument("--per-stage-micro-batch", action="store_true", help="let each stage pick its micro-batch size")
    p.add_argument("--recompute", default=None, metavar="none|all|auto",
                   help="re-materialization per stage: none, all, or auto where memory or throughput needs it "
                        "(default: all for gpipe, auto for the others)")
    p.add_argument("--tp", default="auto", metavar="auto|1|2|4|8",
                   help="tensor-parallel degree inside every stage (groups of devices of one node splitting each "
                        "layer, Megatron-style); auto tries each dividing a node and keeps the fastest (default auto)")
    p.add_argument("--shard", default="auto", metavar="auto|none|fsdp",
                   help="model state of a stage's replicas: none (whole copies), fsdp (sharded, gathered for "
                        "compute), auto (both tried; default)")
    p.add_argument("--power-of-two", action="store_true",
                   help="device counts and micro-batch sizes powers of two only (the paper's setting)")
    p.add_argument("--host-cores", type=int, default=None, metavar="N",
                   help="the devices are ranks time-sharing N cores of one host (CPU runs on a smaller machine): "
                        "plan for that host, trying 1..devices ranks")
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help="override the strategy's schedule: gpipe, 1f1b, interleaved, graph-1f1b, zb-h1, graph-zb, zbv or "
                        "dualpipev (both cut the model into a V of 2K stages), "
                        "interleaved-zb, cpsat, or PipeDream's asynchronous 1f1b-async / 2bw (no flush; sequential-style "
                        "1F1B order); interleaved and interleaved-zb take --virtual-stages (default auto)")
    p.add_argument("--virtual-stages", default=None, metavar="V|auto",
                   help="cut the model into K x V stages taking the strategy's K device groups in turn (stage s on "
                        "group s mod K; every device a group of its own when the strategy's plan leaves devices idle "
                        "or is one group) for the interleaved and interleaved-zb schedules (default schedule "
                        "interleaved); auto picks V (1, 2, 4, ... up to 8) by simulated time and memory and the "
                        "table lists each V tried (default: auto with those schedules, else 1). A plan whose stages "
                        "run side by side (gpp on a branchy model) is refused, or kept as it is by auto")
    add_async_arguments(p)
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="CP-SAT time limit (default 10 s)")
    p.add_argument("--profile", default=None, metavar="FILE", help="measured per-op costs (graphpipe profile output)")
    p.add_argument("--out", default=None, metavar="PLAN.json",
                   help="write the plan file (atomically); with --compare, gpp's plan")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--max-memory-gb", type=float, default=None, metavar="G",
                   help="stop a search whose process holds more than G GB of memory (one line, exit 2) instead of "
                        "letting it grow until the system kills it (default: half the machine's memory)")
    p.add_argument("--max-shape", type=int, default=None, metavar="LEN",
                   help="the longest sequence length training will give (the model's example has its own): the "
                        "memory the search fits is checked with activations at LEN, its times stay at the "
                        "example's; Pipeline and run refuse a step longer than the plan allows")
    p.add_argument("--compare", action="store_true",
                   help="run all four strategies and print one table (a row as each finishes)")
    p.add_argument("--baseline-time-limit", type=float, default=30.0, metavar="S",
                   help="with --compare: stop a baseline (pipedream, piper, gpipe) still searching after S "
                        "seconds; its row says so (default 30)")
    p.set_defaults(func=run)


def run(args) -> int:
    """``graphpipe plan``: the flags checked, then :func:`graphpipe.search.api.plan`'s plan printed and saved."""
    from graphpipe.search.api import plan_inputs, plan_with
    from graphpipe.search.layouts import parse_shard, parse_tp

    _check_args(args)
    inputs = plan_inputs(args.model, devices=args.devices, cluster=args.cluster, memory_gb=args.memory_gb,
                         precision=args.precision, granularity=args.granularity, profile=args.profile,
                         micro_batch_size=args.micro_batch_size, recompute=args.recompute,
                         per_stage_micro_batch=args.per_stage_micro_batch, power_of_two=args.power_of_two,
                         host_cores=args.host_cores, max_memory_gb=args.max_memory_gb,
                         tp=parse_tp(args.tp), shard=parse_shard(args.shard), max_shape=args.max_shape)
    if args.compare:
        return _run_compare(args, inputs)
    progress = None
    if (args.schedule or "").lower() == "cpsat":
        from graphpipe.search.cpsat import progress_writer

        progress = progress_writer(sys.stderr)
    try:
        plan = plan_with(inputs, batch_size=args.batch_size, strategy=args.strategy, schedule=args.schedule,
                         time_limit_s=args.time_limit, progress=progress, virtual_stages=args.virtual_stages,
                         vertical_sync=args.vertical_sync, update_every=args.update_every, stash=not args.no_stash,
                         notes=lambda text: sys.stderr.write(f"graphpipe: note: {text}\n"))
    except DeviceMemoryError as exc:  # the search knows bytes; say which device they are and where it came from
        from graphpipe.cli.common import memory_source

        raise DeviceMemoryError(f"{exc}{memory_source(args, inputs.cluster, inputs.profile)}") from exc
    _report(args, plan, inputs.cluster)
    return 0


def _check_args(args) -> None:
    """Refuse bad flag values and combinations before anything is built."""
    from graphpipe.cli.common import JSON_SUFFIXES, check_batch, check_outputs
    from graphpipe.sched.generators import SCHEDULES

    if args.devices < 1:
        raise InputError(f"--devices must be >= 1, got {args.devices}")
    check_batch(args.batch_size, args.micro_batch_size)
    if args.time_limit is not None and not 0 < args.time_limit <= MAX_TIME_LIMIT_S:
        raise InputError(f"--time-limit must be > 0 and at most {MAX_TIME_LIMIT_S:g} seconds, got {args.time_limit}")
    limit = args.baseline_time_limit
    if not (limit > 0 and limit <= MAX_TIME_LIMIT_S):  # also refuses nan
        raise InputError(f"--baseline-time-limit must be > 0 and at most {MAX_TIME_LIMIT_S:g} seconds, got {limit}")
    if args.compare and (args.schedule or args.virtual_stages is not None):
        raise InputError(f"--compare runs every strategy with its own schedule; drop "
                         f"{'--schedule' if args.schedule else '--virtual-stages'}")
    args.virtual_stages = _virtual_stages(args.virtual_stages)
    schedule = (args.schedule or "").lower()
    own_layout = schedule == "cpsat" or schedule in SCHEDULES and SCHEDULES[schedule].layout == "v"
    if args.virtual_stages not in (None, 1) and (async_requested(args) or own_layout):
        raise InputError(f"--virtual-stages places stages in turn for the interleaved and interleaved-zb schedules; "
                         f"--schedule {schedule} runs its own layout: drop --virtual-stages or pick one of them")
    check_outputs((args.out, "--out", JSON_SUFFIXES))


def _virtual_stages(text):
    """``--virtual-stages``: None, ``"auto"`` or an integer >= 1."""
    if text is None or text.strip().lower() == "auto":
        return None if text is None else "auto"
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise InputError(f"--virtual-stages must be a positive integer or auto, got {text!r}")
    return value


def _run_compare(args, inputs) -> int:
    """``--compare``: one row per strategy as each finishes; ``--out`` gets gpp's plan."""
    from graphpipe.cli.common import print_json
    from graphpipe.search.api import recorded
    from graphpipe.search.planner import compare

    status = _Progress(sys.stderr)
    printer = None if args.json else _RowPrinter(sys.stdout, status)
    plans: dict = {}
    model_id = inputs.source.model_id
    try:
        rows = compare(model_id, inputs.graph, inputs.cluster, args.batch_size, inputs.options,
                       baseline_time_limit_s=args.baseline_time_limit, on_row=printer, progress=status, plans=plans)
    finally:
        status.clear()
    if args.out and "gpp" in plans:  # the compared gpp plan, so a demo need not search it twice
        from graphpipe.plan import write_plan

        write_plan(args.out, recorded(plans["gpp"], inputs, capture=False))
        if not args.json:
            sys.stdout.write(f"wrote {args.out} (the gpp plan)\n")
    if args.json:
        print_json({"model": model_id, "devices": args.devices, "batch_size": args.batch_size,
                    "cluster": inputs.cluster.name, "results": rows})
    if not any(r["feasible"] for r in rows):
        from graphpipe.errors import InfeasibleError

        raise InfeasibleError(f"every strategy failed for {model_id} on {args.devices} devices at batch "
                              f"size {args.batch_size} (reasons in the table); try more devices or memory")
    return 0


def _report(args, plan, cluster) -> None:
    """Note unused devices, write ``--out``, print the plan (a table, or ``--json``)."""
    from graphpipe.cli.common import print_json

    log.info("%s plan found in %.2f s: %d stage%s", plan.strategy, plan.search.time_s or 0.0,
             plan.stage_graph.num_stages, "" if plan.stage_graph.num_stages == 1 else "s")
    unused = cluster.num_devices - len(plan.stage_graph.devices_used())
    if unused:
        sys.stderr.write(f"graphpipe: note: the plan uses {cluster.num_devices - unused} of {cluster.num_devices} "
                         f"devices; more do not help this model at batch size {args.batch_size} "
                         f"(use --devices {cluster.num_devices - unused} or a larger batch)\n")
    if args.out:
        from graphpipe.plan import write_plan

        write_plan(args.out, plan)
    if args.json:
        from graphpipe.plan import plan_to_dict

        print_json(plan_to_dict(plan))
    else:
        sys.stdout.write(format_plan(plan))
        if args.out:
            sys.stdout.write(f"wrote {args.out}\n")
    if args.out:  # the launch line: a job of any other size is refused (Plan.num_ranks)
        from graphpipe.plan import torchrun_flags

        ranks = plan.num_ranks
        (sys.stderr if args.json else sys.stdout).write(
            f"train it on {ranks} rank{'s' if ranks != 1 else ''}: torchrun {torchrun_flags(plan)} your_script.py "
            f"(with graphpipe.Pipeline(\"{args.out}\", model, loss_fn)), or: graphpipe run {args.out}\n")


# ------------------------------------------------------------------ output
def _runs(values: list[str]) -> str:
    """``values`` space-separated, a run of 4 or more equal neighbours written once as ``value xN`` (a stage's
    replicas: at 1024 devices the line would otherwise hold 1024 numbers)."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.extend([f"{values[i]} x{j - i}"] if j - i >= 4 else values[i:j])
        i = j
    return " ".join(out)


def _abbrev(names: list[str], width: int = 48) -> str:
    text = ", ".join(names)
    if len(text) <= width:
        return text
    return f"{names[0]} .. {names[-1]} ({len(names)} ops)"


def format_plan(plan) -> str:
    """The stage table and the predicted figures of a plan, as printed by ``graphpipe plan``."""
    from graphpipe.search.layouts import efficiency, efficiency_factors

    sg, p, s = plan.stage_graph, plan.predicted, plan.search
    in_flight = p.in_flight or [None] * sg.num_stages
    stages = f"{sg.num_stages} stage{'s' if sg.num_stages != 1 else ''}"
    lines = [f"{plan.model}: {plan.strategy} plan, {stages} (depth {sg.depth()}) on "
             f"{len(sg.devices_used())}/{plan.cluster.num_devices} {plan.cluster.device.name}, batch {sg.batch_size}, "
             f"schedule {plan.schedule.name}"]
    # a layout column only when a stage is parallel inside itself or its replicas take micro-batches in turn:
    # whole copies splitting every micro-batch print as they always have
    layouts = any(st.parallel or st.round_robin for st in sg.stages)
    rows = [("stage", "ops", "devices", "mb", "in-flight") + (("layout",) if layouts else ())]
    for st in sg.stages:
        rows.append((str(st.id), _abbrev([sg.graph.ops[i].name for i in st.op_ids]), device_ranges(st.devices),
                     str(st.micro_batch_size), str(in_flight[st.id])) + ((_layout(st),) if layouts else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    peaks = p.peak_memory_bytes or []
    used = [d for d in sg.devices_used()]
    lines.append(f"iteration time  {p.iteration_time_s * 1e3:.3f} ms")
    lines.append(f"throughput      {p.throughput:.2f} samples/s")
    factors = efficiency_factors(plan)
    if factors is not None:
        lines.append(f"efficiency      {efficiency(p.throughput, plan.cluster.num_devices, sg.graph):.3f} of perfect "
                     f"scaling = {factors['used_share']:.3f} devices used x {factors['balance']:.3f} balance x "
                     f"{factors['busy_share']:.3f} busy")
    collectives = _collectives(plan)
    if collectives:
        lines.append(f"collectives     {collectives}")
    if peaks:
        per_device = _runs([f"{peaks[d] / 1e9:.2f}" for d in used])
        lines.append(f"peak memory     max {max(peaks) / 1e9:.2f} GB of {plan.cluster.memory_bytes / 1e9:g} GB; "
                     f"per device (GB): {per_device}")
    recompute = [f"{st.id}{f' ({len(st.checkpoints) + 1} segments)' if st.checkpoints else ''}"
                 for st in sg.stages if st.recompute]
    lines.append(f"recompute       {'stages ' + ', '.join(recompute) if recompute else 'none'}"
                 f" (--recompute {s.recompute or '-'})")
    if s.get("virtual_stages") is not None:
        tried = s.get("virtual_stages_tried") or {}
        lines.append(f"virtual stages  {s['virtual_stages']} per device group"
                     + (f"; tried: {'; '.join(f'V={v}: {note}' for v, note in tried.items())}" if len(tried) > 1 else ""))
    if plan.merged:
        lines.append(f"merged          {len(plan.merged)} non-series-parallel region(s) into single ops")
    lines.append(f"search time     {s.time_s or 0.0:.3f} s")
    for key, value in (("lower_bound_s", s.lower_bound_s), ("gap", s.gap)):
        if value is not None:
            lines.append(f"{key:<15} {value}")
    return "\n".join(lines) + "\n"


def _collectives(plan) -> str | None:
    """The plan's longest once-per-step collectives against its step (what ``busy`` loses besides fill and drain):
    the step-end gradient all-reduce (whole copies) or reduce-scatter (FSDP) after a stage's last backward, and
    FSDP's all-gather at the step's start; None where no stage has replicas."""
    sg, cluster, step = plan.stage_graph, plan.cluster, plan.predicted.iteration_time_s
    end, s_end = max((sg.sync_time(s, cluster), s) for s in range(sg.num_stages))
    if not (end > 0 and step):
        return None
    st = sg.stages[s_end]
    kind = "reduce-scatter" if st.shard == "fsdp" else "all-reduce"
    tp = f" (a tp{st.tp} rank's share)" if st.tp > 1 else ""
    text = (f"longest step-end {kind} {end * 1e3:.1f} ms ({end / step:.0%} of the step): stage {s_end}'s "
            f"{sg.layout_param_bytes(s_end) / 1e9:.3g} GB of gradients{tp} over {st.num_replicas} replicas")
    start, s_start = max((sg.gather_time(s, cluster), s) for s in range(sg.num_stages))
    if start > 0:
        text += f"; longest step-start gather {start * 1e3:.1f} ms (stage {s_start})"
    return text


def _layout(stage) -> str:
    """A stage's parallelism inside itself, for the table: ``4 x tp2-sp`` (sequence parallel), ``4 x tp2-sp-keep``
    (its gathered inputs kept whole for backward), ``4 x tp2``,
    ``8 x fsdp`` (replicas x layout), and how
    round-robin replicas take micro-batches: ``12 x copy, round-robin`` (each replica in turn),
    ``48 x copy, round-robin by 4`` (groups of 4 replicas in turn, splitting each)."""
    parts = (([f"tp{stage.tp}" + ("-sp" if stage.sequence_parallel else "") + ("-keep" if stage.keep_gathered else "")]
              if stage.tp > 1 else [])
             + (["fsdp"] if stage.shard == "fsdp" else []))
    turns = "" if not stage.round_robin else ", round-robin" + (f" by {stage.split}" if stage.split > 1 else "")
    return f"{stage.num_replicas} x {' '.join(parts) or 'copy'}{turns}"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


_HEADER = ("strategy", "throughput/s", "vs gpp", "iteration ms", "stages", "depth", "peak GB", "search s", "note")
_WIDTHS = (17, 12, 6, 12, 6, 5, 7, 8, 0)  # fixed, so rows can be printed as they arrive ("pipedream pp-only")


def _line(cells) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, _WIDTHS)).rstrip() + "\n"


def _compare_line(r: dict[str, Any], base: float | None) -> str:
    rel = (f"{r['throughput'] / base:.3f}" if base and r["feasible"] else "-")
    return _line((r["strategy"], _fmt(r["throughput"], ".2f"), rel,
                  _fmt(r["iteration_time_s"] and r["iteration_time_s"] * 1e3, ".3f"),
                  _fmt(r["num_stages"], "d"), _fmt(r["depth"], "d"),
                  _fmt(r["peak_memory_bytes"] and r["peak_memory_bytes"] / 1e9, ".2f"),
                  _fmt(r["search_time_s"], ".3f"), r["error"] or ""))


def format_compare(rows: list[dict[str, Any]]) -> str:
    """One table of :func:`graphpipe.search.planner.compare` rows, with throughput relative to gpp."""
    base = next((r["throughput"] for r in rows if r["strategy"] == "gpp" and r["feasible"]), None)
    return _line(_HEADER) + "".join(_compare_line(r, base) for r in rows)


class _Progress:
    """``--compare``'s progress on stderr: one line rewritten in place on a terminal, a line every 10 s otherwise."""

    def __init__(self, stream) -> None:
        self.stream, self.tty = stream, stream.isatty()
        self.shown, self.last = False, None

    def __call__(self, strategy: str, elapsed_s: float) -> None:
        if self.tty:
            self.stream.write(f"\r\033[K  {strategy}: searching, {elapsed_s:.1f} s")
            self.shown = True
        else:
            step = int(elapsed_s // 10)
            if step >= 1 and self.last != (strategy, step):
                self.stream.write(f"graphpipe: compare: {strategy} still searching, {step * 10} s\n")
                self.last = (strategy, step)
        self.stream.flush()

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


class _RowPrinter:
    """Prints the header, then each ``--compare`` row as soon as its strategy finishes."""

    def __init__(self, stream, status: _Progress) -> None:
        self.stream, self.status, self.base, self.started = stream, status, None, False

    def __call__(self, row: dict[str, Any]) -> None:
        self.status.clear()
        if not self.started:
            self.stream.write(_line(_HEADER))
            self.started = True
        if row["strategy"] == "gpp" and row["feasible"]:
            self.base = row["throughput"]
        self.stream.write(_compare_line(row, self.base))
        self.stream.flush()
