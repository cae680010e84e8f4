"""What every partitioner shares: options, result type, and the one cost definition.

Every strategy module (``gpp``, ``pipedream``, ``piper``, ``gpipe``) exposes
``partition(graph, cluster, batch_size, options) -> SearchResult``. They all
score a candidate stage with :func:`stage_tps` and :func:`stage_memory`
(both :mod:`graphpipe.costs`, the one cost model), so the brute-force
oracles in the tests and the partitioners agree on the objective. Final plans are then scored by the one simulator.

Time per sample (TPS) of a stage (GraphPipe §4, "bottleneck TPS"): one
replica processes ``b / r`` samples per micro-batch of size ``b`` over ``r``
replicas, so the stage spends ``fwd(b/r) + bwd(b/r)`` seconds per ``b``
samples, plus the gradient all-reduce once per iteration of ``batch_size``
samples. The pipeline's throughput is bounded by ``1 / max_stage TPS``.

Communication (PipeDream's ``2 C``): the edges leaving a stage carry
``out`` bytes per sample forward and as many gradient bytes back, one
message each way per micro-batch, ``2 (latency / b + out / bandwidth)`` per
sample on one link (:func:`cut_tps`). Transfers run beside compute, so a
partitioner that costs cuts treats each as a pipeline stage of its own:
a stage's cost is ``max(stage_tps, cut_tps)``. Which link a cut lands on is
known only after placement, so every partitioner solves once per link of
:func:`comm_links` (``None`` = cuts free) and lets the simulator pick.

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.cluster import preset
>>> g = OpGraph.build("one", [Op("a", "x", Affine(1e-3, 1e-3), Affine(2e-3, 2e-3))], [])
>>> round(stage_tps(g, (0,), (0,), 4, 8, preset("v100", 1)), 6)   # (1e-3+4e-3 + 2e-3+8e-3)/4
0.00375
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from graphpipe import costs
from graphpipe.cluster import Cluster, Link
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph
from graphpipe.stages import StageGraph

if TYPE_CHECKING:
    from graphpipe.sched import SharedHost

__all__ = ["SearchOptions", "SearchResult", "Strategy", "stage_tps", "recompute_all", "placed_bottleneck", "simulated",
           "simulated_peak", "simulated_fitting", "stage_memory", "cut_tps",
           "stage_out_bytes", "comm_links", "link_name", "divisors", "micro_batch_candidates"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    micro_batch_size: int | None = None
    """Force one micro-batch size for every stage; None lets the search choose."""
    recompute: costs.Recompute | None = None
    """Re-materialization: ``none``, ``all`` or ``auto`` (the search turns it on per stage where memory needs
    it or throughput gains); None is the strategy's default (gpipe ``all``, the others ``auto``)."""
    per_stage_micro_batch: bool = False
    """Let each stage pick its own micro-batch size (GraphPipe option; default off as in the paper)."""
    max_downsets: int = 200_000
    """Piper's guard: refuse graphs with more downsets than this."""
    power_of_two: bool = False
    """Restrict device counts and micro-batch sizes to powers of two (the paper's setting)."""
    host: "SharedHost | None" = None
    """The devices time-share one host's processors (CPU ranks on fewer cores than ranks): every strategy
    scores its candidates by the shared-host simulation, and :func:`~graphpipe.search.planner.make_plan`
    also tries fewer devices, since on a saturated host an extra rank only adds work. None: dedicated devices."""
    tp: int | str = 1
    """Tensor-parallel degree of every stage: 1, 2, 4, 8 or ``"auto"`` (the planner tries each dividing a node,
    :mod:`graphpipe.search.layouts`). 1 with ``shard="none"``: the plain search, whole-copy stages."""
    shard: str = "none"
    """``"none"`` (whole copies per replica), ``"fsdp"`` (model state sharded over a stage's replicas) or
    ``"auto"`` (both tried)."""
    round_robin: bool = False
    """gpp, at micro-batch size 1: a stage may run on any number of devices up to the micro-batch count,
    its replicas taking whole micro-batches in turn (``replica_mode="round-robin"``, PipeDream's 1F1B-RR),
    instead of only on a divisor of the micro-batch. Each device then runs one sample per action, as a
    split stage with one sample per replica does, so the costs are the same; what changes is that a stage's
    device count is no longer a power of two when the batch is. The layout search turns it on for one of its
    tries (:mod:`graphpipe.search.layouts`)."""
    per_stage_layouts: bool = True
    """With layouts searched (``tp``/``shard`` not 1/none), let a strategy that ranks candidates (gpp) give each
    stage its own layout after the uniform search; False keeps one layout for every stage (torchtitan's)."""
    max_memory_gb: float | None = None
    """Resident-memory budget of the search's process, GiB (:mod:`graphpipe.search.memory_guard`): past it the
    search stops with a one-line error instead of growing until the kernel kills it. None: half the machine's."""

    def __post_init__(self) -> None:
        if self.max_memory_gb is not None and not (isinstance(self.max_memory_gb, (int, float))
                                                   and not isinstance(self.max_memory_gb, bool)
                                                   and 0 < self.max_memory_gb < float("inf")):
            raise InputError(f"--max-memory-gb must be a positive number of GB, got {self.max_memory_gb!r}")
        if self.micro_batch_size is not None and (not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1):
            raise InputError(f"--micro-batch-size must be a positive integer, got {self.micro_batch_size!r}")
        if self.tp != "auto" and (isinstance(self.tp, bool) or self.tp not in (1, 2, 4, 8)):
            raise InputError(f"--tp must be auto or one of 1, 2, 4, 8, got {self.tp!r}")
        if self.shard not in ("auto", "none", "fsdp"):
            raise InputError(f"--shard must be one of auto, none, fsdp, got {self.shard!r}")
        if self.recompute is not None and self.recompute not in costs.RECOMPUTE_CHOICES:
            raise InputError(f"--recompute must be one of {', '.join(costs.RECOMPUTE_CHOICES)}, got {self.recompute!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    stage_graph: StageGraph
    schedule_name: str
    """The strategy's schedule: gpp -> graph-1f1b, pipedream/piper -> 1f1b, gpipe -> gpipe."""
    stats: Mapping[str, Any] = field(default_factory=dict)
    """At least ``time_s`` (search wall time) and ``bottleneck_tps`` (s/sample)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """What the planner needs to know about one partitioner: each strategy module defines its ``STRATEGY``.

    :func:`~graphpipe.search.planner.make_plan` reads these fields instead of
    testing strategy names, so a new partitioner is one module with one record
    (and its name in :data:`graphpipe.search.STRATEGY_NAMES`).
    """

    name: str
    """The ``--strategy`` name, also written as the plan's ``strategy``."""
    partition: Callable[..., SearchResult]
    """``partition(graph, cluster, batch_size, options) -> SearchResult``."""
    default_schedule: str
    """The schedule its plans use unless the caller names another (:func:`graphpipe.sched.make_schedule`)."""
    default_recompute: costs.Recompute
    """Re-materialization when :attr:`SearchOptions.recompute` is None."""
    costs_recompute: bool
    """Its search prices re-materialization (time and memory). When False the planner runs it without and, for
    ``all``, marks every stage of the plan (which only lowers memory); ``auto`` then equals ``none``."""
    exact_devices: bool = False
    """Planned on exactly the cluster's device count, never on fewer (the original optimizer's behaviour)."""
    gpp_candidate: bool = False
    """gpp ranks this strategy's plan on the same devices and keeps it when it simulates faster."""
    candidate_max_downsets: int | None = None
    """As a gpp candidate, refused above this many downsets (a cap on ``SearchOptions.max_downsets``)."""
    ranks_candidates: bool = False
    """Its planner also ranks the :attr:`gpp_candidate` strategies' plans (gpp: never worse than them)."""
    prunes: bool = False
    """``partition`` also takes ``beat_iteration_s`` and ``where_memory_binds`` and skips what cannot beat them."""
    segments_checkpoints: bool = True
    """Re-materializing stages are cut into checkpointed segments once the schedule is known; False re-runs whole
    stages (GPipe, as its paper does)."""


def stage_tps(graph: OpGraph, op_ids: Iterable[int], devices: Sequence[int], micro_batch_size: int,
              batch_size: int, cluster: Cluster, recompute: bool = False) -> float:
    """Seconds per sample the stage needs (:func:`graphpipe.costs.stage_tps`)."""
    return costs.stage_tps(graph, op_ids, devices, micro_batch_size, batch_size, cluster, recompute)


def recompute_all(options: SearchOptions, default: bool) -> bool:
    """Whether a partitioner costs every stage as re-materializing: ``all`` yes, ``none`` no, None the
    strategy's ``default``. ``auto`` searches without it: :func:`~graphpipe.search.planner.make_plan` runs
    the search both ways and keeps re-materialization only on the stages that need it."""
    if options.recompute is None:
        return default
    return options.recompute == "all"


def placed_bottleneck(sg: StageGraph, cluster: Cluster) -> float:
    """Largest :func:`stage_tps` of a placed stage graph (its real device sets): the partitioners' objective."""
    return max(stage_tps(sg.graph, s.op_ids, s.devices, s.micro_batch_size, sg.batch_size, cluster, s.recompute)
               for s in sg.stages)


def simulated_peaks(sg: StageGraph, cluster: Cluster, schedule_name: str) -> list[float]:
    """Every device's simulated peak bytes under ``schedule_name`` (what ``simulate`` reports), from the
    action order alone (:func:`graphpipe.sched.simulator.peak_memory_in_order`): no engine run.

    For a search that only asks whether a plan fits: at thousands of
    micro-batches the timed simulation is most of such a check's cost, and a
    device's memory does not depend on when its actions run, only on their
    order (a shared host changes timing, not memory).
    """
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import peak_memory_in_order

    return peak_memory_in_order(sg, make_schedule(schedule_name, sg, cluster, validate=False), cluster)


def simulated(sg: StageGraph, cluster: Cluster, schedule_name: str, host: SharedHost | None = None) -> tuple[float, bool]:
    """(throughput, whether the peak memory fits) of one iteration of ``sg`` under ``schedule_name``, by the one simulator.

    On dedicated devices by :func:`graphpipe.sched.simulator.score` (the same figures as ``simulate``, without the
    timeline, one replica of each lockstep class): searches call this for every candidate they rank.
    """
    throughput, peak = simulated_peak(sg, cluster, schedule_name, host)
    return throughput, peak <= cluster.memory_bytes


def simulated_peak(sg: StageGraph, cluster: Cluster, schedule_name: str,
                   host: SharedHost | None = None) -> tuple[float, float]:
    """(throughput, largest device peak in bytes) of :func:`simulated`: for a search that reports how far a
    plan is from fitting."""
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import score, simulate_figures

    schedule = make_schedule(schedule_name, sg, cluster, validate=False)
    if host is None:
        got = score(sg, schedule, cluster)
        return float(got.throughput), float(got.max_peak_memory_bytes)
    # the simulation checks the schedule's structure and deadlock freedom itself: no separate validation pass.
    figures = simulate_figures(sg, schedule, cluster, host=host)
    return float(figures["throughput"]), float(figures["max_peak_memory_bytes"])


def simulated_fitting(sg: StageGraph, cluster: Cluster, schedule_name: str, host: SharedHost | None = None,
                      above: float | None = None) -> float | None:
    """The throughput :func:`simulated` gives ``sg`` under ``schedule_name`` if its peak memory fits, else None.

    For searches that drop a plan that does not fit: on dedicated devices a
    schedule whose peak (from its action order) is over the device memory is
    refused before the timed simulation, which is most of a check's cost at
    thousands of actions (a fill-drain schedule of a large model often holds
    too many micro-batches). The answers equal :func:`simulated`'s.

    ``above`` (samples per second, dedicated devices): None also when the
    throughput is provably below it, told by the engine before it has timed
    every action (:func:`graphpipe.sched.simulator.score`'s
    ``give_up_after``); a search
    keeping only a plan faster than the best so far passes that best.
    """
    if host is not None:
        throughput, fits = simulated(sg, cluster, schedule_name, host)
        return throughput if fits else None
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import score

    give_up_after = sg.batch_size / above if above else None
    got = score(sg, make_schedule(schedule_name, sg, cluster, validate=False), cluster, memory_limit=cluster.memory_bytes,
                give_up_after=give_up_after)
    if got is None or not float(got.max_peak_memory_bytes) <= cluster.memory_bytes:
        return None
    return float(got.throughput)


def stage_memory(graph: OpGraph, op_ids: Iterable[int], num_replicas: int, micro_batch_size: int,
                 in_flight: int, cluster: Cluster, recompute: bool = False, inputs: float | None = None,
                 outputs: float | None = None) -> float:
    """Peak bytes on one device of the stage with ``in_flight`` micro-batches (:func:`graphpipe.costs.stage_memory`)."""
    return costs.stage_memory(graph, op_ids, num_replicas, micro_batch_size, in_flight, cluster, recompute,
                              inputs, outputs)


def stage_out_bytes(graph: OpGraph, op_ids: Iterable[int]) -> float:
    """Bytes per sample on the edges from the stage's ops to ops outside it (what its cut carries)."""
    members = set(op_ids)
    return float(sum(e.bytes for e in graph.edges if e.src in members and e.dst not in members))


def cut_tps(cut_bytes, link: Link | None, micro_batch_size: int) -> np.ndarray:
    """PipeDream's ``2 C`` per sample of cuts carrying ``cut_bytes`` per sample (0 without a link or bytes).

    One message per micro-batch each way: ``2 (latency / b + bytes / bandwidth)``; elementwise.
    """
    cut_bytes = np.asarray(cut_bytes, dtype=float)
    if link is None:
        return np.zeros_like(cut_bytes)
    per_sample = 2 * (link.latency_s / micro_batch_size + cut_bytes / link.bandwidth_Bps)
    return np.where(cut_bytes > 0, per_sample, 0.0)


def comm_links(cluster: Cluster) -> tuple[Link | None, ...]:
    """The links a partitioner costs its cuts on: none, intra-node, and inter-node when there are several nodes.

    Which level of the hierarchy a cut lands on is known only once the
    stages are placed, so each partitioner solves once per entry and keeps
    the plan the simulator rates fastest (never worse than any single one).
    """
    links: list[Link | None] = [None, cluster.intra_node]
    if cluster.num_devices > cluster.devices_per_node and cluster.inter_node != cluster.intra_node:
        links.append(cluster.inter_node)
    return tuple(links)


def link_name(cluster: Cluster, link: Link | None) -> str:
    """``none``, ``intra-node`` or ``inter-node``: how a plan's cuts were costed (``stats["cut_link"]``)."""
    if link is None:
        return "none"
    return "intra-node" if link == cluster.intra_node else "inter-node"


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def micro_batch_candidates(batch_size: int, options: SearchOptions) -> tuple[int, ...]:
    """Micro-batch sizes a search may use: the forced one, or divisors of the batch."""
    if options.micro_batch_size is not None:
        if batch_size % options.micro_batch_size:
            from graphpipe.search.refusal import divisor_error

            raise divisor_error(options.micro_batch_size, batch_size)
        return (options.micro_batch_size,)
    sizes = divisors(batch_size)
    if options.power_of_two:
        sizes = tuple(s for s in sizes if s & (s - 1) == 0)
    return sizes
