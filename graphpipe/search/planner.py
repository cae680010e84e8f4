"""From an op graph to a complete, simulated :class:`~graphpipe.plan.Plan` (DESIGN §1, §6, §7).

``make_plan`` is the one road every strategy takes, so their plans are
comparable: contract non-series-parallel regions (recorded in
``plan.merged``), partition with the strategy, schedule with the strategy's
own schedule (gpp: graph-1F1B; pipedream/piper: 1F1B; gpipe: fill-drain)
unless ``schedule`` overrides it (``"cpsat"`` co-optimises micro-batch sizes
and the action order, :mod:`graphpipe.search.cpsat`), validate, simulate,
and refuse plans whose simulated peak memory exceeds the device memory.
Re-materialization (``options.recompute``, default :data:`DEFAULT_RECOMPUTE`)
is a planning decision: ``none``/``all`` are passed to the strategy,
``auto`` searches both ways and keeps it only on the stages that need it
(:func:`_auto_recompute`). Once the schedule is known, every re-materializing
stage of gpp, PipeDream and Piper gets the checkpoints that lower its peak
memory most at its simulated in-flight count (:func:`place_checkpoints`; a
data-parallel stage with one micro-batch in flight is where they matter);
GPipe re-runs whole stages, as its paper does.

With ``options.host`` (devices time-sharing one host's cores, e.g. CPU
ranks on a smaller machine) every strategy scores its candidates by the
shared-host simulation, and ``make_plan`` searches on 1..N devices and keeps
the fastest there: on a saturated host an extra rank adds transfers and
all-reduces but no compute. Idle ranks get no stage.

``compare`` runs all four strategies on the same inputs; a strategy that
fails becomes a row carrying its error instead of stopping the others.

Plans are deterministic: the same inputs give byte-identical plan JSON apart
from the timing fields (``search.time_s`` and the partitioner's own
``*time_s`` statistics).

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3), 4e6, 1e5, 1e4) for n in "sabt"]
>>> g = OpGraph.build("diamond", ops, [("s", "a", 1e4), ("s", "b", 1e4), ("a", "t", 1e4), ("b", "t", 1e4)])
>>> plan = make_plan("diamond.json", g, preset("v100", 4), 32)
>>> plan.strategy, plan.schedule.name, plan.predicted["throughput"] > 0
('gpp', 'graph-1f1b', True)
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from graphpipe import costs
from graphpipe.cluster import Cluster
from graphpipe.errors import GraphpipeError, InfeasibleError, InputError
from graphpipe.graph import OpGraph
from graphpipe.plan import Plan
from graphpipe.search import DEFAULT_SCHEDULES, STRATEGIES, get_strategy
from graphpipe.stages import StageGraph
from graphpipe.search.common import SearchOptions, SearchResult, simulated
from graphpipe.sp import make_series_parallel

__all__ = ["make_plan", "compare", "strip_recompute", "place_checkpoints", "COMPARE_KEYS", "TIMING_KEYS", "DEFAULT_RECOMPUTE"]

log = logging.getLogger(__name__)

COMPARE_KEYS = ("strategy", "feasible", "throughput", "iteration_time_s", "search_time_s", "num_stages", "depth",
                "peak_memory_bytes", "error")
"""Keys of every row :func:`compare` returns (the CLI's ``--compare --json`` rows)."""

DEFAULT_RECOMPUTE = {"gpp": "auto", "pipedream": "auto", "piper": "auto", "gpipe": "all"}
"""Re-materialization when ``SearchOptions.recompute`` is None: GPipe as in its paper, the others where needed."""

RECOMPUTE_AWARE = ("gpp", "gpipe")
"""Strategies whose search costs re-materialization (time and memory); PipeDream's and Piper's DPs do not yet."""

TIMING_KEYS = ("time_s", "partition_time_s", "schedule_time_s", "cpsat_time_s")
"""``plan.search`` keys that hold wall-clock times: the only fields two identical runs may differ in."""


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch size must be a positive integer, got {batch_size!r}")
    return batch_size


def make_plan(model_id: str, graph: OpGraph, cluster: Cluster, batch_size: int, strategy: str = "gpp",
              options: SearchOptions = SearchOptions(), schedule: str | None = None,
              time_limit_s: float = 10.0, progress=None, monotone: bool = True) -> Plan:
    """Partition, schedule and simulate ``graph`` on ``cluster``; see the module docstring.

    ``progress(best_s, bound_s)`` is called on every improving CP-SAT solution
    (``schedule="cpsat"`` only); the CLI passes one that writes to stderr.

    With ``monotone`` (the default; not for :data:`EXACT_DEVICE_STRATEGIES`) the plan is the fastest the strategy
    finds on the cluster's device count, every count up to
    :data:`MONOTONE_EXACT_UP_TO` and the powers of two below it
    (:func:`_over_device_counts`), so adding devices never gives a slower
    plan up to 8 devices and between powers of two up to
    :data:`MONOTONE_MAX_DEVICES`;
    ``plan.search["device_counts_tried"]`` lists the counts searched. gpp also
    ranks the sequential partitioners' plans on the same devices by the same
    simulation (:data:`SPP_CANDIDATES`) and keeps the fastest;
    ``plan.search["space"]`` says whose space the winner came from.

    Raises :class:`InputError` for bad arguments and :class:`InfeasibleError`
    when no plan fits in device memory.
    """
    _check_batch_size(batch_size)
    get_strategy(strategy)
    if (schedule or "").lower() in ("1f1b-async", "2bw"):  # scored as a steady state, not one flushed iteration
        raise InputError(f"plan with schedule='1f1b' and then graphpipe.sched.async_pipe.with_async for "
                         f"{schedule!r} (graphpipe plan --schedule {schedule} does this)")
    if options.host is not None and (schedule or "").lower() == "cpsat":
        raise InputError("the CP-SAT schedule models dedicated devices, not a shared host; "
                         "drop the host option or pick another schedule")
    started = time.perf_counter()
    one = lambda n, beat=None: _plan_on(model_id, graph, cluster, batch_size, strategy, options,  # noqa: E731
                                        schedule, time_limit_s, progress, n, beat)
    with _collector_paused():
        if not monotone or strategy in EXACT_DEVICE_STRATEGIES or options.host is not None or \
                (schedule or "").lower() == "cpsat" or not 1 < cluster.num_devices <= MONOTONE_MAX_DEVICES:
            plan = one(cluster.num_devices)
            plan = replace(plan, search={**plan.search, "device_counts_tried": [cluster.num_devices]})
        else:
            plan = _over_device_counts(one, graph, cluster, batch_size, options)
    return replace(plan, search={**plan.search, "time_s": time.perf_counter() - started})


@contextmanager
def _collector_paused():
    """Pause CPython's cyclic garbage collector while a search runs.

    The searches build many small objects that live until they end (the DPs'
    memo tables); their growth triggers full collections, which walk every
    object of the process -- torch's modules and the model included: about
    0.18 s of a 0.8 s gpp search on mmt (issue 16). The searches' objects
    hold no reference cycles, so reference counting frees them all the same;
    the collector runs again, as configured, once the search returns.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


EXACT_DEVICE_STRATEGIES = ("pipedream",)
"""Strategies planned on exactly the cluster's devices: PipeDream's optimizer always spreads its
stages over all N machines (its DP splits m machines between the last stage and the rest, never
leaving one idle), and ``--strategy pipedream`` must give the real optimizer's answer (issue 14:
same replica counts and time per stage); searching fewer devices by our simulator would replace
it with a plan PipeDream never makes. gpp still ranks PipeDream's plan among its candidates."""

MONOTONE_EXACT_UP_TO = 8
"""Device counts searched below the cluster's own: every count up to this one, and the powers of two.

Each count is a full search, so trying every count up to 32 costs gpp up to
25 searches on dlrm; with this set a plan is never slower than the plan on
any count up to 8 or any power of two below its own (so exactly monotone up
to 8 devices and along powers of two), at a few searches' cost."""

MONOTONE_MAX_DEVICES = 16
"""Past this many devices only the cluster's own count is searched. Each extra count is a full search
and the perfect-scaling bound rarely stops early on communication-bound models: at 32 V100s dlrm
tried 32, 16, 8, 7 (7.7 s against 1.9 s for one count) and candle-uno seven counts (10 s against
1.4 s), for the same plan. gpp's DP already places a plan on fewer than N devices when that meets
its target on fewer."""


def _work_bound(graph: OpGraph, batch_size: int) -> float:
    """Seconds of compute one iteration needs on one device: a lower bound of ``n`` devices' iteration times ``n``.

    Every op runs ``fwd(b) + bwd(b)`` on each of its ``r`` replicas for each of
    the ``B / (b r)`` or more micro-batches that reach it, at least
    ``fwd(B) + bwd(B)`` of device time in all (the coefficients are >= 0);
    re-materialization, transfers and idle time only add to it.
    """
    return sum(o.fwd(batch_size) + o.bwd(batch_size) for o in graph.ops)


def _over_device_counts(one, graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions) -> Plan:
    """The fastest of ``one(n)`` over the device counts ``n <= N`` the strategy may use (ties: fewer devices).

    Counts are tried from ``N`` down and the search stops at the first ``n``
    whose perfect-scaling bound (:func:`_work_bound`) cannot beat the plan in
    hand -- no smaller count can either. Past :data:`MONOTONE_EXACT_UP_TO`
    devices only powers of two are tried below ``N`` (each count is a full
    search).
    """
    n_max = cluster.num_devices
    counts = [n for n in range(n_max, 0, -1)
              if n == n_max or (n <= MONOTONE_EXACT_UP_TO or n & (n - 1) == 0)
              and (not options.power_of_two or n & (n - 1) == 0)]
    work = _work_bound(graph, batch_size)
    best, error, tried = None, None, []
    for n in counts:
        if best is not None and work > 0 and n * batch_size / work <= best.predicted["throughput"] * (1 + 1e-9):
            break
        tried.append(n)
        try:
            plan = one(n, None if best is None else best.predicted["iteration_time_s"])
        except InfeasibleError as exc:
            error = error or exc
            continue
        except GraphpipeError as exc:  # a strategy's own failure on a smaller count must not cost the larger
            if n == n_max:
                raise
            log.warning("%s on %d of %d devices failed (%s); that count is skipped", graph.name, n, n_max, exc)
            continue
        if best is None or plan.predicted["throughput"] >= best.predicted["throughput"] * (1 + 1e-9) or (
                plan.predicted["throughput"] >= best.predicted["throughput"] * (1 - 1e-9)
                and len(plan.stage_graph.devices_used()) < len(best.stage_graph.devices_used())):
            best = plan
    if best is None:
        raise error
    search = {**best.search, "device_counts_tried": tried}
    if "unused_devices" in search:  # the partitioner counted against the count it searched, not the cluster's
        search["unused_devices"] = n_max - len(best.stage_graph.devices_used())
    return replace(best, search=search)


SPP_CANDIDATES = ("pipedream", "piper")
"""Sequential partitioners whose best plan gpp also ranks (never worse than them by construction)."""

SPP_PIPER_DOWNSETS = 10_000
"""Piper's plan is a gpp candidate only on graphs with at most this many downsets, and so (Piper's own rule,
50 pairs per downset) at most 500,000 downset pairs: its search grows with them. That admits gnmt's profile
(2,198 downsets, 443,809 pairs: about 7 s per device count on 2 cores, so gpp is then never worse than
Piper there) and leaves out mmt (6,563 downsets but 4.1 million pairs: 24-511 s at 4-32 devices)."""


def _plan_on(model_id, graph, cluster, batch_size, strategy, options, schedule, time_limit_s, progress,
             devices: int, beat: float | None = None) -> Plan:
    """The strategy's plan using at most ``devices`` of the cluster's (gpp: with the sequential candidates).

    ``beat``: the iteration time of a plan in hand; gpp may then skip the
    parts of its space that provably cannot beat it (and raises
    :class:`InfeasibleError` when nothing can).
    """
    plan = _make_plan_at(model_id, graph, cluster, batch_size, strategy, options, schedule, time_limit_s, progress,
                         devices, beat)
    if strategy != "gpp" or schedule is not None or options.host is not None:
        return plan
    best, space = plan, "gpp"
    for other in SPP_CANDIDATES:
        opts = options if other != "piper" else replace(options, max_downsets=min(options.max_downsets,
                                                                                   SPP_PIPER_DOWNSETS))
        try:
            cand = _make_plan_at(model_id, graph, cluster, batch_size, other, opts, None, time_limit_s, None, devices)
        except GraphpipeError as exc:  # refused (downsets) or infeasible: not a candidate
            log.info("gpp: no %s candidate: %s", other, exc)
            continue
        if cand.predicted["throughput"] > best.predicted["throughput"] * (1 + 1e-9):
            best, space = cand, other
    if best is plan:
        return replace(plan, search={**plan.search, "space": "gpp"})
    own = plan.search
    search = {**best.search, "strategy": "gpp", "space": space, "recompute": own["recompute"],
              "gpp_throughput": plan.predicted["throughput"]}
    return replace(best, strategy="gpp", search=search)


def _make_plan_at(model_id: str, graph: OpGraph, cluster: Cluster, batch_size: int, strategy: str,
                  options: SearchOptions, schedule: str | None, time_limit_s: float, progress,
                  devices: int, beat: float | None = None) -> Plan:
    from graphpipe.sched import make_schedule, predicted_figures, simulate, validate_schedule

    partition = get_strategy(strategy)
    if strategy == "gpp" and options.host is None:  # the one strategy that prunes by a plan in hand
        from graphpipe.search import gpp

        partition = lambda g, c, b, o, beat=beat, **kw: gpp.partition(g, c, b, o, beat_iteration_s=beat,  # noqa: E731
                                                                      **kw)
    started = time.perf_counter()
    sp_graph, merged = make_series_parallel(graph)
    recompute = options.recompute or DEFAULT_RECOMPUTE[strategy]
    options = replace(options, recompute=recompute)
    base = partition
    if strategy not in RECOMPUTE_AWARE:
        # Its DP costs stages without re-materialization: ``all`` marks every stage of its plan
        # (which only lowers memory), ``auto`` cannot find more than the plain search.
        partition = lambda g, c, b, o: _mark_all(base(g, c, b, replace(o, recompute="none")), o)  # noqa: E731
    elif recompute == "auto":
        partition = lambda g, c, b, o: _auto_recompute(base, g, c, b, o, schedule,  # noqa: E731
                                                       prunes=strategy == "gpp" and options.host is None, beat=beat)
    if options.host is None:
        result = partition(sp_graph, replace(cluster, num_devices=devices), batch_size, options)
        if devices < cluster.num_devices:  # the devices past ``devices`` hold no stage
            result = replace(result, stage_graph=replace(result.stage_graph, num_devices=cluster.num_devices))
    else:
        result = _best_device_count(partition, sp_graph, cluster, batch_size, options, schedule)
    partitioned = time.perf_counter()
    sg = result.stage_graph
    schedule_name = (schedule or result.schedule_name or DEFAULT_SCHEDULES[strategy]).lower()
    if schedule_name == "cpsat" and any(st.round_robin for st in sg.stages):
        raise InputError(f"the CP-SAT schedule models replicas that split micro-batches, not {strategy}'s "
                         f"round-robin replicas (1F1B-RR); use its own schedule (1f1b)")
    search: dict[str, Any] = {"strategy": strategy, "recompute": recompute, **dict(result.stats),
                              "precision": cluster.device.precision, "precision_from": "cluster"}
    search["recompute_stages"] = [s.id for s in sg.stages if s.recompute]
    search["partition_time_s"] = partitioned - started
    base_name = result.schedule_name if schedule_name == "cpsat" else schedule_name
    sched = make_schedule(base_name, sg, cluster, validate=False)  # simulate() runs the validator's checks
    timeline = simulate(sg, sched, cluster, host=options.host)
    if strategy != "gpipe" and any(s.recompute for s in sg.stages):
        placed = place_checkpoints(sg, timeline.in_flight)
        if placed != sg:  # segments change memory only, so the schedule stands
            sg = placed
            timeline = simulate(sg, sched, cluster, host=options.host)
        search["recompute_segments"] = {str(s.id): len(s.checkpoints) + 1 for s in sg.stages if s.recompute}
    predicted = predicted_figures(timeline)
    if graph.shared:  # tied parameters split across stages: copies and their gradient all-reduce (search/tied.py)
        from graphpipe.search.tied import charge_shared_params

        predicted = charge_shared_params(predicted, sg, graph.shared, merged, cluster)
    plan = Plan(model=model_id, stage_graph=sg, cluster=cluster, strategy=strategy, schedule=sched,
                predicted=predicted, search=search, merged=merged)
    if schedule_name == "cpsat":
        from graphpipe.search.cpsat import optimize_plan

        plan = optimize_plan(plan, time_limit_s=time_limit_s, num_workers=2, seed=0,
                             per_stage_micro_batch=options.per_stage_micro_batch, progress=progress)
        validate_schedule(plan.stage_graph, plan.schedule)
        search = {**search, **dict(plan.search)}
    search["schedule"] = plan.schedule.name
    search["schedule_time_s"] = time.perf_counter() - partitioned
    search["time_s"] = time.perf_counter() - started
    peak = float(plan.predicted.get("max_peak_memory_bytes", 0.0))
    if peak > cluster.memory_bytes:
        worst = max(range(len(plan.predicted["peak_memory_bytes"])), key=lambda d: plan.predicted["peak_memory_bytes"][d])
        raise InfeasibleError(
            f"{strategy} plan with the {plan.schedule.name} schedule needs {peak / 1e9:.3g} GB on device {worst} "
            f"(simulated peak) but devices have {cluster.memory_bytes / 1e9:g} GB; raise --memory-gb or add devices")
    return replace(plan, search=search)


def _mark_all(result: SearchResult, options: SearchOptions) -> SearchResult:
    if options.recompute != "all":
        return result
    sg = result.stage_graph
    return replace(result, stage_graph=replace(sg, stages=tuple(replace(s, recompute=True) for s in sg.stages)))


def _auto_recompute(partition, graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions,
                    schedule: str | None, prunes: bool = False, beat: float | None = None) -> SearchResult:
    """``--recompute auto``: re-materialize only the stages that need it (DESIGN §11).

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
            name = schedule if schedule and schedule != "cpsat" else plain.schedule_name
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
    schedule_name = schedule if schedule and schedule != "cpsat" else full.schedule_name
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
    """
    order = sorted((s.id for s in sg.stages if s.recompute),
                   key=lambda i: (-sg.recompute_time(i) / sg.stages[i].micro_batch_size, i))
    for stage_id in order:
        stages = tuple(replace(s, recompute=False) if s.id == stage_id else s for s in sg.stages)
        trial = replace(sg, stages=stages)
        if simulated(trial, cluster, schedule_name, host)[1]:
            sg = trial
    return sg


def place_checkpoints(sg: StageGraph, in_flight) -> StageGraph:
    """Every re-materializing stage cut into the segments that minimize its activation peak with
    ``in_flight[stage]`` micro-batches alive (:func:`graphpipe.costs.best_checkpoints`; whole stages where
    cutting does not lower it). Time is unchanged: each segment's forward runs once more inside B, as the
    whole stage's would.
    """
    stages = tuple(replace(s, checkpoints=costs.best_checkpoints(sg.graph, s.op_ids, sg.stage_sums(s.id).inputs,
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
    return {"strategy": strategy, "feasible": True, "throughput": p["throughput"],
            "iteration_time_s": p["iteration_time_s"], "search_time_s": plan.search["time_s"],
            "num_stages": plan.stage_graph.num_stages, "depth": plan.stage_graph.depth(),
            "peak_memory_bytes": p["max_peak_memory_bytes"], "error": None}


def _plan_row(model_id: str, graph: OpGraph, cluster: Cluster, batch_size: int, strategy: str,
              options: SearchOptions) -> tuple[dict[str, Any], Plan | None]:
    started = time.perf_counter()
    try:
        plan = make_plan(model_id, graph, cluster, batch_size, strategy, options)
    except GraphpipeError as exc:
        log.info("compare: %s failed: %s", strategy, exc)
        return _row(strategy, None, time.perf_counter() - started, str(exc)), None
    return _row(strategy, plan, plan.search["time_s"]), plan


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
    for strategy in ("gpp", "pipedream", "piper", "gpipe"):
        assert strategy in STRATEGIES
        args = (model_id, graph, cluster, batch_size, strategy, options)
        if isolate:
            row, plan = _row_in_child(args, strategy, None if strategy == "gpp" else baseline_time_limit_s, progress)
        else:
            row, plan = _plan_row(*args)
        if plans is not None and plan is not None:
            plans[strategy] = plan
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
