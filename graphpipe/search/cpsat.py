"""CP-SAT co-optimisation of per-stage micro-batch sizes and the schedule (docs/design.md#cp-sat-co-optimisation).

GraphPipe's graph-1F1B (§5, Alg. 2) fixes one micro-batch size and a
structural warm-up rule; the paper notes per-stage sizes gave incremental
gains. This module asks the exact question instead: given a stage graph
(stages, device sets, edges), the cluster and the batch size, which
micro-batch size per stage and which order of F/B tasks on every device
minimise the iteration time, under device memory? The model
(:mod:`graphpipe.search.cpsat_model`) mirrors the simulator's semantics, so
the solver's makespan equals the simulated one up to the documented time
rounding; the solver's proven bound gives every plan an optimality gap.

The OR-Tools habits: the model is built apart from solving;
the graph-1F1B schedule is replayed in the model's integer time and fed back
as a complete hint (and its makespan caps the horizon); ``max_time_in_seconds``,
``num_workers`` and ``random_seed`` are always set; OPTIMAL and FEASIBLE are
both accepted and the bound is reported. When sizes are free, a first phase
orders the tasks at the input sizes or at the best single size for all
stages (:data:`ORDER_FIRST_SHARE`); its makespan then prunes every size
whose own lower bound (fill, drain, round trip, memory:
:func:`graphpipe.search.cpsat_model.size_lower_bounds`) exceeds it, and the
same bounds, linear in the size literals, lift the solver's bound, which
narrows the reported gap when many sizes are free (``python -m
graphpipe.evals.bench_cpsat`` measures it; see evals/REPORT.md).

Reproducibility: a solve that proves optimality within the limit always
returns the same makespan, but with several workers the schedule among equal
optima depends on thread timing (two runs of the same plan gave different
orders and a different peak memory on one device). So an OPTIMAL answer is
made canonical (:func:`_canonical_solve`): the optimum M is re-solved on a
model built only from the inputs (no incumbent, no timing-dependent hint or
pruning), constrained to makespan <= M, on one worker with a
*deterministic* time limit (:data:`CANONICAL_SHARE` of the limit), stopping
at the first solution. One worker with a deterministic limit is
deterministic, so the same inputs and seed give the same sizes and order.
Should it find nothing in its budget, the parallel solver's schedule is kept
(same makespan) and ``canonical`` is False in the result. A FEASIBLE answer
(stopped by the time limit) still depends on timing. CP-SAT's deterministic
parallel mode (``interleave_search`` with a deterministic time limit) was
tried for the whole solve and rejected: on a long transformer chain it
stopped above the optimum well after the default search had proven it.

Usage
-----
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.stages import Stage, StageGraph
>>> from graphpipe.cluster import preset
>>> ops = [Op(n, "x", Affine(1e-4, 1e-3), Affine(2e-4, 2e-3), act_bytes=1e6) for n in "ab"]
>>> g = OpGraph.build("c", ops, [("a", "b", 1e4)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 2)], 4, 2)
>>> res = solve(sg, preset("v100", 2), time_limit_s=5, num_workers=1)
>>> res.status, res.makespan_s <= res.heuristic_makespan_s, res.gap < 1e-3
('OPTIMAL', True, True)

From the command line: ``graphpipe plan mmt --devices 8 --schedule cpsat
--time-limit 30`` or ``graphpipe simulate PLAN --schedule cpsat``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Sequence

from ortools.sat.python import cp_model

from graphpipe.actions import Action, Schedule
from graphpipe.cluster import Cluster
from graphpipe.errors import InfeasibleError, InputError, ScheduleError
from graphpipe.plan import Plan
from graphpipe.sched import gpipe, graph_1f1b, graph_zb, predicted_figures, simulate, validate_schedule
from graphpipe.stages import StageGraph

from graphpipe.search.cpsat_model import (
    ModelData, add_hint, build_model, check_memory, memory_peaks, model_data, prune_sizes, replay,
    rounding_slack, schedule_from_starts, stage_candidates,
)

__all__ = ["CpsatResult", "CpsatOptions", "ORDER_FIRST_SHARE", "solve", "optimize_plan", "heuristic_schedule", "progress_writer",
           "split_allowed"]

log = logging.getLogger(__name__)

Progress = Callable[[float, float], None]
"""``progress(best_s, bound_s)``: best makespan found so far (inf before the
first) and the proven lower bound, both in seconds of the rounded model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CpsatResult:
    stage_graph: StageGraph
    """The input stage graph with the chosen micro-batch sizes."""
    schedule: Schedule
    makespan_s: float
    """Simulated iteration time of ``schedule`` (never above the solver's own value)."""
    lower_bound_s: float
    """Proven lower bound on the iteration time of any schedule in the model's space, rounding slack removed."""
    gap: float
    """(makespan - lower bound) / makespan."""
    status: str
    """CP-SAT status: OPTIMAL, FEASIBLE or UNKNOWN (no solution in time: the heuristic is returned)."""
    solve_time_s: float
    heuristic_makespan_s: float
    """Simulated iteration time of the warm start (graph-1F1B at the input sizes)."""
    used_heuristic: bool
    """True when the returned schedule is the warm start's (graph-1F1B or ``hint_schedule``), not the solver's."""
    message: str
    solver_makespan_s: float | None = None
    """The solver's objective in seconds (rounded-up durations); None when it found nothing."""
    time_unit_s: float = 0.0
    """Seconds per integer tick of the model."""
    rounding_slack_s: float = 0.0
    """Upper bound on ``solver_makespan_s - makespan_s`` from rounding durations up."""
    pruned_sizes: tuple[tuple[int, ...], ...] = ()
    """Per stage, the candidate sizes left out of the full model because no schedule using
    them can beat the warm start (:func:`graphpipe.search.cpsat_model.prune_sizes`)."""
    canonical: bool = False
    """True when the schedule is the canonical one among the optima (reproducible; see the module docstring)."""


def progress_writer(stream, min_interval_s: float = 1.0) -> Progress:
    """A ``progress`` function for the CLI: one line per update on ``stream``, at most
    one per ``min_interval_s`` unless the incumbent improved (library code never prints).

    >>> import io
    >>> out = io.StringIO(); report = progress_writer(out)
    >>> report(0.5, 0.4); out.getvalue()
    'cpsat: best 0.5 s, bound 0.4 s, gap 20.0%\\n'
    """
    last = {"time": -math.inf, "best": math.inf}

    def report(best_s: float, bound_s: float) -> None:
        now = time.monotonic()
        if best_s >= last["best"] and now - last["time"] < min_interval_s:
            return
        last.update(time=now, best=best_s)
        gap = f"{100 * (best_s - bound_s) / best_s:.1f}%" if 0 < best_s < math.inf else "-"
        stream.write(f"cpsat: best {best_s:.6g} s, bound {bound_s:.6g} s, gap {gap}\n")
        stream.flush()

    return report


def heuristic_schedule(sg: StageGraph, cluster: Cluster, split: bool = False) -> Schedule:
    """The warm start: graph-1F1B (GraphPipe Alg. 2), or GPipe where stages share devices; with ``split``
    (zero bubble) graph-ZB, or GPipe with each B split in place into I, W."""
    try:
        return graph_zb(sg, cluster) if split else graph_1f1b(sg, cluster)
    except ScheduleError:
        plain = gpipe(sg)
        if not split:
            return plain
        return Schedule.from_lists(plain.name, [[x for a in acts for x in (
            (Action(a.stage_id, "I", a.mb_id), Action(a.stage_id, "W", a.mb_id)) if a.kind == "B" else (a,))]
            for acts in plain.device_actions])


def split_allowed(sg: StageGraph) -> bool:
    """Whether the CP-SAT model may split backwards into I and W: no stage re-materializes (the model
    has no interval for a split stage's re-run forward)."""
    return not any(st.recompute for st in sg.stages)


class _Callback(cp_model.CpSolverSolutionCallback):
    """Forwards each improving solution to the caller's ``progress`` (library code never prints)."""

    def __init__(self, progress: Progress, unit_s: float):
        super().__init__()
        self._progress = progress
        self._unit = unit_s
        self._lock = threading.Lock()
        self.best = math.inf

    def on_solution_callback(self) -> None:
        with self._lock:
            self.best = self.objective_value
            self._progress(self.best * self._unit, max(0.0, self.best_objective_bound) * self._unit)

    def on_bound(self, bound: float) -> None:
        with self._lock:
            self._progress(self.best * self._unit, max(0.0, bound) * self._unit)


def _check_args(time_limit_s: float, num_workers: int, seed: int) -> None:
    if not (isinstance(time_limit_s, (int, float)) and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise InputError(f"CP-SAT time limit must be a positive number of seconds, got {time_limit_s!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise InputError(f"CP-SAT num_workers must be a positive integer, got {num_workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"CP-SAT seed must be an integer, got {seed!r}")


def _figures(sg: StageGraph, schedule: Schedule, cluster: Cluster) -> dict:
    return predicted_figures(simulate(sg, schedule, cluster))


def _fits(figures: dict, cluster: Cluster) -> bool:
    peaks = figures.get("peak_memory_bytes") or [0.0]
    return max(peaks) <= cluster.memory_bytes * (1 + 1e-9)


def _with_sizes(sg: StageGraph, sizes: Sequence[int]) -> StageGraph:
    """The same stage graph (edges, flags) with new micro-batch sizes."""
    return replace(sg, stages=tuple(replace(st, micro_batch_size=b) for st, b in zip(sg.stages, sizes)))


def _infeasible_message(data: ModelData, memory_bytes: float) -> str:
    """Name the device whose state plus one micro-batch of each of its stages is tightest."""
    sg = data.sg

    def one_each(gi: int) -> float:
        return sum(sg.act_bytes_per_sample(s) * data.candidates[s][0] / sg.stages[s].num_replicas
                   for s in data.group_stages[gi])

    worst = max(range(len(data.groups)), key=lambda gi: data.state[gi] + one_each(gi))
    act = one_each(worst)
    return (f"CP-SAT proved that no schedule fits device memory: device {data.groups[worst][0]} (stages "
            f"{', '.join(map(str, data.group_stages[worst]))}) needs {data.state[worst] + act:.4g} bytes for model "
            f"state {data.state[worst]:.4g} plus one smallest micro-batch per stage {act:.4g}, and other micro-batches "
            f"must stay in flight meanwhile, but has {memory_bytes:.4g}; use more devices or smaller micro-batches")


CANONICAL_SHARE = 0.2
"""Share of the time limit reserved, in CP-SAT's deterministic time, for making an OPTIMAL schedule canonical."""

ORDER_FIRST_SHARE = 0.25
"""With free micro-batch sizes, this share of the time limit first orders the
tasks at fixed sizes (the input's, or one size for all stages where graph-1F1B
runs faster with it): a model without size choices, often proven optimal in
seconds, whose schedule then hints the full model and prunes its sizes.
Without it the full model's search can stall above that schedule and stop
FEASIBLE with a wide gap where the two phases prove the optimum."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CpsatOptions:
    """How :func:`solve` searches; checked on construction."""

    candidate_sizes: Sequence[int] | None = None
    """Micro-batch sizes to choose from (default: the divisors of the batch size), filtered per stage to sizes
    divisible by its replica count; each stage's current size is always a candidate."""
    time_limit_s: float = 10.0
    """Wall-clock limit of the whole call."""
    num_workers: int = 2
    """CP-SAT search workers."""
    seed: int = 0
    """CP-SAT's random seed."""
    progress: Progress | None = None
    """Called on every improving solution and bound."""
    hint_schedule: Schedule | None = None
    """Warm start instead of graph-1F1B (it must be a valid schedule of the stage graph)."""
    per_stage_micro_batch: bool = True
    """Let each stage choose its size; False keeps the current sizes (order only)."""
    uniform_size: bool = False
    """Every stage picks one common size."""
    memory: Literal["cumulative", "reservoir"] = "cumulative"
    """Encoding of the activation-memory limit (the same constraint; :mod:`graphpipe.search.cpsat_model`)."""
    order_first: bool = True
    """Spend :data:`ORDER_FIRST_SHARE` of the limit ordering tasks at fixed sizes first, when sizes are free."""
    prune: bool = True
    """Leave out of the full model every size no schedule faster than the warm start can use."""
    canonical: bool = True
    """Re-solve an OPTIMAL answer deterministically so the same inputs give the same schedule."""
    split_backward: bool = False
    """Zero bubble: every backward may be two tasks, I and W, warm-started from graph-ZB."""

    def __post_init__(self) -> None:
        _check_args(self.time_limit_s, self.num_workers, self.seed)
        if self.memory not in ("cumulative", "reservoir"):
            raise InputError(f"CP-SAT memory encoding must be 'cumulative' or 'reservoir', got {self.memory!r}")


@dataclass(frozen=True, slots=True)
class _Incumbent:
    """The best schedule known before the full solve: returned if the solver does no better."""

    stage_graph: StageGraph
    schedule: Schedule
    makespan_s: float
    fits: bool
    name: str
    solver_makespan_s: float | None = None


@dataclass(slots=True)
class _FullModel:
    """Phase 2's model and what its answer is read against."""

    data: ModelData
    cm: Any
    slack: float
    """Rounding slack over every candidate size (the bound must also cover pruned ones)."""
    pruned: dict[tuple[int, int], int]


def solve(sg: StageGraph, cluster: Cluster, options: CpsatOptions | None = None, **overrides: Any) -> CpsatResult:
    """Choose each stage's micro-batch size and every device's F/B order minimising the makespan.

    ``options`` (:class:`CpsatOptions`; keyword ``overrides`` replace its
    fields) say how. With ``prune``, sizes that no schedule faster than the
    warm start can use are left out of the full model (listed in
    ``pruned_sizes``); the optimum and the bound stay those of the full
    model: any schedule with a pruned size is slower than the warm start, so
    the full model's optimum is at least min(warm start, pruned model's
    optimum) = the pruned model's optimum, and its bound bounds it too. With
    ``split_backward``, an unsplit schedule is one of the split model's
    solutions (W right after its I), so up to time rounding it is never
    worse, and its bound covers the split schedules.

    Raises :class:`InfeasibleError` when memory cannot fit under any schedule.
    When the time limit is too short to find anything, the heuristic is
    returned with ``used_heuristic=True`` and status UNKNOWN. The result is
    never slower than the warm start.

    >>> from graphpipe.graph import Op, OpGraph, Affine
    >>> from graphpipe.stages import Stage
    >>> from graphpipe.cluster import preset
    >>> g = OpGraph.build("c", [Op(n, "x", Affine(1e-3, 1e-4), Affine(2e-3, 2e-4)) for n in "ab"], [("a", "b", 1e4)])
    >>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 4, 2)
    >>> res = solve(sg, preset("v100", 2), candidate_sizes=[1, 2, 4], time_limit_s=5, num_workers=1)
    >>> res.status, [s.micro_batch_size for s in res.stage_graph.stages]   # fixed costs dominate: one big micro-batch
    ('OPTIMAL', [4, 4])
    """
    opts = replace(options or CpsatOptions(), **overrides)
    began = time.monotonic()
    _check_inputs(sg, cluster, opts)
    heuristic = opts.hint_schedule if opts.hint_schedule is not None else heuristic_schedule(sg, cluster,
                                                                                               opts.split_backward)
    validate_schedule(sg, heuristic)
    heuristic_figures = _figures(sg, heuristic, cluster)
    heuristic_ms = float(heuristic_figures["iteration_time_s"])
    incumbent = _Incumbent(sg, heuristic, heuristic_ms, _fits(heuristic_figures, cluster), heuristic.name)
    candidates = stage_candidates(sg, opts.candidate_sizes, per_stage=opts.per_stage_micro_batch)
    incumbent = _order_first(sg, cluster, candidates, heuristic, incumbent, opts)
    full = _full_model(sg, cluster, candidates, heuristic_ms, incumbent, opts)
    reserve = CANONICAL_SHARE * opts.time_limit_s if opts.canonical else 0.0
    solver, status = _run(full, opts, max(opts.time_limit_s - reserve - (time.monotonic() - began),
                                          0.1 * opts.time_limit_s))
    return _answer(sg, cluster, candidates, (heuristic, heuristic_ms), incumbent, full, solver, status, opts,
                   reserve, time.monotonic() - began)


def _check_inputs(sg: StageGraph, cluster: Cluster, opts: CpsatOptions) -> None:
    if cluster.num_devices != sg.num_devices:
        raise InputError(f"stage graph is for {sg.num_devices} devices but the cluster has {cluster.num_devices}; "
                         "build the cluster with the same device count")
    if opts.split_backward and not split_allowed(sg):
        raise InputError("split backward (I/W) needs stages without re-materialization; solve without it")


def _order_first(sg: StageGraph, cluster: Cluster, candidates, heuristic: Schedule, incumbent: _Incumbent,
                 opts: CpsatOptions) -> _Incumbent:
    """Phase 1 (sizes free only): order the tasks at the most promising sizes, the input's or one size for all
    stages, whichever graph-1F1B runs fastest; its schedule replaces the incumbent when it is no slower."""
    if not (opts.order_first and any(len(c) > 1 for c in candidates)):
        return incumbent
    start = _start_sizes(sg, cluster, candidates, heuristic, incumbent.makespan_s, opts.uniform_size,
                         opts.split_backward)
    if start is None:
        return incumbent
    start_sg, start_schedule = start
    try:
        first = solve(start_sg, cluster, opts, time_limit_s=opts.time_limit_s * ORDER_FIRST_SHARE,
                      candidate_sizes=None, hint_schedule=start_schedule, per_stage_micro_batch=False,
                      uniform_size=False, order_first=False, prune=True, canonical=False)
    except InfeasibleError:
        return incumbent  # these sizes cannot fit; smaller ones may
    if first.used_heuristic or first.makespan_s > incumbent.makespan_s:
        return incumbent
    sizes = [st.micro_batch_size for st in start_sg.stages]
    return _Incumbent(start_sg, first.schedule, first.makespan_s, True, f"CP-SAT at micro-batch sizes {sizes}",
                      first.solver_makespan_s)


def _full_model(sg: StageGraph, cluster: Cluster, candidates, heuristic_ms: float, incumbent: _Incumbent,
                opts: CpsatOptions) -> _FullModel:
    """Phase 2's model, hinted with the incumbent.

    A warm start that fits the model caps the horizon (domains shrink) and
    prunes the sizes that cannot beat it (see prune_sizes); one that does
    not fit (memory rounding) only hints.
    """
    def data_for(sizes):
        return model_data(sg, cluster, sizes, reference_s=heuristic_ms, uniform=opts.uniform_size,
                          split=opts.split_backward)

    data = data_for(candidates)
    check_memory(data, cluster.memory_bytes)
    slack = rounding_slack(data)
    warm = _replay_warm_start(data, incumbent.stage_graph, incumbent.schedule)
    upper = warm[1] if warm and warm[2] else None
    pruned: dict[tuple[int, int], int] = {}
    if upper is not None and opts.prune:
        kept, pruned = prune_sizes(data, upper)
        if pruned:
            data = data_for(kept)
    cm = build_model(data, memory=opts.memory, upper_bound=upper)
    if warm:
        add_hint(cm, [st.micro_batch_size for st in incumbent.stage_graph.stages], warm[0], warm[1])
    return _FullModel(data, cm, slack, pruned)


def _run(full: _FullModel, opts: CpsatOptions, seconds: float):
    """Solve the full model within ``seconds`` (what phase 1 and model building left, at least a tenth of the
    limit should phase 1 overrun), reporting progress; ``(solver, status)``."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = opts.num_workers
    solver.parameters.random_seed = opts.seed
    callback = None
    if opts.progress is not None:
        callback = _Callback(opts.progress, full.data.unit_s)
        solver.best_bound_callback = callback.on_bound
    log.info("cpsat: %d stages, %d optional tasks, tick %.0e s, limit %.1f s on %d workers",
             full.data.sg.num_stages, len(full.cm.interval), full.data.unit_s, opts.time_limit_s, opts.num_workers)
    return solver, solver.solve(full.cm.model, callback)


def _answer(sg: StageGraph, cluster: Cluster, candidates, warm_start: tuple[Schedule, float], incumbent: _Incumbent,
            full: _FullModel, solver, status, opts: CpsatOptions, reserve: float, solve_time: float) -> CpsatResult:
    """The result of the solve: the solver's schedule (canonical when OPTIMAL), or the incumbent when the
    solver found nothing or nothing better. ``warm_start``: the heuristic schedule and its simulated time."""
    heuristic, heuristic_ms = warm_start
    status_name = solver.status_name(status)
    data, cm, unit = full.data, full.cm, full.data.unit_s
    bound_ticks = solver.best_objective_bound
    lower_bound = max(0.0, math.floor(bound_ticks) * unit - full.slack) if 0 < bound_ticks < math.inf else 0.0
    pruned_sizes = tuple(tuple(sorted(b for (s, b) in full.pruned if s == stage)) for stage in range(sg.num_stages))
    common = dict(heuristic_makespan_s=heuristic_ms, time_unit_s=unit, rounding_slack_s=full.slack,
                  solve_time_s=solve_time, pruned_sizes=pruned_sizes)

    def fallback(status: str, why: str) -> CpsatResult:
        ms = incumbent.makespan_s
        note = "" if incumbent.fits else " (note: it exceeds device memory)"
        return CpsatResult(stage_graph=incumbent.stage_graph, schedule=incumbent.schedule, makespan_s=ms,
                           lower_bound_s=min(lower_bound, ms), gap=_gap(ms, lower_bound), status=status,
                           used_heuristic=incumbent.schedule is heuristic,
                           solver_makespan_s=incumbent.solver_makespan_s,
                           message=f"{why}; returning the {incumbent.name} schedule ({ms:.6g} s){note}", **common)

    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(_infeasible_message(data, cluster.memory_bytes))
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"cpsat model invalid (a bug): {cm.model.validate()}")
    if status != cp_model.OPTIMAL and status != cp_model.FEASIBLE:
        return fallback("UNKNOWN", f"CP-SAT found no schedule within the {opts.time_limit_s:g} s time limit "
                                   f"({status_name}); raise the time limit")

    is_canonical = False
    if opts.canonical and status == cp_model.OPTIMAL:
        found = _canonical_solve(sg, cluster, candidates, heuristic, heuristic_ms, opts.uniform_size, opts.memory,
                                 round(solver.objective_value), unit, opts.seed, reserve, opts.split_backward)
        if found is not None:
            data, cm, solver = found
            is_canonical = True
        else:
            log.warning("cpsat: no canonical schedule within %.1f s of deterministic time; keeping the solver's "
                        "(same makespan, order may differ between runs)", reserve)
    sizes = [next(b for b in data.candidates[s] if solver.boolean_value(cm.use[s, b])) for s in range(sg.num_stages)]
    starts = {(s, kind, j): solver.value(cm.start[s, sizes[s], kind, j])
              for s in range(sg.num_stages) for kind in data.kinds for j in range(data.num_mbs(sizes[s]))}
    new_sg = _with_sizes(sg, sizes)
    schedule = schedule_from_starts(data, sizes, starts)
    validate_schedule(new_sg, schedule)
    simulated = float(_figures(new_sg, schedule, cluster)["iteration_time_s"])
    solver_ms = solver.objective_value * unit
    if simulated > incumbent.makespan_s and incumbent.fits:
        # Rounding can make a different order look equal in ticks yet be a
        # hair slower exactly; never return something worse than the warm start.
        return fallback(status_name, f"CP-SAT's best schedule ({simulated:.6g} s simulated) is no better")
    lower_bound = min(lower_bound, simulated)
    gap = _gap(simulated, lower_bound)
    message = (f"CP-SAT {status_name} in {solve_time:.2f} s: iteration {simulated:.6g} s vs {heuristic.name} "
               f"{heuristic_ms:.6g} s, lower bound {lower_bound:.6g} s (gap {100 * gap:.2f}%), micro-batch sizes {sizes}")
    log.info("cpsat: %s", message)
    return CpsatResult(stage_graph=new_sg, schedule=schedule, makespan_s=simulated, lower_bound_s=lower_bound,
                       gap=gap, status=status_name, used_heuristic=False, message=message, solver_makespan_s=solver_ms,
                       canonical=is_canonical, **common)


def _canonical_solve(sg: StageGraph, cluster: Cluster, candidates, heuristic: Schedule, heuristic_ms: float,
                     uniform: bool, memory: str, optimum_ticks: int, unit_s: float, seed: int, budget_s: float,
                     split: bool = False):
    """The first schedule of makespan <= the optimum that one deterministic worker finds; None if none in budget.

    Everything it sees is a function of the inputs: the model is rebuilt from
    the candidates (not from the incumbent-pruned model), pruned by the
    optimum, and hinted with graph-1F1B; the limit is deterministic time.
    """
    data = model_data(sg, cluster, candidates, reference_s=heuristic_ms, uniform=uniform, split=split)
    if data.unit_s != unit_s:  # same inputs give the same tick; anything else is a bug worth not hiding
        return None
    kept, pruned = prune_sizes(data, optimum_ticks)
    if pruned:
        data = model_data(sg, cluster, kept, reference_s=heuristic_ms, uniform=uniform, split=split)
    cm = build_model(data, memory=memory, upper_bound=optimum_ticks)
    cm.model.add(cm.makespan <= optimum_ticks)
    warm = _replay_warm_start(data, sg, heuristic)
    if warm:
        add_hint(cm, [st.micro_batch_size for st in sg.stages], warm[0], warm[1])
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    solver.parameters.stop_after_first_solution = True
    solver.parameters.max_deterministic_time = max(budget_s, 1.0)
    solver.parameters.max_time_in_seconds = 4 * max(budget_s, 1.0) + 5  # a safety net only: det. time decides
    status = solver.solve(cm.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return data, cm, solver


def _start_sizes(sg: StageGraph, cluster: Cluster, candidates: Sequence[Sequence[int]], heuristic: Schedule,
                 heuristic_ms: float, uniform: bool, split: bool = False) -> tuple[StageGraph, Schedule] | None:
    """The sizes phase 1 orders: the input's, or one candidate size for every stage
    when graph-1F1B runs strictly faster with it within memory (the setting
    GraphPipe evaluates: one size for all stages). A good start matters twice:
    the full model is hinted with it and its makespan prunes sizes. None when
    the sizes must be uniform, the input's are not, and no uniform size fits."""
    mixed = len({st.micro_batch_size for st in sg.stages}) > 1
    best = (math.inf if uniform and mixed else heuristic_ms, sg, heuristic)
    for b in sorted(set(candidates[0]).intersection(*map(set, candidates[1:]))):
        trial = _with_sizes(sg, [b] * sg.num_stages)
        schedule = heuristic_schedule(trial, cluster, split)
        figures = _figures(trial, schedule, cluster)
        if _fits(figures, cluster) and figures["iteration_time_s"] < best[0]:
            best = (float(figures["iteration_time_s"]), trial, schedule)
    return None if best[0] == math.inf else (best[1], best[2])


def _gap(makespan: float, lower_bound: float) -> float:
    return max(0.0, (makespan - lower_bound) / makespan) if makespan > 0 else 0.0


def _replay_warm_start(data: ModelData, sg: StageGraph, schedule: Schedule):
    """``(starts, makespan, fits)`` of ``schedule`` in the model's integer time, or None
    when it is outside the model's space (uniform sizes exclude the input's mixed
    sizes, or its order breaks the micro-batch order the model imposes)."""
    sizes = [st.micro_batch_size for st in sg.stages]
    if any(b not in data.candidates[s] for s, b in enumerate(sizes)) or (data.uniform and len(set(sizes)) > 1):
        return None
    replayed = replay(data, sizes, schedule)
    if replayed is None:
        log.warning("cpsat: the warm-start schedule is outside the model's space; solving without a hint")
        return None
    starts, makespan = replayed
    fits = all(peak <= cap for peak, cap in zip(memory_peaks(data, sizes, starts), data.capacity))
    return starts, makespan, fits


def optimize_plan(plan: Plan, time_limit_s: float = 10.0, num_workers: int = 2, seed: int = 0,
                  candidate_sizes: Sequence[int] | None = None, per_stage_micro_batch: bool = True,
                  progress: Progress | None = None, split_backward: bool | None = None) -> Plan:
    """A new plan with CP-SAT's micro-batch sizes and schedule (named ``cpsat``).

    ``predicted`` comes from the simulator; ``search`` gains ``lower_bound_s``,
    ``gap``, ``cpsat_status``, ``cpsat_time_s``, ``heuristic_makespan_s``,
    ``cpsat_used_heuristic``, ``cpsat_message`` and ``cpsat_pruned_sizes``
    (stage id -> sizes left out as unable to beat the warm start). With
    ``per_stage_micro_batch=False`` every stage keeps its current size.
    ``split_backward`` (zero bubble's I/W, see :func:`solve`): ``None``, the
    default, splits wherever the stage graph allows it (:func:`split_allowed`);
    ``search["cpsat_split_backward"]`` records what was used.
    """
    split = split_allowed(plan.stage_graph) if split_backward is None else bool(split_backward)
    result = solve(plan.stage_graph, plan.cluster, candidate_sizes=candidate_sizes, time_limit_s=time_limit_s,
                   num_workers=num_workers, seed=seed, progress=progress, per_stage_micro_batch=per_stage_micro_batch,
                   split_backward=split)
    pruned = {str(s): list(sizes) for s, sizes in enumerate(result.pruned_sizes) if sizes}
    schedule = Schedule("cpsat", result.schedule.device_actions)
    predicted = _figures(result.stage_graph, schedule, plan.cluster)
    search = dict(plan.search)
    search.update(lower_bound_s=result.lower_bound_s, gap=result.gap, cpsat_status=result.status,
                  cpsat_time_s=result.solve_time_s, heuristic_makespan_s=result.heuristic_makespan_s,
                  cpsat_used_heuristic=result.used_heuristic, cpsat_message=result.message,
                  cpsat_pruned_sizes=pruned, cpsat_canonical=result.canonical, cpsat_split_backward=split)
    out = replace(plan, stage_graph=result.stage_graph, schedule=schedule, predicted=predicted, search=search)
    from graphpipe.search.tied import charge_plan

    return replace(out, predicted=charge_plan(predicted, out))  # split ties' all-reduce, as every plan is charged
