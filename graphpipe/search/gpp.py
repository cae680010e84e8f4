"""GraphPipe's partitioner ("gpp", paper §4 and Alg. 1; docs/design.md#partitioners).

``partition(graph, cluster, batch_size, options)`` turns an op graph into a
*graph* of pipeline stages: branches of the model become concurrent stages on
disjoint devices instead of being serialised as in SPP systems.

How it searches
---------------
1. The graph's non-series-parallel regions are contracted (they become single
   ops inside one stage; the planner usually did this already) and the SP
   tree is built.
2. For every micro-batch size ``b`` (divisors of the batch, or the forced
   one; powers of two with ``options.power_of_two``), binary search on the
   bottleneck time per sample ``t_max`` over the finite set of candidate stage
   TPS values, each target decided by the DP of :mod:`graphpipe.search.gpp_dp`
   (the exact search space is stated there). This gives the optimal
   bottleneck ``t*(b)`` and the shallowest stage graph reaching it.
3. The pipeline's iteration is roughly ``t * (B + b * (depth - 1))``: a
   shallower graph at a slightly larger bottleneck can be faster. For each
   ``b`` the search therefore also finds, for every smaller source depth
   ``v``, the smallest target at which depth ``v`` is feasible (one more
   search each -- the (t, depth) frontier; DP runs are shared between the
   searches). Micro-batch sizes and depths whose lower bound ``t * B`` is
   more than :data:`PRUNE_SLACK` above the best estimate are skipped.
   All of this runs once per cut costing
   (:func:`~graphpipe.search.common.comm_links`: cuts free, then costed on
   each link of the cluster as PipeDream's ``2 C``, a stage costing
   ``max(stage_tps, cut)``), since which link a cut lands on is known only
   after placement.
4. Candidates are ranked by the classic pipeline estimate on the stage DAG
   (``(M - 1) * slowest stage + slowest path + slowest all-reduce``), placed
   on devices (contiguous blocks in tree order, so neighbouring branches
   share a node; or blocks sorted by size, whichever keeps replicated stages
   inside nodes better), and the best :data:`NUM_SIMULATED` of each cut
   costing are scheduled with graph-1F1B and simulated. The highest
   simulated throughput wins; ties go to fewer stages, then fewer devices,
   then the smaller micro-batch size (deterministic).
5. Idle devices: the DP breaks ties towards fewer devices, so the winner
   may leave some idle while one stage carries a large all-reduce or a long
   fill and drain. :func:`_spread_idle` re-partitions one stage at a time
   over its own devices plus the idle ones (the chain view of that stage's
   ops, same DP, same cut costing) and keeps the best simulated split.
6. With ``options.per_stage_micro_batch`` the winner is refined one stage at
   a time: each stage tries the neighbouring micro-batch sizes its replica
   count allows, kept when the simulated throughput improves (the paper
   reports such per-stage sizes give incremental gains over one size).
7. The schedule is graph-1F1B (paper Alg. 2), unless fill-drain (GPipe's
   order on the same stage graph) simulates strictly faster and still fits
   in memory -- with ample memory and few micro-batches it can, and with
   slow cuts it hides transfers that 1F1B waits on; every simulated
   candidate is scored under both, and ``SearchResult.schedule_name`` says
   which won.

Two views of the graph are searched. The SP tree is GraphPipe's space. The
*chain view* -- the ops in topological order as one series -- is the
sequential (SPP) space PipeDream searches; its stage graphs are still run
with graph-1F1B, so branches that land in different stages overlap. A
stage that spans the end of one branch and the op after the branches is in
the chain view only, and on some models (mmt on 16 devices) that is what
balances the pipeline, so gpp keeps whichever view simulates faster and
contains PipeDream's space on the same cost model.

Speed: the DP's tables are indexed by in-flight count, not device count, so
1024 devices cost no more than 32; see :mod:`graphpipe.search.gpp_dp`. The
chain view runs :class:`~graphpipe.search.gpp_chain.ChainDP`, the same DP
vectorised one depth level at a time (same tables and stages, several times
faster: the chain view has the most ops of any node).
What the search does not redo (each leaves the plan unchanged):
one set of block cost tables per micro-batch size serves every cut costing
(:class:`~graphpipe.search.gpp_blocks.BlockCosts`); the DP keeps states
across targets under the rank of the target among their scope's costs; the
free-cut optimum is a lower bound for the costed searches (a costed
micro-batch size whose free-cut optimum already loses to the best estimate
is skipped, like one whose compute bound does); the depth frontier searches
only targets below the best estimate, first checking the top of that range;
a candidate whose fill-and-drain bound (:func:`pipeline_bound_s`) already
loses to the best simulated plan is not simulated; and candidates are scored
by :func:`graphpipe.sched.simulator.score` (the simulator's figures, one
device per lockstep replica class, no timeline). Each micro-batch size's
searches start from the previous size's answers (:func:`_frontier`'s
``hints``): neighbouring sizes often have equal or close optima, so the
bracket closes in a few DP runs; a depth-frontier probe of the chain view
computes only the depth levels it asks about.

Device counts per stage are the divisors of ``b`` up to ``N`` -- every useful
count, since a stage's replicas must split its micro-batch evenly -- so no
device grid is needed even at 1024 devices.

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.search.common import SearchOptions
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in "sabt"]
>>> g = OpGraph.build("diamond", ops, [("s", "a", 1), ("s", "b", 1), ("a", "t", 1), ("b", "t", 1)])
>>> result = partition(g, preset("v100", 4), 16, SearchOptions(micro_batch_size=2))
>>> result.stats["micro_batch_size"], result.stage_graph.num_stages, result.stats["devices_used"]
(2, 2, 4)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from graphpipe import costs
from graphpipe.cluster import Cluster, Link
from graphpipe.errors import DeviceMemoryError, InfeasibleError
from graphpipe.graph import OpGraph
from graphpipe.search.common import (SearchOptions, SearchResult, Strategy, comm_links, link_name,
                                     micro_batch_candidates, placed_bottleneck, recompute_all, simulated_fitting)
from graphpipe.search.repeats import cost_signature
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_dp import INF, DPStage, Table, TargetDP
from graphpipe.search.gpp_solve import first_feasible, make_dp, min_bottleneck
from graphpipe.search.gpp_tree import DPTree, build_tree, chain_tree
from graphpipe.sched.generators import gpipe_time_bound_s
from graphpipe.sp import induced_subgraph, make_series_parallel
from graphpipe.stages import Stage, StageGraph

__all__ = ["partition", "STRATEGY", "place_stages", "smallest_memory_needed", "busy_bound_s", "pipeline_bound_s"]

log = logging.getLogger(__name__)

FILL_DRAIN = "gpipe"
NUM_SIMULATED = 8
"""Candidates simulated after ranking by the analytical estimate (simulation is the costly part)."""
PRUNE_SLACK = 1.1
"""A micro-batch size or depth is skipped only when its lower bound exceeds the best estimate by this factor:
the estimate ignores transfers, so near-misses are kept for the simulator to judge."""

NUM_SIMULATED_ROUND_ROBIN = 2
""":data:`NUM_SIMULATED` of a search with round-robin replicas (:attr:`SearchOptions.round_robin
<graphpipe.search.common.SearchOptions.round_robin>`), whose candidates have a micro-batch per sample."""


@dataclass(frozen=True, slots=True)
class _Candidate:
    micro_batch_size: int
    stages: tuple[DPStage, ...]
    bottleneck_tps: float
    depth: int
    estimate_s: float
    view: str = "sp"
    """Which tree produced it: "sp" (the SP tree) or "chain" (the linear order, SPP's space)."""
    link: int = 0
    """Index into :func:`~graphpipe.search.common.comm_links` of the link its cuts were costed on."""


def _to_simulate(candidates: Sequence[_Candidate], num_links: int, keep: int = NUM_SIMULATED
                 ) -> tuple[list[_Candidate], list[_Candidate]]:
    """(the best ``keep`` (:data:`NUM_SIMULATED`) by estimate of every cut costing, the others), both in estimate
    order.

    The estimate ignores transfers, so costings are ranked apart: pooled,
    the free-cut candidates would crowd out those that avoid heavy cuts.
    A stage graph found under several costings is simulated once.
    """
    def estimate_order(c: _Candidate):
        return c.estimate_s, len(c.stages), sum(s.num_devices for s in c.stages), c.micro_batch_size, c.link

    def same(c: _Candidate):
        return c.micro_batch_size, tuple((s.op_ids, s.num_devices) for s in c.stages)

    ordered = sorted(candidates, key=estimate_order)
    chosen: dict = {}
    for li in range(num_links):
        for c in [c for c in ordered if c.link == li][:keep]:
            chosen.setdefault(same(c), c)
    first = sorted(chosen.values(), key=estimate_order)
    rest = []
    for c in ordered:
        if same(c) not in chosen:
            chosen[same(c)] = c
            rest.append(c)
    return first, rest


def partition(graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions,
              beat_iteration_s: float | None = None, where_memory_binds: bool = False) -> SearchResult:
    """GraphPipe's stage graph for ``graph`` on ``cluster`` (see the module docstring).

    Raises :class:`~graphpipe.errors.InfeasibleError` when no stage graph fits
    in device memory, naming the memory the smallest plan needs.

    ``beat_iteration_s``: the simulated iteration time of a plan the caller
    already has. A view and micro-batch size whose compute-only lower bound
    (:meth:`TargetDP.lower_bound` without cut costs or
    re-materialization, times the batch) is above it cannot give a faster
    plan and is not searched; when nothing is left this raises
    :class:`InfeasibleError` saying so.

    ``where_memory_binds`` (with re-materialization and ``beat_iteration_s``;
    ``--recompute auto``'s second search): a view and micro-batch size where
    every block fast enough to be a stage of a plan beating
    ``beat_iteration_s`` holds all its micro-batches without
    re-materialization (:meth:`BlockCosts.memory_binds`) is not searched
    either: there re-materializing only adds time.
    """
    started = time.perf_counter()
    search = _Search.of(graph, cluster, batch_size, options, beat_iteration_s, where_memory_binds)
    candidates = search.candidates()
    if not candidates:
        search.raise_none_found()
    best, num_simulated = _simulate_best(search, candidates)
    _, sg, cand, throughput, schedule_name = best
    spread = 0
    if not options.round_robin:  # round-robin counts already reach any whole node; a simulation there costs more
        sg, throughput, schedule_name, spread = _spread_idle(sg, cluster, search.links[cand.link], throughput,
                                                             schedule_name, options.power_of_two, options.host,
                                                             search.recompute)
    num_simulated += spread
    if options.per_stage_micro_batch and options.micro_batch_size is None:
        sg, throughput, schedule_name = _refine_micro_batches(sg, cluster, throughput, schedule_name,
                                                              host=options.host)
    used = len(sg.devices_used())
    if used < cluster.num_devices:
        log.info("gpp uses %d of %d devices: more devices do not lower the bottleneck of %s at batch %d",
                 used, cluster.num_devices, graph.name, batch_size)
    stats: dict[str, Any] = {
        "time_s": time.perf_counter() - started,
        "bottleneck_tps": placed_bottleneck(sg, cluster),
        "model_bottleneck_tps": cand.bottleneck_tps,
        "min_bottleneck_tps": search.best_tps,
        "num_targets_tried": search.tried,
        "searches_pruned": search.pruned,
        "dp_states": search.states,
        "micro_batch_size": cand.micro_batch_size,
        "view": cand.view,
        "cut_link": link_name(cluster, search.links[cand.link]),
        "micro_batch_sizes": sorted({s.micro_batch_size for s in sg.stages}),
        "devices_used": used,
        "unused_devices": cluster.num_devices - used,
        "num_stages": sg.num_stages,
        "depth": sg.depth(),
        "candidates": len(candidates),
        "candidates_simulated": num_simulated,
        "throughput_estimate": throughput,
    }
    return SearchResult(stage_graph=sg, schedule_name=schedule_name, stats=stats)


@dataclass(slots=True)
class _Search:
    """One gpp search: its inputs, the views of the graph it searches, its caches and counters."""

    graph: OpGraph
    sp_graph: OpGraph
    merged: dict
    cluster: Cluster
    batch_size: int
    options: SearchOptions
    beat_iteration_s: float | None
    where_memory_binds: bool
    trees: list[tuple[str, DPTree]]
    """``("sp", tree)``, and ``("chain", tree)`` when the graph has parallel branches (a sequential view)."""
    sizes: tuple[int, ...]
    links: tuple[Link | None, ...]
    recompute: bool
    best_tps: float = INF * 1.0
    tried: int = 0
    states: int = 0
    pruned: int = 0
    beaten: dict[tuple[str, int], bool] = field(default_factory=dict)
    tables: dict[tuple[str, int, bool], BlockCosts] = field(default_factory=dict)
    boundary: dict[str, dict] = field(default_factory=dict)
    """Bytes across block boundaries, per view (shared by that view's block tables)."""
    free_optimum: dict[tuple[str, int], float] = field(default_factory=dict)
    """(view, b) -> optimal bottleneck with cuts free."""

    @classmethod
    def of(cls, graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions,
           beat_iteration_s: float | None, where_memory_binds: bool) -> "_Search":
        sp_graph, merged = make_series_parallel(graph)
        tree = build_tree(sp_graph)
        trees = [("sp", tree)]
        if any(kind == "parallel" for kind in tree.kinds):
            trees.append(("chain", chain_tree(sp_graph)))
        return cls(graph, sp_graph, merged, cluster, batch_size, options, beat_iteration_s, where_memory_binds,
                   trees, micro_batch_candidates(batch_size, options), comm_links(cluster),
                   recompute_all(options, default=False), boundary={view: {} for view, _ in trees})

    def blocks(self, view: str, view_tree: DPTree, b: int, rc: bool) -> BlockCosts:
        """The block cost tables of a view at size ``b``: they do not depend on the cut costing, so every
        link shares them."""
        got = self.tables.get((view, b, rc))
        if got is None:
            got = self.tables[(view, b, rc)] = BlockCosts(view_tree, self.cluster, self.batch_size, b,
                                                          power_of_two=self.options.power_of_two, recompute=rc,
                                                          boundary=self.boundary[view],
                                                          round_robin=self.options.round_robin)
        return got

    def cannot_beat(self, view: str, view_tree: DPTree, b: int) -> bool:
        """No plan of this view at size ``b`` can beat ``beat_iteration_s`` (or, with ``where_memory_binds``,
        gain anything from re-materialization)."""
        if self.beat_iteration_s is None:
            return False
        got = self.beaten.get((view, b))
        if got is None:  # the bound holds whatever a cut costs or re-materialization does
            plain = self.blocks(view, view_tree, b, False)
            got = plain.lower_bound() * self.batch_size > self.beat_iteration_s * (1 + 1e-9)
            if not got and self.recompute and self.where_memory_binds:
                # A stage's busy time is its cost times the batch: a plan beating the one in hand has only
                # stages cheaper than this, and when none of them is short of memory, nothing is gained.
                got = not plain.memory_binds(self.beat_iteration_s * (1 + 1e-9) / self.batch_size)
            self.beaten[(view, b)] = got
        return got

    def candidates(self) -> list[_Candidate]:
        """The DP's candidate stage lists over every cut costing, view and micro-batch size (GraphPipe §4)."""
        candidates: list[_Candidate] = []
        batch_size = self.batch_size
        for li, link in enumerate(self.links):
            best_estimate = float("inf")  # per cut costing: each is a search of its own
            hints: dict[str, list[tuple[float, int, bool]]] = {}  # view -> the last micro-batch size's trade-off
            for view, view_tree in self.trees:
                for b in self.sizes:
                    if self.cannot_beat(view, view_tree, b):
                        self.pruned += 1
                        continue
                    dp = make_dp(view_tree, self.cluster, batch_size, b, link=link,
                                 blocks=self.blocks(view, view_tree, b, self.recompute))
                    # A costed cut only adds to a stage's cost, so no target below the free-cut optimum is feasible.
                    free = self.free_optimum.get((view, b), 0.0)
                    if max(dp.lower_bound(), free) * batch_size > best_estimate * PRUNE_SLACK:
                        continue  # even a perfectly balanced pipeline at this size loses to a candidate in hand
                    found, n_tried, left = _frontier(dp, batch_size, best_estimate * PRUNE_SLACK, free,
                                                     hints.get(view, ()))
                    if left:
                        hints[view] = left
                    if link is None and found:
                        self.free_optimum[(view, b)] = found[0][0]
                    self.tried += n_tried
                    self.states += dp.dp_states
                    for t, depth, stages in found:
                        if link is None:  # the compute-only optimum of the space, reported as such
                            self.best_tps = min(self.best_tps, t)
                        depth = _real_depth(self.sp_graph, stages) if view == "chain" else depth
                        est = _estimate(self.sp_graph, self.cluster, batch_size, b, stages, self.recompute)
                        best_estimate = min(best_estimate, t * (batch_size + _fill(b, stages) * (depth - 1)))
                        candidates.append(_Candidate(b, tuple(stages), t, depth, est, view, li))
        return candidates

    def raise_none_found(self) -> None:
        """Why there is no candidate: nothing beats the plan in hand, or nothing fits in memory."""
        cluster = self.cluster
        if self.beat_iteration_s is not None and self.pruned:
            raise InfeasibleError(f"gpp: no plan on {cluster.num_devices} devices can beat an iteration of "
                                  f"{self.beat_iteration_s:.4g} s")
        need = smallest_memory_needed([t for _, t in self.trees], cluster, self.batch_size, self.sizes,
                                      self.options.power_of_two, self.recompute)
        raise DeviceMemoryError(
            f"gpp: no plan fits in {cluster.memory_bytes / 1e9:g} GB per device; the smallest needs "
            f"{need / 1e9:.3g} GB (raise --memory-gb, add devices, use a smaller batch"
            + (")" if self.recompute else ", or --recompute all)"))

    def stage_graph(self, cand: _Candidate) -> StageGraph:
        return _to_stage_graph(self.graph, self.sp_graph, self.merged, cand, self.cluster, self.batch_size,
                               self.recompute)


def _simulate_best(search: _Search, candidates: Sequence[_Candidate]) -> tuple[tuple, int]:
    """The fastest simulated candidate among the estimate-ranked few (or, when all of them overflow the simulated
    memory, the first of the rest that fits): ``((key, sg, cand, throughput, schedule), number simulated)``."""
    cluster, host = search.cluster, search.options.host
    best = None
    num_simulated = 0
    # round-robin candidates simulate a micro-batch per sample: fewer of them
    keep = NUM_SIMULATED_ROUND_ROBIN if search.options.round_robin else NUM_SIMULATED
    first, rest = _to_simulate(candidates, len(search.links), keep)
    for cand in first:
        sg = search.stage_graph(cand)
        if best is not None and _slower_than(sg, cluster, best[3], host):
            continue  # even perfectly packed it loses to the plan in hand: no simulation needed
        scored = _score_best(sg, cluster, host)
        num_simulated += 1
        if scored is None:
            continue
        throughput, schedule_name = scored
        key = (-throughput, sg.num_stages, len(sg.devices_used()), cand.micro_batch_size, cand.link)
        if best is None or key < best[0]:
            best = (key, sg, cand, throughput, schedule_name)
    if best is None:  # the estimate-ranked few all overflow the simulated memory: try the rest
        for cand in rest:
            sg = search.stage_graph(cand)
            scored = _score_best(sg, cluster, host)
            num_simulated += 1
            if scored is not None:
                best = ((), sg, cand) + scored
                break
    if best is None:
        raise DeviceMemoryError(
            f"gpp: no plan fits in {cluster.memory_bytes / 1e9:g} GB per device once scheduled; use more devices "
            "or more memory per device")
    return best, num_simulated


# ------------------------------------------------------------------ search
def _frontier(dp: TargetDP, batch_size: int, best_estimate: float, known_lower: float = 0.0,
              hints: Sequence[tuple[float, int, bool]] = ()
              ) -> tuple[list[tuple[float, int, list[DPStage]]], int, list[tuple[float, int, bool]]]:
    """The (bottleneck, depth) trade-off for one micro-batch size.

    First the optimal bottleneck ``t*`` and the shallowest graph reaching it
    (depth ``v*``); then for each smaller source depth ``v`` the smallest
    target whose DP admits depth ``<= v`` (exact again: feasibility at fixed
    ``v`` is monotone in the target). Stops once ``t * B`` alone exceeds the
    best estimate so far: shallower graphs only need larger targets.
    ``known_lower``: a bottleneck no stage graph of this DP beats (0: none known).
    ``hints``: (t, depth, found at the search's start) points of a neighbouring micro-batch size's
    trade-off, where each search starts (they change how many DP runs it takes, not what it finds): a
    search whose neighbour found its answer right at its lower bound probes that bound first.
    Returns ([(t, depth, stages)], DP runs, the hints it leaves for the next size).
    """
    targets = dp.candidate_targets()
    start = int(np.searchsorted(targets, max(dp.lower_bound() * (1 - 1e-12), known_lower), side="left"))

    def near(depth: int) -> int | None:  # the hint's smallest target admitting this depth
        ts = [(t, tight) for t, d, tight in hints if d <= depth]
        if not ts:
            return None
        t, tight = min(ts)
        return None if tight else int(np.searchsorted(targets, t, side="left"))

    probes: dict[int, Table] = {}
    index, runs = first_feasible(dp, targets, dp.kcap, start, probes, guess=near(dp.kcap))
    if index is None:
        return [], runs, []
    best = dp.best_at(float(targets[index]))
    assert best is not None
    depth, stages = best
    t = float(targets[index])
    out = [(t, depth, stages)]
    left = [(t, depth, index == start)]
    best_estimate = min(best_estimate, t * (batch_size + _fill(dp.b, stages) * (depth - 1)))
    scaled = targets * batch_size
    while depth > 1:
        # Only targets with t * B below the best estimate can give a candidate: search no further.
        stop = int(np.searchsorted(scaled, best_estimate, side="left"))
        found, more = first_feasible(dp, targets, depth - 1, index + 1, probes, stop, guess=near(depth - 1))
        runs += more
        if found is None:
            break
        tight = found == index + 1
        index, t = found, float(targets[found])
        if t * batch_size >= best_estimate:
            break
        dp.solve(t)
        stages = dp.extract(depth - 1)
        depth = _source_depth(stages)
        out.append((t, depth, stages))
        left.append((t, depth, tight))
        best_estimate = min(best_estimate, t * (batch_size + _fill(dp.b, stages) * (depth - 1)))
    return out, runs, left


def _fill(b: int, stages: Sequence[DPStage]) -> int:
    """Samples' worth of bottleneck time one stage adds to the fill and drain: ``b``, or with round-robin
    replicas (``b == 1``, :func:`_stage`) the most replicas of a stage, each of which runs a whole micro-batch
    on its own, ``d`` times the bottleneck's time per sample."""
    return max((s.num_devices for s in stages), default=1) if b == 1 else b


def _estimate(graph: OpGraph, cluster: Cluster, batch_size: int, b: int, stages: Sequence[DPStage],
              recompute: bool = False) -> float:
    """Iteration time of a 1F1B-style pipeline: fill + drain along the slowest path, steady state at the
    bottleneck, and the slowest gradient all-reduce at the end (transfers ignored).

    ``(M - 1) * max_s T_s + max over stage paths of sum T_s + max_s allreduce_s``, with ``T_s`` one
    micro-batch's forward + backward on stage ``s`` -- the classic pipeline formula (GPipe §2.3) on a DAG.
    """
    num_mbs = batch_size // b
    # one micro-batch's time on a replica (``path``), and what it adds to the stage's steady state: all of it
    # where the replicas split it, a d-th where d round-robin replicas (b = 1, d > 1: :func:`_stage`) take turns
    round_robin = [b == 1 and s.num_devices > 1 for s in stages]
    per_mb = [sum(costs.action_times(*_coeffs(graph, s.op_ids), b if rr else b / s.num_devices, recompute))
              for s, rr in zip(stages, round_robin)]
    steady = [t / s.num_devices if rr else t for t, s, rr in zip(per_mb, stages, round_robin)]
    allreduce = [cluster.allreduce_time(range(s.num_devices), sum(graph.ops[o].param_bytes for o in s.op_ids))
                 for s in stages]
    stage_of = {o: i for i, s in enumerate(stages) for o in s.op_ids}
    path = list(per_mb)
    for i in reversed(range(len(stages))):  # stages come in a topological order
        for o in stages[i].op_ids:
            for w in graph.succs(o):
                j = stage_of[w]
                if j != i:
                    path[i] = max(path[i], per_mb[i] + path[j])
    return (num_mbs - 1) * max(steady) + max(path) + max(allreduce)


def _coeffs(graph: OpGraph, op_ids: Sequence[int]) -> tuple[float, float, float, float]:
    sums = costs.stage_sums(graph, op_ids, 0.0, 0.0)
    return sums.fwd_alpha, sums.fwd_beta, sums.bwd_alpha, sums.bwd_beta


def _real_depth(graph: OpGraph, stages: Sequence[DPStage]) -> int:
    """Depth of the stage DAG (longest path in stages), which is what graph-1F1B's in-flight follows."""
    stage_of = {o: i for i, s in enumerate(stages) for o in s.op_ids}
    depth = [1] * len(stages)
    for i in reversed(range(len(stages))):  # chain-view stages come in topological order
        for o in stages[i].op_ids:
            for w in graph.succs(o):
                j = stage_of[w]
                if j != i:
                    depth[i] = max(depth[i], depth[j] + 1)
    return max(depth, default=0)


def _source_depth(stages: Sequence[DPStage]) -> int:
    return max(s.in_flight for s in stages)


def smallest_memory_needed(trees: Sequence[DPTree], cluster: Cluster, batch_size: int, sizes: Sequence[int],
                           power_of_two: bool = False, recompute: bool = False) -> float:
    """Smallest device memory at which some stage graph fits (bisection, 0.5% relative).

    Feasibility is monotone in memory, so bisection between 0 and an
    always-feasible bound (everything resident on one device for every
    micro-batch) converges to the threshold of the DP's memory model.
    """
    graph = trees[0].graph
    upper = (cluster.state_bytes(graph.param_bytes)
             + (sum(op.act_bytes for op in graph.ops) + sum(e.saved for e in graph.saved_edges)) * batch_size + 1.0)

    def fits(memory: float) -> bool:
        trial = cluster.with_memory(memory)
        for tree in trees:
            for b in sizes:
                dp = make_dp(tree, trial, batch_size, b, power_of_two=power_of_two, recompute=recompute)
                if dp.feasible(float("inf")):
                    return True
        return False

    lo, hi = 0.0, upper
    while hi - lo > 0.005 * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------- placement
def place_stages(stages: Sequence[tuple[Sequence[int], int]], cluster: Cluster) -> list[tuple[int, ...]]:
    """Device ids for stages given as (op ids, device count), in tree order.

    Contiguous blocks in tree order keep neighbouring branches on neighbouring
    devices (one node where possible). When that splits a replicated stage of
    at most ``devices_per_node`` devices across two nodes (slow all-reduce),
    blocks are laid out largest first instead, which aligns them to nodes for
    power-of-two counts; the layout with fewer such splits wins (tree order on
    ties).
    """
    counts = [d for _, d in stages]

    def layout(order: Sequence[int]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [()] * len(counts)
        nxt = 0
        for i in order:
            out[i] = tuple(range(nxt, nxt + counts[i]))
            nxt += counts[i]
        return out

    def splits(devs: Sequence[tuple[int, ...]]) -> int:
        dpn = cluster.devices_per_node
        return sum(1 for ds in devs if 1 < len(ds) <= dpn and cluster.node_of(ds[0]) != cluster.node_of(ds[-1]))

    tree_order = layout(range(len(counts)))
    if not splits(tree_order):
        return tree_order
    by_size = layout(sorted(range(len(counts)), key=lambda i: (-counts[i], i)))
    return by_size if splits(by_size) < splits(tree_order) else tree_order


def _to_stage_graph(graph: OpGraph, sp_graph: OpGraph, merged: dict, cand: _Candidate, cluster: Cluster,
                    batch_size: int, recompute: bool = False) -> StageGraph:
    """Stage graph over the *original* graph: contracted ops expand back to their members."""
    if merged:
        members = {}
        for op_id, op in enumerate(sp_graph.ops):
            names = merged.get(op.name, (op.name,))
            members[op_id] = tuple(graph.op_id(n) for n in names)
        op_sets = [tuple(sorted(o for c in s.op_ids for o in members[c])) for s in cand.stages]
    else:
        op_sets = [s.op_ids for s in cand.stages]
    devices = place_stages([(ops, s.num_devices) for ops, s in zip(op_sets, cand.stages)], cluster)
    stages = [_stage(i, ops, devs, cand.micro_batch_size, recompute)
              for i, (ops, devs) in enumerate(zip(op_sets, devices))]
    return StageGraph.build(graph, stages, batch_size, cluster.num_devices)


def _stage(stage_id: int, op_ids, devices, micro_batch_size: int, recompute: bool) -> Stage:
    """A stage of the DP's answer: several devices at micro-batch size 1 are round-robin replicas (the only way
    the DP gives them, :attr:`SearchOptions.round_robin <graphpipe.search.common.SearchOptions.round_robin>`),
    any other count splits its micro-batches."""
    mode = "round-robin" if micro_batch_size == 1 and len(devices) > 1 else "split"
    return Stage(stage_id, op_ids, devices, micro_batch_size, recompute, replica_mode=mode)


# ----------------------------------------------------------------- scoring
def _spread_idle(sg: StageGraph, cluster: Cluster, link: Link | None, throughput: float, schedule_name: str,
                 power_of_two: bool = False, host=None, recompute: bool = False) -> tuple[StageGraph, float, str, int]:
    """Give the idle devices to one stage, split by the DP: the best simulated such graph, if it beats ``sg``.

    For every stage of >= 2 ops, the DP solves the stage's ops alone (in op
    order, :func:`~graphpipe.search.gpp_tree.chain_tree`) on its devices plus
    the idle ones; the stage is replaced by that split and the graph is
    simulated (memory included: the split's stages hold as many in-flight
    micro-batches as graph-1F1B gives them in the whole graph). Returns
    (stage graph, throughput, schedule, simulations run).
    """
    graph = sg.graph
    used = set(sg.devices_used())
    idle = [d for d in range(cluster.num_devices) if d not in used]
    best, runs = (throughput, sg, schedule_name), 0
    if not idle:
        return sg, throughput, schedule_name, 0
    solved: dict[tuple, object] = {}  # stages of identical layers pose one DP problem (graphpipe.search.repeats)
    for st in sg.stages:
        if len(st.op_ids) < 2:
            continue
        pool = sorted(st.devices + tuple(idle))
        ops = sorted(st.op_ids)
        key = (cost_signature(graph, ops), st.micro_batch_size, len(pool))
        if key not in solved:
            solved[key] = min_bottleneck(chain_tree(induced_subgraph(graph, ops)), cluster, sg.batch_size,
                                         st.micro_batch_size, len(pool), power_of_two, link, recompute)
        sol = solved[key]
        if sol is None or len(sol.stages) < 2:
            continue
        stages, nxt = [], 0
        for other in sg.stages:
            if other.id != st.id:
                stages.append(Stage(len(stages), other.op_ids, other.devices, other.micro_batch_size, other.recompute,
                                    replica_mode=other.replica_mode))
        for part in sol.stages:
            devices = tuple(pool[nxt:nxt + part.num_devices])
            nxt += part.num_devices
            stages.append(_stage(len(stages), tuple(ops[i] for i in part.op_ids), devices, st.micro_batch_size,
                                 recompute))
        trial = StageGraph.build(graph, stages, sg.batch_size, sg.num_devices)
        if _slower_than(trial, cluster, best[0], host):
            continue
        scored = _score_best(trial, cluster, host, above=best[0] * (1 + 1e-9))
        runs += 1
        if scored is not None and scored[0] > best[0] * (1 + 1e-9):
            best = (scored[0], trial, scored[1])
    return best[1], best[0], best[2], runs


def busy_bound_s(sg: StageGraph, cluster: Cluster) -> float:
    """No schedule runs an iteration of ``sg`` faster on dedicated devices (the simulator's model, docs/design.md#schedules-and-the-simulator).

    Each replica of a stage that splits micro-batches runs every micro-batch's F and B, one action at a
    time, and the stage's gradient all-reduce starts after its last B; transfers and waiting only add.
    Of a stage whose ``r`` replicas take whole micro-batches in turn, one runs ``ceil(M / r)`` of them.
    """
    return _stage_bound(sg, cluster, [0.0] * sg.num_stages, [0.0] * sg.num_stages)


def _stage_bound(sg: StageGraph, cluster: Cluster, up: Sequence[float], down: Sequence[float]) -> float:
    """Max over stages of ``up + busy + max(down, all-reduce)``: each replica runs every micro-batch's F and B
    (a round-robin stage's busiest replica ``ceil(M / r)`` of them) after ``up`` seconds, then ``down`` more or
    its gradient all-reduce follows."""
    bound = 0.0
    for st in sg.stages:
        s = st.id
        busy = sg.busiest_replica_micro_batches(s) * (sg.fwd_time(s) + sg.bwd_time(s))
        after = down[s]
        if st.num_replicas > 1:
            after = max(after, sg.sync_time(s, cluster))
        bound = max(bound, up[s] + busy + after)
    return bound


def pipeline_bound_s(sg: StageGraph, cluster: Cluster) -> float:
    """:func:`busy_bound_s` with each stage's fill and drain: no schedule of ``sg`` with whole backward actions
    (B, not I/W) runs an iteration faster on dedicated devices when every device holds one stage.

    A stage's first F waits for an F of each producer, after that producer's own first inputs, and for
    its own all-gather at the step's start, if any (``up``); its device then runs every action it has (``busy``); the micro-batch of its last B then
    needs a B on each producer, and so on to the sources (``down``), or its all-reduce follows. Delays
    only add. Falls back to :func:`busy_bound_s` when a device holds several stages.
    """
    devices = [d for st in sg.stages for d in st.devices]
    if len(devices) != len(set(devices)):
        return busy_bound_s(sg, cluster)
    up = sg.gather_times(cluster)  # no F before the stage's all-gather at the step's start; ids are topological
    for s in range(sg.num_stages):
        up[s] = max([up[s]] + [up[p] + sg.fwd_time(p) for p in sg.preds(s)])
    down = [0.0] * sg.num_stages
    for s in range(sg.num_stages):
        down[s] = max((sg.bwd_time(p) + down[p] for p in sg.preds(s)), default=0.0)
    return _stage_bound(sg, cluster, up, down)


def _slower_than(sg: StageGraph, cluster: Cluster, throughput: float, host=None) -> bool:
    """Whether ``sg`` provably simulates slower than ``throughput`` (:func:`pipeline_bound_s`; with a margin far
    above the simulator's rounding). Never on a shared host, whose slowdowns the bound does not model."""
    if host is not None:
        return False
    bound = pipeline_bound_s(sg, cluster)
    return bound > 0 and sg.batch_size / bound < throughput * (1 - 1e-6)


def _score_best(sg: StageGraph, cluster: Cluster, host=None, above: float | None = None) -> tuple[float, str] | None:
    """(throughput, schedule) of the faster of graph-1F1B and fill-drain that fits in memory; None if neither.

    Ties go to graph-1F1B (fewer micro-batches in flight). ``host``: simulate on a shared host
    (:attr:`SearchOptions.host`). ``above``: a schedule provably slower than this throughput counts as not
    fitting (:func:`~graphpipe.search.common.simulated_fitting`): the idle-device pass only keeps a trial
    faster than its best so far.
    """
    best = None
    for schedule in (STRATEGY.default_schedule, FILL_DRAIN):
        # fill-drain is kept only when faster than graph-1F1B: a run that provably is not stops early, or is
        # not run when its timeline's bound already says so
        floor = above if best is None else max(above or 0.0, best[0] * (1 + 1e-12))
        if schedule == FILL_DRAIN and floor and host is None:
            bound = gpipe_time_bound_s(sg, cluster)
            if bound is not None and bound > 0 and sg.batch_size / bound < floor * (1 - 1e-6):
                continue
        throughput = simulated_fitting(sg, cluster, schedule, host, floor)
        if throughput is not None and (best is None or throughput > best[0] * (1 + 1e-12)):
            best = (throughput, schedule)
    return best


def _refine_micro_batches(sg: StageGraph, cluster: Cluster, throughput: float, schedule_name: str,
                          max_rounds: int = 3, host=None) -> tuple[StageGraph, float, str]:
    """Per-stage micro-batch sizes by coordinate descent on simulated throughput (option).

    Each stage in turn tries the neighbouring sizes (next smaller and larger
    divisor of the batch that its replicas divide); a change is kept when the
    simulated throughput (the faster schedule, :func:`_score_best`) improves
    and memory still fits. A few rounds at most: each try is two simulations.
    """
    best_tp, best_schedule = throughput, schedule_name
    sizes = [s for s in range(1, sg.batch_size + 1) if sg.batch_size % s == 0]
    for _ in range(max_rounds):
        improved = False
        for st in sg.stages:
            if st.round_robin:
                continue  # its replica count need not divide any other size
            usable = [b for b in sizes if b % st.num_replicas == 0]
            at = usable.index(sg.stages[st.id].micro_batch_size)
            for b in usable[max(0, at - 1):at] + usable[at + 1:at + 2]:
                stages = [Stage(s.id, s.op_ids, s.devices, b if s.id == st.id else s.micro_batch_size, s.recompute,
                                replica_mode=s.replica_mode) for s in sg.stages]
                trial = StageGraph(sg.graph, tuple(stages), sg.batch_size, sg.num_devices)
                scored = _score_best(trial, cluster, host)
                if scored is not None and scored[0] > best_tp * (1 + 1e-9):
                    sg, (best_tp, best_schedule), improved = trial, scored, True
                    break
        if not improved:
            break
    return sg, best_tp, best_schedule


STRATEGY = Strategy(name="gpp", partition=partition, default_schedule="graph-1f1b", default_recompute="auto",
                    costs_recompute=True, ranks_candidates=True, prunes=True)
"""GraphPipe: graph-1F1B over a stage graph; ranks the sequential candidates' plans too."""
