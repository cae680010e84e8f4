"""From an op graph to a complete, simulated :class:`~graphpipe.plan.Plan` (docs/design.md#the-planner).

``make_plan`` is the one road every strategy takes, so their plans are
comparable: contract non-series-parallel regions (recorded in
``plan.merged``), partition with the strategy, schedule with the strategy's
own schedule (its :class:`~graphpipe.search.common.Strategy` record's
``default_schedule``) unless ``schedule`` overrides it (``"cpsat"``
co-optimises micro-batch sizes and the action order,
:mod:`graphpipe.search.cpsat`), validate, simulate, and refuse plans whose
simulated peak memory exceeds the device memory.

A named schedule is read from its registry entry
(:class:`~graphpipe.sched.generators.ScheduleSpec`), never from its name: one
with a ``base`` is planned under that schedule and then converted here
(:func:`_from_base`: the asynchronous schedules stream the 1F1B partition,
the V layouts cut the model into ``2K`` stages), and a ``looped`` one takes
the strategy's device groups in turn (:func:`_looped`), so
``plan_request`` gives the whole plan ``graphpipe plan`` prints.

Everything the planner knows about a strategy comes from its record: which
schedule it uses, its default re-materialization, whether its search prices
re-materialization, whether it is planned on exactly N devices, whether its
plan is one of gpp's candidates.

Re-materialization (``options.recompute``, default the record's
``default_recompute``) is a planning decision: ``none``/``all`` are passed to
the strategy, ``auto`` searches both ways and keeps it only on the stages
that need it (:func:`_auto_recompute`). Once the schedule is known, every
re-materializing stage gets the checkpoints that lower its peak memory most
at its simulated in-flight count (:func:`place_checkpoints`; a data-parallel
stage with one micro-batch in flight is where they matter), except for
strategies that re-run whole stages (GPipe, as its paper does).

With ``options.host`` (devices time-sharing one host's cores, e.g. CPU
ranks on a smaller machine) every strategy scores its candidates by the
shared-host simulation, and ``make_plan`` searches on 1..N devices and keeps
the fastest there: on a saturated host an extra rank adds transfers and
all-reduces but no compute. Idle ranks get no stage.

``compare`` runs all four strategies on the same inputs; a strategy that
fails becomes a row carrying its error instead of stopping the others.

Plans are deterministic: the same inputs give byte-identical plan JSON apart
from the timing fields (:data:`TIMING_KEYS`).

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3), 4e6, 1e5, 1e4) for n in "sabt"]
>>> g = OpGraph.build("diamond", ops, [("s", "a", 1e4), ("s", "b", 1e4), ("a", "t", 1e4), ("b", "t", 1e4)])
>>> plan = make_plan("diamond.json", g, preset("v100", 4), 32)
>>> plan.strategy, plan.schedule.name, plan.predicted.throughput > 0
('gpp', 'graph-1f1b', True)

The same plan from a :class:`PlanRequest`:

>>> request = PlanRequest(model_id="diamond.json", graph=g, cluster=preset("v100", 4), batch_size=32)
>>> plan_request(request).stage_graph == plan.stage_graph
True
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

from graphpipe import costs
from graphpipe.cluster import Cluster
from graphpipe.errors import DeviceMemoryError, GraphpipeError, InfeasibleError, InputError
from graphpipe.graph import OpGraph
from graphpipe.plan import Plan
from graphpipe.sched.generators import SCHEDULES, ScheduleSpec, get_schedule
from graphpipe.search import STRATEGY_NAMES, get_strategy
from graphpipe.stages import StageGraph
from graphpipe.search.common import SearchOptions, SearchResult, Strategy, simulated, simulated_fitting
from graphpipe.search.memory_guard import memory_guard, stage
from graphpipe.sp import make_series_parallel

__all__ = ["PlanRequest", "plan_request", "make_plan", "compare", "strip_recompute", "place_checkpoints",
           "COMPARE_KEYS", "TIMING_KEYS"]

log = logging.getLogger(__name__)

COMPARE_KEYS = ("strategy", "feasible", "throughput", "iteration_time_s", "search_time_s", "num_stages", "depth",
                "peak_memory_bytes", "error")
"""Keys of every row :func:`compare` returns (the CLI's ``--compare --json`` rows)."""

TIMING_KEYS = ("time_s", "partition_time_s", "schedule_time_s", "cpsat_time_s")
"""``plan.search`` keys that hold wall-clock times: the only fields two identical runs may differ in."""

ASYNC_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.asynchronous)
"""Schedules scored as a steady state, not one flushed iteration: planned as 1F1B, then converted."""

ProgressFn = Callable[[float, float], None]
"""``progress(best_s, bound_s)``: called on every improving CP-SAT solution."""


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch size must be a positive integer, got {batch_size!r}")
    return batch_size


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """Everything :func:`plan_request` needs to make one plan; checked on construction.

    Raises :class:`InputError` for a bad batch size, an unknown strategy, an
    asynchronous schedule (plan with 1F1B, then convert) or CP-SAT on a
    shared host.
    """

    model_id: str
    """How to rebuild the module, written as the plan's ``model`` (zoo spec, ``file.py:factory`` or a path)."""
    graph: OpGraph
    cluster: Cluster
    batch_size: int
    strategy: str = "gpp"
    """One of :data:`graphpipe.search.STRATEGY_NAMES`."""
    options: SearchOptions = SearchOptions()
    schedule: str | None = None
    """Override of the strategy's schedule; ``"cpsat"`` co-optimises micro-batch sizes and the order."""
    time_limit_s: float = 10.0
    """CP-SAT's time limit (``schedule="cpsat"`` only)."""
    progress: ProgressFn | None = None
    """Called on every improving CP-SAT solution; the CLI passes one that writes to stderr."""
    monotone: bool = True
    """Search fewer device counts too and keep the fastest (:func:`_over_device_counts`)."""
    virtual_stages: int | str | None = None
    """Stages per device group taken in turn (:mod:`graphpipe.search.looped`): an integer, ``"auto"``, or None
    (one, or ``"auto"`` when ``schedule`` is interleaved or interleaved-zb)."""
    vertical_sync: bool = False
    """1f1b-async only: every stage runs a micro-batch on the weight version the input stage used."""
    update_every: int | None = None
    """2bw only: micro-batches per weight version (None: the micro-batches of one mini-batch)."""
    stash: bool = True
    """Asynchronous schedules: stash weight versions (False: PipeDream's ablation, backward on the latest)."""
    notes: Callable[[str], None] | None = None
    """Called with each note for people about what planning did (a V layout's micro-batch size); the CLI
    writes them to stderr."""

    def __post_init__(self) -> None:
        from graphpipe.search.looped import VIRTUAL_SCHEDULES, check_virtual_stages

        _check_batch_size(self.batch_size)
        get_strategy(self.strategy)
        virtual = check_virtual_stages(self.virtual_stages)
        name = self.schedule_name
        if name in VIRTUAL_SCHEDULES and virtual == 1:
            raise InputError(f"--schedule {name} runs 2 or more virtual stages per device group; use "
                             f"--virtual-stages 2 (or auto), or --schedule {'1f1b' if name == 'interleaved' else 'zb-h1'} "
                             "for one stage per group")
        if virtual not in (None, 1) and name not in (None, *VIRTUAL_SCHEDULES):
            raise InputError(f"--virtual-stages {virtual} places stages in turn for the {' and '.join(VIRTUAL_SCHEDULES)} "
                             f"schedules; --schedule {self.schedule} runs its own layout: drop --virtual-stages or "
                             "pick one of them")
        if name is not None and name != "cpsat":
            get_schedule(name)  # an unknown name fails here, in one line
        if self.spec is None or not self.spec.asynchronous:
            flag = ("--vertical-sync" if self.vertical_sync else "--update-every" if self.update_every is not None
                    else "--no-stash" if not self.stash else None)
            if flag:
                raise InputError(f"{flag} is for the asynchronous schedules (--schedule 1f1b-async or 2bw); "
                                 f"{f'schedule {self.schedule!r} flushes' if self.schedule else 'without one the plan flushes'} "
                                 "every mini-batch")
        elif self.update_every is not None and (isinstance(self.update_every, bool) or
                                                not isinstance(self.update_every, int) or self.update_every < 1):
            raise InputError(f"--update-every (2bw's m) must be >= 1, got {self.update_every}")
        if self.options.host is not None and self.co_optimised:
            raise InputError("the CP-SAT schedule models dedicated devices, not a shared host; "
                             "drop the host option or pick another schedule")

    @property
    def looped(self) -> bool:
        """Whether the plan takes device groups in turn with several stages each (:mod:`graphpipe.search.looped`)."""
        from graphpipe.search.looped import VIRTUAL_SCHEDULES

        return self.virtual_stages not in (None, 1) or self.schedule_name in VIRTUAL_SCHEDULES

    @property
    def spec(self) -> ScheduleSpec | None:
        """The registry entry of the overriding schedule (:func:`~graphpipe.sched.generators.get_schedule`);
        None for the strategy's own schedule and for CP-SAT."""
        name = self.schedule_name
        return None if name is None or name == "cpsat" else get_schedule(name)

    @property
    def record(self) -> Strategy:
        """The strategy's :class:`~graphpipe.search.common.Strategy` record."""
        return get_strategy(self.strategy)

    @property
    def schedule_name(self) -> str | None:
        """The overriding schedule, lower case; None keeps the strategy's own."""
        return self.schedule.lower() if self.schedule else None

    @property
    def co_optimised(self) -> bool:
        """Whether CP-SAT chooses the micro-batch sizes and the order (``schedule="cpsat"``)."""
        return self.schedule_name == "cpsat"

    @property
    def base_schedule(self) -> str | None:
        """The schedule candidates are generated and scored with: the override, except CP-SAT's (which starts
        from the strategy's own); None is the strategy's own."""
        return None if self.co_optimised else self.schedule

    @property
    def searches_device_counts(self) -> bool:
        """Whether fewer device counts than the cluster's are searched too (:func:`_over_device_counts`)."""
        return (self.monotone and not self.record.exact_devices and self.options.host is None
                and not self.co_optimised and 1 < self.cluster.num_devices <= MONOTONE_MAX_DEVICES)


def make_plan(model_id: str, graph: OpGraph, cluster: Cluster, batch_size: int, strategy: str = "gpp",
              options: SearchOptions = SearchOptions(), schedule: str | None = None,
              time_limit_s: float = 10.0, progress: ProgressFn | None = None, monotone: bool = True,
              virtual_stages: int | str | None = None) -> Plan:
    """Partition, schedule and simulate ``graph`` on ``cluster``: :func:`plan_request` of a :class:`PlanRequest`."""
    return plan_request(PlanRequest(model_id=model_id, graph=graph, cluster=cluster, batch_size=batch_size,
                                    strategy=strategy, options=options, schedule=schedule,
                                    time_limit_s=time_limit_s, progress=progress, monotone=monotone,
                                    virtual_stages=virtual_stages))


def plan_request(request: PlanRequest) -> Plan:
    """The plan ``request`` asks for, over the layouts ``request.options`` allows (``tp``, ``shard``;
    :mod:`graphpipe.search.layouts`): each layout planned by :func:`_plan_whole` on its reduced problem, expanded
    and simulated on the cluster; the fastest wins (ties: the earlier, PP-only first; gpp retries its two
    fastest whole-copy layouts with round-robin replicas where the fastest plan leaves devices idle, up to
    batches of :data:`~graphpipe.search.layouts.ROUND_ROBIN_MAX_BATCH`). Only PP-only, on at most
    :data:`graphpipe.search.layouts.MAX_UNITS` devices: :func:`_plan_whole` itself, as before layouts existed.
    ``plan.search.layout`` and ``layouts_tried`` say what was tried and won."""
    from graphpipe.search import layouts

    started = time.perf_counter()
    options, cluster = request.options, request.cluster
    spec = request.spec
    asynchronous = spec is not None and spec.asynchronous  # PipeDream's streams: the runtime runs whole copies
    plain = request.looped or request.co_optimised or options.host is not None or asynchronous
    if plain and (options.tp not in (1, "auto") or options.shard == "fsdp"):
        raise InputError("tp > 1 and fsdp are planned with the strategies' own schedules on dedicated devices, "
                         "synchronous ones; drop --tp/--shard, or the --schedule/--virtual-stages/--host-cores "
                         "option")
    tp, shard = (1, "none") if plain else (options.tp, options.shard)
    norm = next((op.name for op in request.graph.ops if op.batchnorm), None)
    if norm is not None and (tp not in (1, "auto") or shard == "fsdp"):
        raise InputError(f"op {norm!r} holds a BatchNorm, whose running statistics graphpipe merges over whole-copy "
                         "replicas only, so a model with BatchNorm plans tp 1, shard none: drop --tp/--shard")
    forced = None  # why --tp/--shard auto plan whole copies here, for the plan's search record
    if norm is not None and not plain and "auto" in (tp, shard):  # whole copies, as `run` executes BatchNorm
        tp, shard, forced = 1, "none", f"whole copies: op {norm!r} holds a BatchNorm"
    if tp == "auto" and not layouts.splittable_ops(request.graph):
        tp = 1  # nothing to split: tp only replicates work
    max_tp = min(cluster.devices_per_node, cluster.num_devices)
    tries = layouts.candidates(cluster.devices_per_node, cluster.num_devices, max_tp, tp, shard, request.batch_size)
    if tries == (layouts.PP_ONLY,):
        plan = _plan_whole(request)
        return replace(plan, search={**plan.search, "layout_note": forced}) if forced else plan
    if not tries:
        raise InputError(f"no layout with tp {tp} fits {cluster.num_devices} devices of {cluster.devices_per_node} "
                         f"per node at batch size {request.batch_size}: tp must divide a node and the device count")
    best, error, tried = None, None, []
    by_tp: dict[int, float] = {}  # best throughput per tp degree tried

    plans: dict = {}  # layout -> its plan

    def attempt(layout, on=request) -> None:
        nonlocal best, error
        try:
            plan = plans[layout] = _plan_layout(on, layout)
        except GraphpipeError as exc:
            error = error or exc
            tried.append({**layout.as_dict(), "error": str(exc)})
            by_tp.setdefault(layout.tp, 0.0)
            return
        if request.record.ranks_candidates and request.schedule is None:
            # a round-robin retry is kept only if it beats every plan in hand: it need not be simulated otherwise
            beat = best[1].predicted.throughput if best is not None and layout.round_robin else None
            plan = _zero_bubble(request, plan, beat)
        tried.append({**layout.as_dict(), "schedule": plan.schedule.name, "throughput": plan.predicted.throughput,
                      "devices_used": len(plan.stage_graph.devices_used()),
                      "peak_memory_bytes": plan.predicted.max_peak_memory_bytes})
        by_tp[layout.tp] = max(by_tp.get(layout.tp, 0.0), plan.predicted.throughput)
        if best is None or plan.predicted.throughput > best[1].predicted.throughput * (1 + 1e-9):
            best = (layout, plan)

    for layout in tries:
        if tp == "auto" and layout.tp not in by_tp and len(by_tp) >= 2:
            degrees = sorted(by_tp)
            if by_tp[degrees[-1]] < by_tp[degrees[-2]] * (1 - 1e-9):  # tp past the best only adds collectives
                tried.append({**layout.as_dict(), "skipped": f"tp {degrees[-1]} was slower than tp {degrees[-2]}"})
                continue
        if shard == "auto" and layout.shard == "fsdp" and _roomy(tried, layout.tp, cluster):
            # sharding with the step's parameters kept gathered moves the volume of whole copies' all-reduce (half
            # of it at the step's start, while the pipeline fills) and frees memory: where whole copies planned
            # well within memory, a search cutting the model otherwise is skipped; gpp's per-stage pass
            # (_per_stage_layouts) then shards the stages of the plan kept where that is faster, the baselines
            # keep whole copies there
            tried.append({**layout.as_dict(), "skipped": "whole copies fit within 90% of device memory"})
            continue
        attempt(layout)
    # the fastest tp layouts again with their gathered inputs kept whole for backward (Stage.keep_gathered): no
    # second gather, more activation memory, so the model may be cut otherwise; KEEP_GATHERED_TRIES of them
    fastest_tp = sorted((row for row in tried if "throughput" in row and row["tp"] > 1),
                        key=lambda row: -row["throughput"])[:KEEP_GATHERED_TRIES]
    for row in fastest_tp:
        attempt(layouts.Layout(row["tp"], row["shard"], row["replica_group"], keep_gathered=True))
    if (request.record.ranks_candidates and options.micro_batch_size in (None, 1) and not options.power_of_two
            and request.batch_size > 1 and _layer_chain(request.graph)):
        # gpp, where the fastest plan leaves devices idle (stages on powers of two that do not add up to the
        # cluster): the two fastest whole-copy layouts again with round-robin replicas at micro-batch size 1 of
        # the reduced problem (a stage on any power of two up to a node or whole nodes or units; a unit of
        # several replicas is a round-robin group splitting its micro-batches). A search there simulates a
        # micro-batch per sample (per unit's samples), so it is not run where the devices are used already,
        # past ROUND_ROBIN_MAX_BATCH micro-batches, nor for every layout.
        planned = sorted((row for row in tried if "throughput" in row and row["shard"] == "none"
                          and not row.get("keep_gathered")
                          and 1 < request.batch_size // row["replica_group"] <= layouts.ROUND_ROBIN_MAX_BATCH),
                         key=lambda row: -row["throughput"])
        enough = ROUND_ROBIN_USED * cluster.num_devices
        idle = best is not None and (len(best[1].stage_graph.devices_used()) < enough
                                     or _balance(best[1], cluster) < ROUND_ROBIN_BALANCE)
        retry = planned[:ROUND_ROBIN_TRIES] if idle else []
        # what `--tp 1 --shard none` retries on its own past MAX_UNITS (its whole-copy layout, where that
        # leaves devices idle), so that no layout search ends slower than PP-only
        alone = next((row for row in planned if row["tp"] == 1 and row["replica_group"] > 1), None)
        if alone is not None and alone not in retry and alone["devices_used"] < enough:
            retry.append(alone)
        for row in retry:
            whole = plans[layouts.Layout(row["tp"], "none", row["replica_group"])]
            on = request  # re-materialization: not where the same layout's plan needed it nowhere (--recompute auto)
            if options.recompute in (None, "auto") and not any(st.recompute for st in whole.stage_graph.stages):
                on = replace(request, options=replace(options, recompute="none"))
            attempt(layouts.Layout(row["tp"], "none", row["replica_group"], round_robin=True), on)
    if best is None:
        raise error
    layout, plan = best
    search = {**plan.search, "layout": layout.as_dict(), "layouts_tried": tried, **({"layout_note": forced} if forced else {})}
    if layout.round_robin and options.recompute in (None, "auto"):  # the user's choice, not the retry's shortcut
        search["recompute"] = options.recompute or request.record.default_recompute
    if request.record.ranks_candidates and options.per_stage_layouts:  # gpp: each stage (branch) its own layout
        plan = _per_stage_layouts(request, plan, tp, shard, search)
    return replace(plan, search={**plan.search, **search, "time_s": time.perf_counter() - started})


SMALL_PARALLEL = 4
"""Ops a parallel part of a "chain of layers" may hold (:func:`_layer_chain`): OPT's token and position
embeddings side by side are still a chain; T5's encoder beside its decoder's embedding is not."""

KEEP_GATHERED_TRIES = 1
"""How many of the fastest tp layouts the layout search tries again keeping the gathered inputs whole: one
(Llama-3-70B with 2,048-token samples at 512, tp 4 FSDP: 0.747 -> 0.754; the second fastest, tp 4 whole
copies, planned slower kept than the first did)."""

ROUND_ROBIN_TRIES = 2
"""How many of the fastest whole-copy layouts gpp's layout search tries again with round-robin replicas."""

ROUND_ROBIN_USED = 0.95
"""gpp's layout search tries round-robin replicas when its fastest plan uses fewer than this share of the
devices, or balances its stages worse than :data:`ROUND_ROBIN_BALANCE`."""

ROUND_ROBIN_BALANCE = 0.85
"""The balance (:func:`graphpipe.search.layouts.efficiency_factors`: the busiest device's compute against an
even share) under which gpp's layout search also tries round-robin replicas: powers of two that use every
device may still cut equal layers unevenly (Gemma-2-27B at 8,192 devices: 0.72, then 0.92 round-robin)."""


def _balance(plan: Plan, cluster: Cluster) -> float:
    """:func:`graphpipe.search.layouts.efficiency_factors`' balance of ``plan`` (1.0 where it has none)."""
    from graphpipe.search import layouts

    factors = layouts.efficiency_factors(plan, cluster.num_devices)
    return 1.0 if factors is None else factors["balance"]

ZERO_BUBBLE = "zb-h1"
"""The zero-bubble schedule a layout search also tries on each layout's plan (:func:`_zero_bubble`)."""


def _zero_bubble(request: PlanRequest, plan: Plan, beat: float | None = None) -> Plan:
    """``plan`` under ZB-H1 (Qi et al. 2024: the backward split into I and W, W filling the pipeline's drain, at
    1F1B's activation memory) when its stages form a chain without re-materialization and that simulates faster
    and fits memory; else ``plan``. A layout search (gpp with ``--tp``/``--shard`` other than 1/none) chooses the
    schedule with the layout: where a stage's replicas end the step with a large gradient collective, or depth
    makes a long fill and drain, the W actions fill what graph-1F1B and fill-drain leave idle. Only ZB-H1: its
    simulation is as cheap as 1F1B's at thousands of devices; graph-zb (branches) costs minutes there, and the
    runtime does not split the backward of a re-materialized stage (:mod:`graphpipe.runtime.compiled` refuses
    split backward too, a run option). ``search.zero_bubble`` says what was tried. ``beat``: the throughput of
    the best plan in hand; a stage graph whose busy bound (:func:`graphpipe.search.gpp.busy_bound_s`: every
    device's F, I and W with no bubble, then its all-reduce) cannot beat it is not simulated."""
    from graphpipe.search.gpp import busy_bound_s

    sg = plan.stage_graph
    if sg.num_stages < 2 or not sg.is_chain() or any(s.recompute for s in sg.stages):
        return plan
    if beat is not None and sg.batch_size <= beat * busy_bound_s(sg, request.cluster) * (1 + 1e-9):
        return replace(plan, search={**plan.search, "zero_bubble": f"not tried: even without bubbles it stays "
                                                                   f"below the best plan's {beat:.6g} samples/s"})
    trial, why_not = _if_faster(request, plan, sg, ZERO_BUBBLE, beat)
    if trial is None:
        return replace(plan, search={**plan.search, "zero_bubble": f"not kept: {why_not}"})
    return replace(trial, search={**trial.search, "zero_bubble": f"kept over {plan.schedule.name}"})


def _if_faster(request: PlanRequest, plan: Plan, sg: StageGraph, schedule_name: str,
               beat: float | None = None) -> tuple[Plan | None, str]:
    """``sg`` under ``schedule_name``, simulated and checked against memory: ``(trial, "")`` when it is faster
    than ``plan``, else ``(None, why not)`` (the error, or its throughput). On dedicated devices the schedule is
    scored first (:func:`graphpipe.sched.simulator.score`: no timeline, the engine stopping as soon as the
    iteration provably ends later or the peak provably overflows); only a schedule that survives is simulated
    for the plan's figures (tied parameters and re-materialization segments only add to both). ``beat``: a
    throughput the trial must also exceed to be simulated in full (the best plan in hand)."""
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import score

    try:
        if request.options.host is None:
            floor = max(plan.predicted.throughput, beat or 0.0)
            sched = make_schedule(schedule_name, sg, request.cluster, validate=False)
            quick = score(sg, sched, request.cluster, memory_limit=request.cluster.memory_bytes,
                          give_up_after=sg.batch_size / floor)
            if quick is None or quick.throughput <= floor * (1 + 1e-9):
                return None, (f"{quick.throughput:.6g} samples/s under {schedule_name}" if quick is not None else
                              f"no faster under {schedule_name} within device memory")
        trial = _scheduled(request, sg, schedule_name, plan.merged, dict(plan.search))
        _check_memory(request, trial)
    except GraphpipeError as exc:
        return None, str(exc)
    if trial.predicted.throughput <= plan.predicted.throughput * (1 + 1e-9):
        return None, f"{trial.predicted.throughput:.6g} samples/s under {schedule_name}"
    return trial, ""


def _per_stage_layouts(request: PlanRequest, plan: Plan, tp, shard, search: dict[str, Any]) -> Plan:
    """``plan`` with each stage under its own best layout (:func:`graphpipe.search.layouts.per_stage_layouts`),
    kept when it simulates faster and fits memory; ``search["per_stage_layouts"]`` says whether it was.

    Each stage picks its tp alone (and a sharded layout where its memory needs one), but a stage's all-gather
    at the step's start, where the fill does not hide it, delays every stage after it, so which of the stages
    left whole to shard is then one choice for the plan (:func:`graphpipe.search.layouts.shard_stages`), kept
    when it simulates faster still."""
    from graphpipe.search import layouts

    cluster = request.cluster
    tps = [t for t in layouts.TP_CHOICES if t <= cluster.devices_per_node] if tp == "auto" else [tp]
    shards = ["none", "fsdp"] if shard == "auto" else [shard]
    in_flight = plan.predicted.in_flight or [1] * plan.stage_graph.num_stages
    best, why_not = plan, ""
    sg = layouts.per_stage_layouts(plan.stage_graph, cluster, in_flight, tps, shards, shard_round_robin=False)
    if sg.stages != plan.stage_graph.stages:
        trial, why_not = _if_faster(request, plan, sg, plan.schedule.name)
        best = trial or plan
    if "fsdp" in shards and request.options.host is None:
        from graphpipe.sched.simulator import stage_finish_times

        finish = stage_finish_times(best.stage_graph, best.schedule, cluster)
        in_flight = best.predicted.in_flight or in_flight
        sg = layouts.shard_stages(best.stage_graph, cluster, in_flight, finish)
        if sg.stages != best.stage_graph.stages:
            trial, why = _if_faster(request, best, sg, plan.schedule.name)
            best, why_not = trial or best, why_not or why
    if best is not plan:
        search["per_stage_layouts"] = "kept"
    elif why_not:
        search["per_stage_layouts"] = f"not kept: {why_not}"
    return best


def _layer_chain(graph: OpGraph) -> bool:
    """Whether ``graph``'s series-parallel form has no parallel part of more than :data:`SMALL_PARALLEL` ops: a
    chain of layers, where equal layers cut unevenly into power-of-two stages (the round-robin retry's case; on
    branchy graphs, T5-11B's encoder beside its decoder, the retry's search over both views took 15-25 s
    more)."""
    from graphpipe.search.gpp_tree import build_tree

    tree = build_tree(make_series_parallel(graph)[0])
    return not any(kind == "parallel" and len(tree.op_ids[x]) > SMALL_PARALLEL for x, kind in enumerate(tree.kinds))


def _roomy(tried: list[dict[str, Any]], tp: int, cluster: Cluster) -> bool:
    """Whether the whole-copy plan at ``tp`` was found and peaks below 90% of the device memory."""
    row = next((r for r in tried if r["tp"] == tp and r["shard"] == "none"), None)
    return (row is not None and "throughput" in row
            and float(row.get("peak_memory_bytes") or 0.0) < 0.9 * cluster.memory_bytes)


def _plan_layout(request: PlanRequest, layout) -> Plan:
    """``request`` planned with one uniform ``layout``: the strategy's whole-copy plan of the reduced problem,
    expanded to the cluster, scheduled with the strategy's schedule, simulated and checked against memory."""
    from graphpipe.search import layouts

    if layout.round_robin:
        request = replace(request, options=replace(request.options, round_robin=True, micro_batch_size=1))
    if layout.pp_only and layout.group == 1 and not request.graph.shared:
        return _plan_whole(request)
    cluster = request.cluster
    graph = layouts.reduced_graph(request.graph, cluster, layout)
    if graph.shared:  # the search sees the tie's copies (the expanded plan, on the graph itself, charges them),
        from graphpipe.search.tied import with_copies  # whole on each tp rank, as the plan is charged

        graph = with_copies(graph)
    reduced = replace(request, graph=graph,
                      cluster=layouts.reduced_cluster(cluster, layout),
                      batch_size=request.batch_size // layout.group, progress=None)
    small = _plan_whole(reduced)
    started = time.perf_counter()
    sp_graph, merged = make_series_parallel(request.graph)
    sg = layouts.expand(small.stage_graph, sp_graph, cluster, layout, request.batch_size)
    if request.spec is not None and request.spec.asynchronous:  # past MAX_UNITS: round-robin groups, refused
        from graphpipe.sched.async_pipe import check_async_stage_graph

        check_async_stage_graph(sg)
    search = {**small.search, "reduced_devices": reduced.cluster.num_devices,
              "reduced_throughput": small.predicted.throughput}
    used = len(sg.devices_used())  # the reduced plan counted units; the plan's figures count devices
    if "devices_used" in search:
        search["devices_used"] = used
    if "unused_devices" in search:
        search["unused_devices"] = cluster.num_devices - used
    plan = _scheduled(request, sg, small.schedule.name, merged, search)
    _check_memory(request, plan)
    return replace(plan, search={**plan.search, "schedule_time_s": time.perf_counter() - started})


def _plan_whole(request: PlanRequest) -> Plan:
    """The plan ``request`` asks for with whole-copy stages; see the module docstring.

    With ``request.monotone`` (the default; not for strategies planned on
    exactly N devices) the plan is the fastest the strategy finds on the
    cluster's device count, every count up to :data:`MONOTONE_EXACT_UP_TO`
    and the powers of two below it (:func:`_over_device_counts`), so adding
    devices never gives a slower plan up to 8 devices and between powers of
    two up to :data:`MONOTONE_MAX_DEVICES`; ``plan.search.device_counts_tried``
    lists the counts searched. A strategy whose record ranks candidates (gpp)
    also ranks the candidate strategies' plans on the same devices by the same
    simulation and keeps the fastest; ``plan.search.space`` says whose space
    the winner came from.

    Raises :class:`InfeasibleError` when no plan fits in device memory, and
    :class:`~graphpipe.search.memory_guard.MemoryBudgetError` when the search's
    process passes its resident-memory budget (``options.max_memory_gb``,
    default half the machine's memory) before it finishes.
    """
    spec = request.spec
    if spec is not None and spec.base is not None:  # planned under its base schedule, then converted or re-cut
        return _from_base(request, spec)
    started = time.perf_counter()
    limit = None if request.options.max_memory_gb is None else request.options.max_memory_gb * 2**30
    flat = replace(request, schedule=None, virtual_stages=None) if request.looped else request
    with memory_guard(request.strategy, limit), _collector_paused():
        if flat.searches_device_counts:
            plan = _over_device_counts(flat)
        else:
            plan = _plan_on(flat, request.cluster.num_devices)
            plan = replace(plan, search={**plan.search, "device_counts_tried": [request.cluster.num_devices]})
        if request.looped:
            plan = _looped(request, plan)
    return replace(plan, search={**plan.search, "time_s": time.perf_counter() - started})


def _from_base(request: PlanRequest, spec: ScheduleSpec) -> Plan:
    """The plan of a schedule that starts from another's (:attr:`ScheduleSpec.base`): the strategy's plan under
    the base schedule, streamed without a flush (asynchronous schedules keep its partition,
    :func:`~graphpipe.sched.async_pipe.with_async`) or its micro-batch size cut into a V (:func:`looped.v_layout_plan`)."""
    from graphpipe.search import looped

    options = replace(request.options, tp=1, shard="none") if spec.asynchronous else request.options
    base = plan_request(replace(request, schedule=spec.base, vertical_sync=False, update_every=None, stash=True,
                                options=options))
    if spec.asynchronous:
        from graphpipe.sched.async_pipe import async_spec_for, with_async

        versions = async_spec_for(spec.name, base.stage_graph, request.vertical_sync, request.update_every,
                                  stash=request.stash)
        return with_async(base, versions, request.options.host)
    if spec.layout != "v":
        raise InputError(f"schedule {spec.name!r} starts from {spec.base!r} but has no conversion ({spec.layout} layout)")
    flat_mb = min(st.micro_batch_size for st in base.stage_graph.stages)
    plan = looped.v_layout_plan(base, spec.name, forced=request.options.micro_batch_size is not None)
    if request.notes is not None:
        sg, devices = plan.stage_graph, request.cluster.num_devices
        mb = sg.stages[0].micro_batch_size
        request.notes(f"--schedule {request.schedule} cuts the model into a V of {sg.num_stages} stages on {devices} "
                      f"devices (stage d and {sg.num_stages - 1}-d on device d), at "
                      + (f"{request.strategy}'s micro-batch size" if mb == flat_mb else
                         f"micro-batch size {mb} ({request.strategy}'s {flat_mb} is too large for it)"))
    return plan


def _looped(request: PlanRequest, flat: Plan) -> Plan:
    """``flat``'s device groups taken in turn by ``request.virtual_stages`` stages each (:mod:`graphpipe.search.looped`).

    ``auto`` tries 2, 4, ... virtual stages and, unless a virtual-stage schedule was named, ``flat`` itself
    (one stage per group); the fastest fit wins and ``plan.search`` says which and why.
    """
    from graphpipe.search import looped

    started = time.perf_counter()
    auto = request.virtual_stages in (None, "auto")
    own = looped.LayoutTry(1, None, flat.predicted.throughput, f"{flat.predicted.throughput:.4g} samples/s, "
                                                               f"{request.strategy}'s own plan ({flat.schedule.name})")
    try:
        groups = looped.device_groups(flat.stage_graph, request.strategy)
    except InputError as exc:
        if not (auto and request.schedule is None):
            raise
        return replace(flat, search={**flat.search, "virtual_stages": 1, "virtual_stages_tried": looped.summary(
            [own, looped.LayoutTry(2, None, None, str(exc).removeprefix("--virtual-stages: "))], own)})
    num_devices = request.cluster.num_devices
    if len(flat.stage_graph.devices_used()) < num_devices or len(groups) == 1:
        groups = tuple((d,) for d in range(num_devices))  # the user asked for a pipeline over N devices: all of them
    graph = flat.stage_graph.graph  # series-parallel contracted, as the flat plan's stages are
    schedule = request.schedule_name or looped.VIRTUAL_SCHEDULES[0]
    counts = looped.auto_counts(graph.num_ops, len(groups)) if auto else [request.virtual_stages]
    recompute = request.options.recompute or request.record.default_recompute
    with stage(f"{request.strategy} (virtual stages)"):
        tries = [looped.best_layout(graph, groups, v, request.cluster, request.batch_size, schedule, request.options,
                                    recompute) for v in counts]
    if auto and request.schedule is None:
        tries.insert(0, own)
    winner = looped.pick(tries, request.strategy, schedule)
    notes = {"virtual_stages": winner.virtual, "virtual_stages_tried": looped.summary(tries, winner)}
    if winner.stage_graph is None:  # one stage per group won
        return replace(flat, search={**flat.search, **notes})
    sg = winner.stage_graph
    search = {**flat.search, **notes, "recompute_stages": [s.id for s in sg.stages if s.recompute],
              "num_stages": sg.num_stages, "micro_batch_size": sg.stages[0].micro_batch_size}
    for key in ("recompute_segments", "bottleneck_tps", "model_bottleneck_tps", "throughput_estimate"):
        search.pop(key, None)  # figures of the flat plan's stages, not of these
    used = len(sg.devices_used())
    for key, value in (("unused_devices", num_devices - used), ("devices_used", used)):
        if key in search:
            search[key] = value
    plan = _scheduled(request, sg, schedule, flat.merged, search)
    _check_memory(request, plan)
    search = {**plan.search, "schedule": plan.schedule.name,
              "schedule_time_s": (flat.search.schedule_time_s or 0.0) + time.perf_counter() - started}
    return replace(plan, search=search)


@contextmanager
def _collector_paused():
    """Pause CPython's cyclic garbage collector while a search runs.

    The searches build many small objects that live until they end (the DPs'
    memo tables); their growth triggers full collections, which walk every
    object of the process, torch's modules and the model included, a sizeable
    share of a search's time. The searches' objects hold no reference cycles,
    so reference counting frees them all the same; the collector runs again,
    as configured, once the search returns.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


MONOTONE_EXACT_UP_TO = 8
"""Device counts searched below the cluster's own: every count up to this one, and the powers of two.

Each count is a full search, so trying every count up to 32 would cost gpp up
to 25 searches on dlrm; with this set a plan is never slower than the plan on
any count up to 8 or any power of two below its own (so exactly monotone up
to 8 devices and along powers of two), at a few searches' cost."""

MONOTONE_MAX_DEVICES = 16
"""Past this many devices only the cluster's own count is searched. Each extra count is a full search and the
perfect-scaling bound rarely stops early on communication-bound models, which then search several counts for
the same plan. gpp's DP already places a plan on fewer than N devices when that meets its target on fewer."""


def _work_bound(graph: OpGraph, batch_size: int) -> float:
    """Seconds of compute one iteration needs on one device: a lower bound of ``n`` devices' iteration times ``n``.

    Every op runs ``fwd(b) + bwd(b)`` on each of its ``r`` replicas for each of
    the ``B / (b r)`` or more micro-batches that reach it, at least
    ``fwd(B) + bwd(B)`` of device time in all (the coefficients are >= 0);
    re-materialization, transfers and idle time only add to it.
    """
    return sum(o.fwd(batch_size) + o.bwd(batch_size) for o in graph.ops)


def _device_counts(n_max: int, power_of_two: bool) -> list[int]:
    """The counts :func:`_over_device_counts` may try, largest first."""
    return [n for n in range(n_max, 0, -1)
            if n == n_max or (n <= MONOTONE_EXACT_UP_TO or n & (n - 1) == 0) and (not power_of_two or n & (n - 1) == 0)]


def _over_device_counts(request: PlanRequest) -> Plan:
    """The fastest of ``_plan_on(request, n)`` over the device counts ``n <= N`` (ties: fewer devices).

    Counts are tried from ``N`` down and the search stops at the first ``n``
    whose perfect-scaling bound (:func:`_work_bound`) cannot beat the plan in
    hand -- no smaller count can either. Past :data:`MONOTONE_EXACT_UP_TO`
    devices only powers of two are tried below ``N`` (each count is a full
    search).
    """
    n_max = request.cluster.num_devices
    work = _work_bound(request.graph, request.batch_size)
    best, error, tried = None, None, []
    for n in _device_counts(n_max, request.options.power_of_two):
        if best is not None and work > 0 and n * request.batch_size / work <= best.predicted.throughput * (1 + 1e-9):
            break
        tried.append(n)
        try:
            plan = _plan_on(request, n, None if best is None else best.predicted.iteration_time_s)
        except InfeasibleError as exc:
            error = error or exc
            continue
        except GraphpipeError as exc:  # a strategy's own failure on a smaller count must not cost the larger
            if n == n_max:
                raise
            log.warning("%s on %d of %d devices failed (%s); that count is skipped", request.graph.name, n, n_max,
                        exc)
            continue
        if best is None or _faster_or_smaller(plan, best):
            best = plan
    if best is None:
        raise error
    search = {**best.search, "device_counts_tried": tried}
    if "unused_devices" in search:  # the partitioner counted against the count it searched, not the cluster's
        search["unused_devices"] = n_max - len(best.stage_graph.devices_used())
    return replace(best, search=search)


def _faster_or_smaller(plan: Plan, best: Plan) -> bool:
    """``plan`` is strictly faster than ``best``, or as fast on fewer devices."""
    if plan.predicted.throughput >= best.predicted.throughput * (1 + 1e-9):
        return True
    return (plan.predicted.throughput >= best.predicted.throughput * (1 - 1e-9)
            and len(plan.stage_graph.devices_used()) < len(best.stage_graph.devices_used()))


CANDIDATE_MAX_DEVICES = 32
"""gpp ranks the candidate strategies' plans (PipeDream's, Piper's) on at most this many devices.

Their cost grows with the device count where gpp's does not: Piper's seed and PipeDream's levels with N,
and every candidate is simulated with its own schedule over all N devices and, at the data-parallel share,
``B / b`` = 16 N micro-batches. Past this count gpp's own plan stands, faster than either candidate on the
zoo's paper models at 128-1024 devices (evals/REPORT.md, "bench_scale"). Up to it, nothing changes: the
sweep of evals/check_gpp_vs_spp.py (2-32 devices) still has gpp never worse than the candidates."""


def _candidate_records() -> list[Strategy]:
    """The strategies whose plans a candidate-ranking strategy weighs (missing modules left out)."""
    records = []
    for name in STRATEGY_NAMES:
        try:
            record = get_strategy(name)
        except InputError as exc:
            log.info("gpp: no %s candidate: %s", name, exc)
            continue
        if record.gpp_candidate:
            records.append(record)
    return records


def _plan_on(request: PlanRequest, devices: int, beat: float | None = None) -> Plan:
    """The strategy's plan using at most ``devices`` of the cluster's (gpp: with the sequential candidates).

    ``beat``: the iteration time of a plan in hand; a pruning strategy (gpp)
    may then skip the parts of its space that provably cannot beat it (and
    raises :class:`InfeasibleError` when nothing can).
    """
    plan = _make_plan_at(request, devices, beat)
    if not request.record.ranks_candidates or request.schedule is not None or request.options.host is not None:
        return plan
    if devices > CANDIDATE_MAX_DEVICES:
        return replace(plan, search={**plan.search, "space": request.strategy,
                                     "candidates_skipped": f"past {CANDIDATE_MAX_DEVICES} devices"})
    best, space = plan, request.strategy
    for other in _candidate_records():
        options = request.options
        if other.candidate_max_downsets is not None:
            options = replace(options, max_downsets=min(options.max_downsets, other.candidate_max_downsets))
        try:
            with stage(f"{request.strategy} (ranking {other.name}'s plan as a candidate)"):
                cand = _make_plan_at(replace(request, strategy=other.name, options=options, progress=None), devices)
        except GraphpipeError as exc:  # refused (downsets) or infeasible: not a candidate
            log.info("%s: no %s candidate: %s", request.strategy, other.name, exc)
            continue
        if cand.predicted.throughput > best.predicted.throughput * (1 + 1e-9):
            best, space = cand, other.name
    if best is plan:
        return replace(plan, search={**plan.search, "space": space})
    search = {**best.search, "strategy": request.strategy, "space": space, "recompute": plan.search.recompute,
              "gpp_throughput": plan.predicted.throughput}
    return replace(best, strategy=request.strategy, search=search)


def _make_plan_at(request: PlanRequest, devices: int, beat: float | None = None) -> Plan:
    """The strategy's own plan on at most ``devices`` devices: partition, schedule, simulate, check memory."""
    started = time.perf_counter()
    sp_graph, merged = make_series_parallel(request.graph)
    recompute = request.options.recompute or request.record.default_recompute
    result = _partition(request, sp_graph, devices, recompute, beat)
    partitioned = time.perf_counter()
    schedule_name = (request.schedule or result.schedule_name or request.record.default_schedule).lower()
    if schedule_name == "cpsat" and any(st.round_robin for st in result.stage_graph.stages):
        raise InputError(f"the CP-SAT schedule models replicas that split micro-batches, not {request.strategy}'s "
                         f"round-robin replicas (1F1B-RR); use its own schedule (1f1b)")
    search: dict[str, Any] = {"strategy": request.strategy, "recompute": recompute, **dict(result.stats),
                              "precision": request.cluster.device.precision, "precision_from": "cluster"}
    search["recompute_stages"] = [s.id for s in result.stage_graph.stages if s.recompute]
    search["partition_time_s"] = partitioned - started
    base_name = result.schedule_name if schedule_name == "cpsat" else schedule_name
    plan = _scheduled(request, result.stage_graph, base_name, merged, search)
    if schedule_name == "cpsat":
        plan = _co_optimised(request, plan)
    search = {**plan.search, "schedule": plan.schedule.name, "schedule_time_s": time.perf_counter() - partitioned,
              "time_s": time.perf_counter() - started}
    _check_memory(request, plan)
    return replace(plan, search=search)


def _partition(request: PlanRequest, sp_graph: OpGraph, devices: int, recompute: costs.Recompute,
               beat: float | None) -> SearchResult:
    """The strategy's stage graph for ``sp_graph`` with the re-materialization ``recompute`` resolved.

    A strategy whose search does not price re-materialization runs without it
    (``all`` then marks every stage, which only lowers memory; ``auto`` cannot
    find more than the plain search); ``auto`` otherwise searches both ways
    (:func:`_auto_recompute`). On a shared host every device count up to
    ``N`` is tried (:func:`_best_device_count`).
    """
    record, options = request.record, replace(request.options, recompute=recompute)
    base = record.partition
    if record.prunes and options.host is None:  # it can skip what cannot beat the plan in hand
        base = lambda g, c, b, o, beat=beat, **kw: record.partition(g, c, b, o, beat_iteration_s=beat,  # noqa: E731
                                                                    **kw)
    partition = base
    if not record.costs_recompute:
        partition = lambda g, c, b, o: _mark_all(base(g, c, b, replace(o, recompute="none")), o)  # noqa: E731
    elif recompute == "auto":
        partition = lambda g, c, b, o: _auto_recompute(base, g, c, b, o, request.base_schedule,  # noqa: E731
                                                       prunes=record.prunes and options.host is None, beat=beat)
    cluster = request.cluster
    if options.host is not None:
        return _best_device_count(partition, sp_graph, cluster, request.batch_size, options, request.base_schedule)
    result = partition(sp_graph, replace(cluster, num_devices=devices), request.batch_size, options)
    if devices < cluster.num_devices:  # the devices past ``devices`` hold no stage
        result = replace(result, stage_graph=replace(result.stage_graph, num_devices=cluster.num_devices))
    return result


def _scheduled(request: PlanRequest, sg: StageGraph, schedule_name: str, merged, search: dict[str, Any]) -> Plan:
    """The plan of ``sg`` under ``schedule_name``, simulated; re-materializing stages get their checkpoints."""
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import simulate_figures

    cluster, host = request.cluster, request.options.host
    sched = make_schedule(schedule_name, sg, cluster, validate=False)  # simulation runs the validator's checks
    predicted = simulate_figures(sg, sched, cluster, host=host)  # a plan keeps the figures, not a timeline
    if request.record.segments_checkpoints and any(s.recompute for s in sg.stages):
        placed = place_checkpoints(sg, predicted["in_flight"])
        if placed != sg:  # segments change memory only, so the schedule stands
            sg = placed
            predicted = simulate_figures(sg, sched, cluster, host=host)
        search["recompute_segments"] = {str(s.id): len(s.checkpoints) + 1 for s in sg.stages if s.recompute}
    if request.graph.shared:  # tied parameters split across stages: copies and their gradient all-reduce
        from graphpipe.search.tied import charge_shared_params

        predicted = charge_shared_params(predicted, sg, request.graph.shared, merged, cluster)
    return Plan(model=request.model_id, stage_graph=sg, cluster=cluster, strategy=request.strategy, schedule=sched,
                predicted=predicted, search=search, merged=merged)


def _co_optimised(request: PlanRequest, plan: Plan) -> Plan:
    """CP-SAT's micro-batch sizes and action order for ``plan`` (:func:`graphpipe.search.cpsat.optimize_plan`)."""
    from graphpipe.sched import validate_schedule
    from graphpipe.search.cpsat import optimize_plan

    plan = optimize_plan(plan, time_limit_s=request.time_limit_s, num_workers=2, seed=0,
                         per_stage_micro_batch=request.options.per_stage_micro_batch, progress=request.progress)
    validate_schedule(plan.stage_graph, plan.schedule)
    return plan


def _check_memory(request: PlanRequest, plan: Plan) -> None:
    """Raise :class:`InfeasibleError` when the simulated peak memory of a device exceeds the cluster's."""
    peak = float(plan.predicted.max_peak_memory_bytes or 0.0)
    if peak > request.cluster.memory_bytes:
        peaks = plan.predicted.peak_memory_bytes
        worst = max(range(len(peaks)), key=lambda d: peaks[d])
        raise DeviceMemoryError(
            f"{request.strategy} plan with the {plan.schedule.name} schedule needs {peak / 1e9:.3g} GB on device "
            f"{worst} (simulated peak) but a {request.cluster.device.name} has "
            f"{request.cluster.memory_bytes / 1e9:g} GB; use more devices or more memory per device")


def _mark_all(result: SearchResult, options: SearchOptions) -> SearchResult:
    if options.recompute != "all":
        return result
    sg = result.stage_graph
    return replace(result, stage_graph=replace(sg, stages=tuple(replace(s, recompute=True) for s in sg.stages)))


def _auto_recompute(partition, graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions,
                    schedule: str | None, prunes: bool = False, beat: float | None = None) -> SearchResult:
    """``--recompute auto``: re-materialize only the stages that need it (docs/design.md#re-materialization).

    The strategy searches twice, without re-materialization and with it on
    every stage (so a deeper pipeline, a larger micro-batch or any plan at
    all may fit); the latter then drops it, stage by stage, wherever the
    simulated peak memory still fits (that only shortens B). That plan is
    kept when it still re-materializes somewhere and simulates strictly
    faster, or when nothing fits without: with ample memory every stage
    drops it and the plan without re-materialization stands unchanged.
    gpp's second search skips the micro-batch sizes where no stage fast
    enough to beat the first plan is short of memory without it
    (``where_memory_binds``): there it could only add time.
    """
    plain, error, plain_scored = None, None, []
    try:
        plain = partition(graph, cluster, batch_size, replace(options, recompute="none"))
    except InfeasibleError as exc:
        error = exc

    def plain_throughput() -> float:  # simulated once, when first needed
        if not plain_scored:
            name = schedule or plain.schedule_name
            plain_scored.append(simulated(plain.stage_graph, cluster, name, options.host)[0])
        return plain_scored[0]

    try:
        if prunes and plain is not None:  # only a faster plan could replace it: gpp skips what cannot be
            plain_s = batch_size / plain_throughput()
            full = partition(graph, cluster, batch_size, replace(options, recompute="all"),
                             beat=plain_s if beat is None else min(beat, plain_s), where_memory_binds=True)
        else:
            full = partition(graph, cluster, batch_size, replace(options, recompute="all"))
    except InfeasibleError:
        if plain is None:
            raise error
        return plain
    schedule_name = schedule or full.schedule_name
    sg = strip_recompute(full.stage_graph, cluster, schedule_name, options.host)
    if not any(s.recompute for s in sg.stages):
        return plain if plain is not None else replace(full, stage_graph=sg)
    if plain is not None and simulated(sg, cluster, schedule_name, options.host)[0] <= plain_throughput() * (1 + 1e-9):
        return plain
    return replace(full, stage_graph=sg)


def strip_recompute(sg: StageGraph, cluster: Cluster, schedule_name: str, host=None) -> StageGraph:
    """Turn re-materialization off on every stage where the simulated plan still fits in memory.

    Stages are tried in order of the time re-materialization costs them
    (the re-run forward per sample, largest first), so the costliest are
    freed first; each change is kept only if the simulated peak memory of
    every device stays within the cluster's.

    Memory only: the peak follows from the action order
    (:func:`~graphpipe.sched.simulator.peak_memory_in_order`), and but for
    the schedules in ``ORDER_FROM_COSTS`` that order does not depend on
    re-materialization, so the schedule is built once and each trial
    re-counts only the devices of the stage it changes (``host`` changes
    timing, not memory).
    """
    from graphpipe.sched import make_schedule
    from graphpipe.sched.generators import ORDER_FROM_COSTS
    from graphpipe.sched.simulator import peak_memory_in_order

    order = sorted((s.id for s in sg.stages if s.recompute),
                   key=lambda i: (-sg.recompute_time(i) / sg.stages[i].micro_batch_size, i))
    once = bool(order) and schedule_name not in ORDER_FROM_COSTS
    if once:
        schedule = make_schedule(schedule_name, sg, cluster, validate=False)
        peaks = peak_memory_in_order(sg, schedule, cluster)
    for stage_id in order:
        trial = replace(sg, stages=tuple(replace(s, recompute=False) if s.id == stage_id else s for s in sg.stages))
        if not once:
            if simulated_fitting(trial, cluster, schedule_name, host) is not None:
                sg = trial
            continue
        changed = sg.stages[stage_id].devices
        updated = dict(zip(changed, peak_memory_in_order(trial, schedule, cluster, changed)))
        if max(updated.get(d, p) for d, p in enumerate(peaks)) <= cluster.memory_bytes:
            sg = trial
            for d, p in updated.items():
                peaks[d] = p
    return sg


def place_checkpoints(sg: StageGraph, in_flight) -> StageGraph:
    """Every re-materializing stage cut into the segments that minimize its activation peak with
    ``in_flight[stage]`` micro-batches alive (:func:`graphpipe.costs.best_checkpoints`; whole stages where
    cutting does not lower it). Time is unchanged: each segment's forward runs once more inside B, as the
    whole stage's would.
    """
    stages = tuple(replace(s, checkpoints=costs.best_checkpoints(sg.costed_graph(s.id), s.op_ids, sg.stage_sums(s.id).inputs,
                                                                 max(1, in_flight[s.id])) if s.recompute else ())
                   for s in sg.stages)
    return replace(sg, stages=stages)


def _best_device_count(partition, graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions,
                       schedule: str | None) -> SearchResult:
    """The strategy on the first ``n`` devices, ``n = 1..N``: the fastest under the shared-host simulation.

    Ties go to fewer devices. The stage graph keeps the cluster's ``N``
    devices; those past ``n`` hold no stage. Raises the last
    :class:`InfeasibleError` when no device count fits.
    """
    best, error = None, None
    for n in range(1, cluster.num_devices + 1):
        try:
            result = partition(graph, replace(cluster, num_devices=n), batch_size, options)
        except InfeasibleError as exc:
            error = exc
            continue
        sg = replace(result.stage_graph, num_devices=cluster.num_devices)
        throughput, fits = simulated(sg, cluster, schedule or result.schedule_name, options.host)
        if fits and (best is None or throughput > best[0] * (1 + 1e-9)):
            best = (throughput, n, replace(result, stage_graph=sg))
    if best is None:
        raise error or InfeasibleError(f"no plan fits on 1..{cluster.num_devices} devices of the shared host")
    throughput, n, result = best
    return replace(result, stats={**dict(result.stats), "host_devices_used": n,
                                  "host_slowdown": [list(p) for p in options.host.points]})


def _row(strategy: str, plan: Plan | None, search_time_s: float, error: str | None = None) -> dict[str, Any]:
    if plan is None:
        return {"strategy": strategy, "feasible": False, "throughput": None, "iteration_time_s": None,
                "search_time_s": search_time_s, "num_stages": None, "depth": None, "peak_memory_bytes": None,
                "error": error}
    p = plan.predicted
    return {"strategy": strategy, "feasible": True, "throughput": p.throughput,
            "iteration_time_s": p.iteration_time_s, "search_time_s": plan.search.time_s,
            "num_stages": plan.stage_graph.num_stages, "depth": plan.stage_graph.depth(),
            "peak_memory_bytes": p.max_peak_memory_bytes, "error": None}


def _plan_row(model_id: str, graph: OpGraph, cluster: Cluster, batch_size: int, strategy: str,
              options: SearchOptions) -> tuple[dict[str, Any], Plan | None]:
    started = time.perf_counter()
    try:
        plan = make_plan(model_id, graph, cluster, batch_size, strategy, options)
    except GraphpipeError as exc:
        log.info("compare: %s failed: %s", strategy, exc)
        return _row(strategy, None, time.perf_counter() - started, str(exc)), None
    return _row(strategy, plan, plan.search.time_s), plan


def _child(conn, args) -> None:  # runs in the forked process of _row_in_child
    import os

    try:
        os.setpgid(0, 0)  # its own process group, so the parent can stop it and anything it started
    except OSError:
        pass
    try:
        conn.send(("row", _plan_row(*args)))  # the plan too: the CLI may write gpp's
    except BaseException as exc:  # noqa: BLE001 -- reported by the parent, which raises it
        conn.send(("crash", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _stop(proc) -> None:
    import os
    import signal

    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (OSError, ProcessLookupError):
            pass
    proc.join(5.0)


def _row_in_child(args: tuple, strategy: str, time_limit_s: float | None, progress, tick_s: float = 0.25
                  ) -> tuple[dict[str, Any], Plan | None]:
    """``_plan_row(*args)`` in a forked process: stopped (with its process group) after ``time_limit_s``.

    A search cannot be interrupted from outside in-process (the DPs are
    plain loops), so the deadline is enforced on a process: when it passes,
    the process group is killed and the row says so.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    started = time.perf_counter()
    proc = ctx.Process(target=_child, args=(send, args), daemon=True)
    proc.start()
    send.close()
    try:
        import os

        os.setpgid(proc.pid, proc.pid)  # also here: the child may not have run its own call yet
    except OSError:
        pass
    try:
        while True:
            elapsed = time.perf_counter() - started
            wait = tick_s if time_limit_s is None else max(0.0, min(tick_s, time_limit_s - elapsed))
            if receive.poll(wait):
                try:
                    kind, payload = receive.recv()
                except EOFError:
                    kind, payload = "crash", "the search process ended without a result"
                break
            elapsed = time.perf_counter() - started
            if not proc.is_alive() and not receive.poll(0):
                kind, payload = "crash", f"the search process ended without a result (exit code {proc.exitcode})"
                break
            if time_limit_s is not None and elapsed >= time_limit_s:
                _stop(proc)
                return _row(strategy, None, time_limit_s, f"stopped after {time_limit_s:g} s"), None
            if progress is not None:
                progress(strategy, elapsed)
    finally:
        if proc.is_alive():
            proc.join(1.0)
        if proc.is_alive():
            _stop(proc)
        receive.close()
    if kind == "crash":
        raise RuntimeError(f"compare: {strategy} failed unexpectedly: {payload}")
    return payload


def compare(model_id: str, graph: OpGraph, cluster: Cluster, batch_size: int,
            options: SearchOptions = SearchOptions(), *, baseline_time_limit_s: float | None = None,
            on_row=None, progress=None, plans: dict[str, Plan] | None = None) -> list[dict[str, Any]]:
    """One row per strategy (gpp, pipedream, piper, gpipe) on the same inputs, failures included.

    Every row has the keys of :data:`COMPARE_KEYS`; a failed strategy has
    ``feasible: False``, ``error`` set and the figures ``None``.

    ``on_row(row)`` is called as soon as each strategy finishes. With
    ``baseline_time_limit_s`` or ``progress`` each strategy runs in a forked
    process: ``progress(strategy, elapsed_s)`` is called a few times a
    second while it runs, and a baseline (not gpp) still running after
    ``baseline_time_limit_s`` is killed and becomes the row
    ``"stopped after S s"``. ``plans``, when given, receives each found
    plan by strategy name.
    """
    _check_batch_size(batch_size)
    if baseline_time_limit_s is not None and not baseline_time_limit_s > 0:
        raise InputError(f"the baseline time limit must be positive, got {baseline_time_limit_s}")
    isolate = baseline_time_limit_s is not None or progress is not None
    rows = []
    layouts = options.tp != 1 or options.shard != "none"  # then each strategy's PP-only row follows its own
    pp_only = replace(options, tp=1, shard="none")
    for strategy in STRATEGY_NAMES:
        for name, opts in ((strategy, options), (f"{strategy} pp-only", pp_only))[:2 if layouts else 1]:
            args = (model_id, graph, cluster, batch_size, strategy, opts)
            if isolate:
                row, plan = _row_in_child(args, strategy, None if strategy == "gpp" else baseline_time_limit_s,
                                          progress)
            else:
                row, plan = _plan_row(*args)
            row = {**row, "strategy": name}
            if plans is not None and plan is not None:
                plans[name] = plan
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
