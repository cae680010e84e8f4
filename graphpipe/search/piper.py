"""Piper's partitioner (Tarnawski et al., NeurIPS'21), pipeline + data parallelism only.

Piper searches sequential pipelines over a DAG without linearising it
first: a stage is the difference ``D' \\ D`` of two downsets (ideals)
``D ⊂ D'`` — such a set is always convex — and a pipeline is a chain of
downsets ``∅ = D_0 ⊂ D_1 ⊂ ... ⊂ D_K = V``. Its DP state is (downset,
devices, stages) and its value the best bottleneck time per sample of
finishing the graph from that downset. Every PipeDream partition of any
linearisation is such a chain, so Piper is never worse than PipeDream; the
price is the number of downsets, which grows like ``n^k`` for ``k`` parallel
branches of ``n`` ops. Piper itself refuses graphs with too many downsets
(GraphPipe paper: no strategy for DLRM or CANDLE-Uno); so do we, counting
them first (:class:`~graphpipe.search.downsets.DownsetLimitError`, limit
``SearchOptions.max_downsets``).

Objective and refusal rule are the real planner's (msr-fiddle/piper
``algo.cpp``, ``getAllTPSsForIdealPair``, pipeline + data parallelism, one
configuration per layer): a stage ``S`` with data-parallel degree ``d``
costs, per micro-batch ("sample" in Piper's terms) of ``b`` samples,

    T(S, d) = C(S) / d + ( 2 sum_{e in boundary(S)} c_e / d + 4 (d - 1) P(S) / (d M) ) / B

where ``C`` is the forward + backward time of a micro-batch, the boundary
holds every edge entering or leaving ``S`` (``c_e`` its bytes per
micro-batch), the second term is Piper's data-parallel resync
(``getDataParallelResyncCost``: PipeDream's parameter-server factor 4, once
per batch of ``M`` micro-batches) and ``B`` the one bandwidth of the
instance (:func:`piper_bandwidth`). Transfers are *added* to compute, not
overlapped. ``d`` must divide ``M`` (``mbsInBatch % d == 0``): replicas take
whole micro-batches, so their stages run round-robin (1F1B-RR). Our time
per sample is ``T / b``. Piper refuses more than 40,000 ideals
(``IDEALS_LIMIT``); so do we (:data:`IDEALS_LIMIT`, or
``SearchOptions.max_downsets`` when lower).

Memory is ours (Piper's per-layer ``A y + B`` needs a profile we do not
have): model state plus the activations of ``k`` micro-batches in flight on
a stage followed by ``k - 1`` others, spread over its replicas; devices
need not all be used, and the stages are laid out as PipeDream's are
(:func:`~graphpipe.search.sequential.layouts`).

How the DP is evaluated. The min-max table over (downset, devices, stages)
costs ``pairs x devices^2 x stages`` — hopeless in Python at MMT size (4
branches x 8 layers: 6,563 downsets, 4.1 million downset pairs). We solve
the same problem exactly through its decision version: for a target
time per sample ``t``,

    g(D, k) = min over D' ⊋ D of  r_min(D' \\ D, k, t) + g(D', k - 1)

is the fewest devices that finish the graph from ``D`` with ``k`` stages,
each meeting ``t`` and fitting memory with ``k`` micro-batches in flight
(``r_min`` = fewest replicas that do). ``t`` is feasible iff
``min_k g(∅, k) <= N``. Bisection on ``t`` — started from PipeDream's
bottleneck above (a feasible chain) and the perfect-balance bound below,
and tightened to the bottleneck the found chain actually has after every
feasible probe — converges to the optimum to within ``1e-9`` relative. All
(downset pair, replica count) stage times are computed once per micro-batch
size, vectorised over pairs; the DP sweeps downsets level by level from the
full set down.

Example
-------
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> from graphpipe.cluster import preset
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3), param_bytes=4e8) for n in ("s", "a", "b", "t")]
>>> g = OpGraph.build("diamond", ops, [("s", "a", 1), ("s", "b", 1), ("a", "t", 1), ("b", "t", 1)])
>>> part = solve(g, preset("v100", 2), batch_size=8, micro_batch_size=2)
>>> [ops for ops, _ in part.stages], round(part.bottleneck_tps, 6)
([(0, 1), (2, 3)], 0.006)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np

from graphpipe.cluster import Cluster
from graphpipe.graph import OpGraph
from graphpipe.search import linear_dp
from graphpipe.search.common import SearchOptions, SearchResult, Strategy, micro_batch_candidates
from graphpipe.search.downsets import DownsetLimitError, count_downset_pairs, count_downsets, enumerate_downsets
from graphpipe.search.sequential import (OpArrays, ReplicaCosts, SequentialPartition, choose_micro_batch,
                                         lower_bound_tps, sequential_result, replica_mask)

__all__ = ["partition", "solve", "Lattice", "STRATEGY", "IDEALS_LIMIT", "piper_bandwidth", "stage_time"]

log = logging.getLogger(__name__)

REL_TOL = 1e-9
"""Bisection stops when the bracket on the optimal bottleneck is this tight (relative)."""
IDEALS_LIMIT = 40_000
"""algo.cpp's ``IDEALS_LIMIT``: the real planner refuses graphs with more ideals (downsets)."""


def piper_bandwidth(cluster: Cluster) -> float:
    """The one bandwidth of Piper's instance: the intra-node link when every device is on one node,
    else the inter-node link (the slowest a stage boundary may cross)."""
    if cluster.num_devices <= cluster.devices_per_node:
        return cluster.intra_node.bandwidth_Bps
    return cluster.inter_node.bandwidth_Bps


def stage_time(compute_s: float, boundary_bytes: float, param_bytes: float, d: int, num_mbs: int,
               bandwidth: float) -> float:
    """algo.cpp's time per micro-batch of a stage on ``d`` data-parallel replicas (module docstring).

    >>> stage_time(6.0, 100.0, 40.0, 2, 4, 10.0)   # 6/2 + (2*100/2 + 4*1*40/(2*4)) / 10
    15.0
    """
    return compute_s / d + (2.0 * boundary_bytes / d + 4.0 * (d - 1) * param_bytes / (d * num_mbs)) / bandwidth


@dataclass(frozen=True, slots=True)
class Lattice:
    """The downsets of a graph and every pair ``D ⊊ D'`` (a candidate stage), with stage sums.

    Downsets are indexed by (size, mask); pairs are grouped by ``src`` (=D)
    in that order, so the pairs leaving downsets of one size form one
    contiguous slice: ``pair_start[src] : pair_start[src + 1]``.
    """

    masks: tuple[int, ...]
    level_start: np.ndarray
    """Downsets of size L are indices level_start[L] : level_start[L + 1]."""
    pair_src: np.ndarray
    pair_dst: np.ndarray
    pair_start: np.ndarray
    compute_alpha: np.ndarray
    """Per pair: the stage's summed fwd+bwd alpha, likewise beta, params and activation bytes."""
    compute_beta: np.ndarray
    params: np.ndarray
    act: np.ndarray
    cut_bytes: np.ndarray
    """Per downset: bytes per sample on the edges leaving it (what crosses a cut there)."""
    boundary: np.ndarray
    """Per pair: bytes per sample on the edges entering or leaving the stage ``D' \\ D``."""

    @property
    def num_downsets(self) -> int:
        return len(self.masks)

    @property
    def num_pairs(self) -> int:
        return len(self.pair_src)

    @classmethod
    def of(cls, graph: OpGraph, max_downsets: int) -> "Lattice":
        """Every downset of ``graph`` (raises :class:`DownsetLimitError` past the guard)."""
        return cls.of_masks(graph, enumerate_downsets(graph, limit=max_downsets))

    @classmethod
    def prefixes(cls, graph: OpGraph) -> "Lattice":
        """Only the prefixes of the linearisation (op ids 0..n-1): the chains PipeDream-style DPs cut."""
        return cls.of_masks(graph, [(1 << size) - 1 for size in range(graph.num_ops + 1)])

    @classmethod
    def of_masks(cls, graph: OpGraph, masks: list[int]) -> "Lattice":
        """The lattice of the downsets ``masks``, sorted by (size, mask) and holding the empty and full sets."""
        n, num = graph.num_ops, len(masks)
        num_words = max(1, (n + 63) // 64)
        words = np.array([[(m >> (64 * w)) & 0xFFFF_FFFF_FFFF_FFFF for w in range(num_words)] for m in masks],
                         dtype=np.uint64)
        sizes = np.array([bin(m).count("1") for m in masks])
        level_start = np.searchsorted(sizes, np.arange(n + 2))
        bits = np.zeros((num, n))
        for v in range(n):
            bits[:, v] = (words[:, v // 64] >> np.uint64(v % 64)) & np.uint64(1)
        arrays = OpArrays.of(graph)
        sums = bits @ np.stack([arrays.compute_alpha, arrays.compute_beta, arrays.params, arrays.act], axis=1)
        cut_bytes = np.zeros(num)
        for e in graph.edges:
            cut_bytes += e.bytes * bits[:, e.src] * (1.0 - bits[:, e.dst])
        srcs, dsts = [], []
        for src in range(num):
            sup = np.all((words & words[src]) == words[src], axis=1)
            sup[: level_start[sizes[src] + 1]] = False          # strictly larger downsets only
            dst = np.flatnonzero(sup)
            srcs.append(np.full(len(dst), src, dtype=np.int64))
            dsts.append(dst)
        pair_src, pair_dst = np.concatenate(srcs), np.concatenate(dsts)
        pair_start = np.searchsorted(pair_src, np.arange(num + 1))
        diff = sums[pair_dst] - sums[pair_src]
        diff = np.maximum(diff, 0.0)                               # float noise of the subtraction
        # received_saved_bytes of S = D' \ D: a saved edge's source (outside S, before it) lies in D
        for e in graph.saved_edges:
            diff[:, 3] += e.saved * bits[pair_src, e.src] * bits[pair_dst, e.dst] * (1.0 - bits[pair_src, e.dst])
        # in + out of S = D' \ D: cut(D) + cut(D') minus twice the edges jumping from D past D'
        through = np.zeros(len(pair_src))
        for e in graph.edges:
            if e.bytes:
                through += e.bytes * bits[pair_src, e.src] * (1.0 - bits[pair_dst, e.dst])
        boundary = np.maximum(cut_bytes[pair_src] + cut_bytes[pair_dst] - 2.0 * through, 0.0)
        return cls(tuple(masks), level_start, pair_src, pair_dst, pair_start,
                   diff[:, 0], diff[:, 1], diff[:, 2], diff[:, 3], cut_bytes, boundary)

    def ops_of(self, src: int, dst: int) -> tuple[int, ...]:
        stage = self.masks[dst] & ~self.masks[src]
        return tuple(v for v in range(stage.bit_length()) if stage >> v & 1)


@dataclass(frozen=True, slots=True)
class _Tables:
    """Per micro-batch size: the candidate stages that can meet the target at all, and their costs.

    Only pairs whose best replica count meets the initial upper bound on
    the bottleneck are kept (any other stage is in no chain the search can
    return); ``pair`` maps back to :class:`Lattice` pair indices, sorted.
    """

    pair: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    level_start: np.ndarray
    """Kept pairs leaving downsets of size L: level_start[L] : level_start[L + 1]."""
    src_start: np.ndarray
    """Kept pairs leaving downset D: src_start[D] : src_start[D + 1]."""
    replicas: np.ndarray
    """Allowed replica counts, ascending; index R = "none" sentinel."""
    tps: np.ndarray
    """(kept pairs, R): stage TPS."""
    tps_min: np.ndarray
    """(kept pairs,): best TPS over replica counts, to skip stages that cannot meet a target."""
    r_mem: np.ndarray
    """(kept pairs, K): index of the fewest allowed replicas whose memory fits k = 1..K in flight."""
    num_stages_cap: int
    bucket: bool
    """True when the last k index means ">= K stages" (K = number of micro-batches)."""


def _tables(lat: Lattice, costs: ReplicaCosts, graph: OpGraph, batch_size: int, b: int,
            power_of_two: bool, t_max: float, bandwidth: float) -> _Tables:
    num_mbs = batch_size // b
    cap = min(costs.num_devices, graph.num_ops, num_mbs)
    # mbsInBatch % d == 0: replicas take whole micro-batches
    replicas = np.flatnonzero(replica_mask(costs.num_devices, num_mbs, power_of_two)) + 1
    r = replicas[None, :]
    compute = lat.compute_alpha[:, None] + lat.compute_beta[:, None] * b
    tps = stage_time(compute, lat.boundary[:, None] * b, lat.params[:, None], r, num_mbs, bandwidth) / b
    tps_min = tps.min(axis=1)
    keep = np.flatnonzero(tps_min <= t_max)
    tps, tps_min = tps[keep], tps_min[keep]
    params, act = lat.params[keep, None], lat.act[keep, None]
    # Memory falls as replicas grow, so for each k the replica counts that fit form a suffix:
    # r_mem[p, k-1] = how many allowed counts do NOT fit k in flight. Via kmax[p, r] = most
    # micro-batches in flight that fit, then one increment at k = kmax + 1 per (p, r) and a cumsum.
    kmax = _max_in_flight(costs, params, act, r, b, cap)
    delta = np.zeros((len(keep), cap + 1), dtype=np.int16)
    rows = np.arange(len(keep))
    for col in range(len(replicas)):
        delta[rows, kmax[:, col]] += 1
    r_mem = np.cumsum(delta, axis=1, dtype=np.int16)[:, :cap]
    src, dst = lat.pair_src[keep], lat.pair_dst[keep]
    src_start = np.searchsorted(src, np.arange(lat.num_downsets + 1))
    return _Tables(keep, src, dst, src_start[lat.level_start], src_start, replicas, tps, tps_min, r_mem,
                   cap, bucket=(cap == num_mbs))


def _max_in_flight(costs: ReplicaCosts, params, act, r, b: int, cap: int) -> np.ndarray:
    """Largest k in 0..cap with ``costs.memory(params, act, r, b, k) <= memory``.

    ``floor(room / per-micro-batch bytes)``, re-checked with that exact test
    where the quotient is within rounding of an integer, so the answer is
    the one ``stage_memory`` gives (and PipeDream's DP uses).
    """
    room = costs.memory_bytes - costs.state_per_byte * params
    per_mb = act * (b / r)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(per_mb > 0, room / np.where(per_mb > 0, per_mb, 1.0), np.where(room >= 0, cap, -1.0))
    k = np.clip(np.floor(ratio), 0, cap).astype(np.int64)
    near = np.abs(ratio - np.rint(ratio)) <= 1e-9 * np.maximum(1.0, np.abs(ratio))
    near &= (ratio > -1) & (ratio < cap + 1)
    if near.any():
        rows, cols = np.nonzero(near)
        kk = k[rows, cols]
        pr, ac, rr = params[rows, 0], act[rows, 0], r[0, cols]
        fits = lambda x: costs.memory(pr, ac, rr, b, x) <= costs.memory_bytes  # noqa: E731
        kk = np.where((kk < cap) & fits(kk + 1), kk + 1, kk)
        kk = np.where((kk > 0) & ~fits(kk), kk - 1, kk)
        k[rows, cols] = kk
    return k


def _follow(g: np.ndarray, rows: np.ndarray, tables: _Tables) -> np.ndarray:
    """g(D', k - 1) for k = 1..K; the ">= K" bucket may also be followed by itself."""
    cap = tables.num_stages_cap
    h = g[rows, :cap]
    if tables.bucket:
        h[:, cap - 1] = np.minimum(h[:, cap - 1], g[rows, cap])
    return h


def _stage_devices(tables: _Tables, pairs: np.ndarray, t: float) -> np.ndarray:
    """(pairs, K): fewest replicas meeting TPS <= t with k in flight; inf when none does."""
    num_r, num_pairs = len(tables.replicas), len(pairs)
    ok = (tables.tps[pairs] <= t).T
    # best[x, p] = the smallest allowed count from index x on meeting t (inf when none; row num_r: none)
    best = np.empty((num_r + 1, num_pairs))
    best[num_r] = np.inf
    for x in range(num_r - 1, -1, -1):
        best[x] = np.where(ok[x], tables.replicas[x], best[x + 1])
    idx = tables.r_mem[pairs].astype(np.intp)                 # the fewest counts that fit k in flight
    idx *= num_pairs
    idx += np.arange(num_pairs)[:, None]
    return best.ravel()[idx]


def _min_devices(lat: Lattice, tables: _Tables, t: float) -> np.ndarray:
    """The decision DP: g[D, k] = fewest devices finishing the graph from downset D in k stages.

    Downsets are swept by size, largest first, so every ``g(D', .)`` a
    level reads is final. Stages that cannot meet ``t`` are skipped.
    """
    cap = tables.num_stages_cap
    g = np.full((lat.num_downsets, cap + 1), np.inf)
    g[-1, 0] = 0.0                                            # the full set: done, no stage left
    num_levels = len(lat.level_start) - 2
    for level in range(num_levels - 1, -1, -1):
        lo, hi = tables.level_start[level], tables.level_start[level + 1]
        pairs = lo + np.flatnonzero(tables.tps_min[lo:hi] <= t)
        if len(pairs) == 0:
            continue
        value = _stage_devices(tables, pairs, t) + _follow(g, tables.dst[pairs], tables)
        src = tables.src[pairs]
        starts = np.flatnonzero(np.concatenate(([True], src[1:] != src[:-1])))
        g[src[starts], 1:] = np.minimum.reduceat(value, starts, axis=0)
    return g


def _reconstruct(tables: _Tables, g: np.ndarray, t: float, num_devices: int):
    """Walk the decision table from the empty set: the chain of (kept pair, replica index) it chose."""
    feasible = np.flatnonzero(g[0, 1:] <= num_devices)
    if len(feasible) == 0:
        return None
    k = int(feasible[0]) + 1                                  # fewest stages that fit
    src, chain, full = 0, [], len(g) - 1
    while src != full:
        pairs = np.arange(tables.src_start[src], tables.src_start[src + 1])
        need = _stage_devices(tables, pairs, t)[:, k - 1]
        h = g[tables.dst[pairs]]
        follow_same = tables.bucket and k == tables.num_stages_cap
        for pos, pair in enumerate(pairs):
            options = [(h[pos, k - 1], k - 1)] + ([(h[pos, k], k)] if follow_same else [])
            hit = [nk for val, nk in options if need[pos] + val == g[src, k]]
            if hit:
                chain.append((int(pair), int(np.searchsorted(tables.replicas, need[pos]))))
                src, k = int(tables.dst[pair]), hit[0]
                break
        else:  # pragma: no cover - the table is consistent by construction
            raise AssertionError("piper: decision table has no witness")
    return chain


LINEAR_SEED_MAX_DEVICES = 32
"""Up to this many devices :func:`solve` seeds its bisection with the linear DP's chain (:func:`_seed`); past
it with the best chain of prefixes under Piper's own objective (:func:`_prefix_seed`). The linear DP's tables
grow with the device count (ops^2 x devices x replica counts x stages: minutes and gigabytes at 1024 devices);
the prefix lattice's do not. Either seed is only an upper bound, the optimum is the same; the threshold keeps
the plans up to 32 devices exactly as they were (the seed steers which of equally fast chains is returned)."""


SEED_REL_TOL = 1e-2
"""The prefix seed's bisection stops within 1%: any chain it returns is an upper bound, a tighter one only
prunes a few more stages (a quarter of the probes of a full-precision search)."""


def _prefix_seed(graph: OpGraph, cluster: Cluster, batch_size: int, b: int, power_of_two: bool,
                 bandwidth: float) -> float:
    """An upper bound on the optimum: Piper's optimum over the chains of prefixes of the linearisation
    (n + 1 downsets, n (n + 1) / 2 pairs, whatever the device count); inf when none fits."""
    part = solve(graph, cluster, batch_size, b, power_of_two, lattice=Lattice.prefixes(graph), bandwidth=bandwidth,
                 seed=np.inf, rel_tol=SEED_REL_TOL)
    return np.inf if part is None else part.bottleneck_tps * (1 + REL_TOL)


def _seed(lat: Lattice, graph: OpGraph, cluster: Cluster, batch_size: int, b: int, power_of_two: bool,
          bandwidth: float) -> float:
    """An upper bound on the optimum to prune stages with: the linear DP's chain (prefixes of a
    topological order are downsets) with each replica count lowered to one dividing ``M``, under
    Piper's objective; inf when there is none. Only a hint: :func:`solve` checks it is feasible."""
    seed = linear_dp.solve(graph, cluster, batch_size, b, power_of_two)
    if seed is None:
        return np.inf
    num_mbs = batch_size // b
    worst = 0.0
    for ops, r in seed.stages:
        d = max(x for x in range(1, r + 1) if num_mbs % x == 0)
        members = set(ops)
        compute = sum(graph.ops[v].fwd(b) + graph.ops[v].bwd(b) for v in ops)
        boundary = sum(e.bytes for e in graph.edges if (e.src in members) != (e.dst in members))
        params = sum(graph.ops[v].param_bytes for v in ops)
        worst = max(worst, stage_time(compute, boundary * b, params, d, num_mbs, bandwidth) / b)
    return worst * (1 + REL_TOL)


def solve(graph: OpGraph, cluster: Cluster, batch_size: int, micro_batch_size: int,
          power_of_two: bool = False, max_downsets: int = IDEALS_LIMIT,
          lattice: Lattice | None = None, bandwidth: float | None = None,
          seed: float | None = None, rel_tol: float = REL_TOL) -> SequentialPartition | None:
    """Piper's optimum at one micro-batch size; None when no chain of stages fits in memory.

    ``bandwidth``: the instance's (default :func:`piper_bandwidth`). The returned bottleneck is
    the objective of the module docstring per sample (``T / b``). ``seed``: an upper bound on it to
    start from (None: :func:`_seed` up to :data:`LINEAR_SEED_MAX_DEVICES` devices, else :func:`_prefix_seed`).
    ``rel_tol``: the bisection stops when its bracket is this tight (relative).
    """
    lat = lattice if lattice is not None else Lattice.of(graph, max_downsets)
    costs = ReplicaCosts.of(cluster)
    b = micro_batch_size
    n_dev = cluster.num_devices
    bandwidth = piper_bandwidth(cluster) if bandwidth is None else bandwidth
    found = None
    if seed is None:
        seed = (_seed(lat, graph, cluster, batch_size, b, power_of_two, bandwidth) if n_dev <= LINEAR_SEED_MAX_DEVICES
                else _prefix_seed(graph, cluster, batch_size, b, power_of_two, bandwidth))
    for t_max in (seed, np.inf):
        tables = _tables(lat, costs, graph, batch_size, b, power_of_two, t_max, bandwidth)

        def probe(t: float):
            chain = _reconstruct(tables, _min_devices(lat, tables, t), t, n_dev)
            if chain is None:
                return None
            return chain, max(float(tables.tps[pair, ri]) for pair, ri in chain)

        found = probe(t_max)
        if found is not None or not np.isfinite(t_max):
            break
    if found is None:
        return None
    best, hi = found
    lo = lower_bound_tps(OpArrays.of(graph), n_dev, b) * (1 - REL_TOL)
    t = hi * (1 - rel_tol)                                    # first ask whether anything beats it at all
    while hi - lo > rel_tol * hi:
        result = probe(t)
        if result is None:
            lo = t
        else:
            best, hi = result
        t = (lo + hi) / 2
    stages = tuple((lat.ops_of(int(tables.src[p]), int(tables.dst[p])), int(tables.replicas[ri]))
                   for p, ri in best)
    return SequentialPartition(stages, hi, b)


def _round_robin(part: SequentialPartition | None) -> SequentialPartition | None:
    """Piper's replicas take whole micro-batches (``d`` divides ``M``, not ``b``): lay them out round-robin."""
    return None if part is None else replace(part, replica_mode="round-robin")


WORK_LIMIT = 10_000_000
"""Past :data:`LINEAR_SEED_MAX_DEVICES` devices Piper refuses a graph whose downset pairs times micro-batch
sizes exceed this. Each size scores every pair at every replica count (divisors of ``M`` up to ``N``) and
bisects over them, so the search grows with both: a chain's few hundred pairs stay cheap at 1024 devices,
a branchy model's millions do not (figures in evals/REPORT.md, "bench_scale"). Up to 32 devices the real
planner's own limits alone apply, as before."""


def _check_work(graph: OpGraph, num_devices: int, num_sizes: int) -> None:
    """Refuse, with the numbers and the fix, a search past :data:`WORK_LIMIT` (module constant's docstring)."""
    pairs = count_downset_pairs(graph)
    if pairs * num_sizes > WORK_LIMIT:
        raise DownsetLimitError(graph.name, count_downsets(graph), IDEALS_LIMIT, pairs * num_sizes, WORK_LIMIT,
                                what=f"has {pairs:,} downset pairs x {num_sizes} micro-batch sizes to score on "
                                     f"{num_devices} devices, more than the {WORK_LIMIT:,} Piper searches past "
                                     f"{LINEAR_SEED_MAX_DEVICES} devices",
                                fix=f"Use --strategy gpp or pipedream, or at most {LINEAR_SEED_MAX_DEVICES} devices")


def partition(graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions) -> SearchResult:
    """Piper's plan: the downset DP at every micro-batch candidate, best simulated 1F1B throughput.

    Raises :class:`~graphpipe.search.downsets.DownsetLimitError` (an
    ``InputError``) past ``options.max_downsets`` and
    :class:`~graphpipe.errors.InfeasibleError` when nothing fits.
    """
    started = time.perf_counter()
    num = count_downsets(graph)          # algo.cpp's rule: more than IDEALS_LIMIT ideals and it fails
    if num > min(options.max_downsets, IDEALS_LIMIT):
        raise DownsetLimitError(graph.name, num, min(options.max_downsets, IDEALS_LIMIT))
    candidates = micro_batch_candidates(batch_size, options)
    if cluster.num_devices > LINEAR_SEED_MAX_DEVICES:
        _check_work(graph, cluster.num_devices, len(candidates))
    lattice = Lattice.of(graph, options.max_downsets)   # our pair guard keeps its own scale
    sg, part, extra = choose_micro_batch(
        "piper", graph, cluster, batch_size, candidates, STRATEGY.default_schedule,
        lambda b, link: _round_robin(solve(graph, cluster, batch_size, b, options.power_of_two, lattice=lattice)),
        (None,), host=options.host)
    result = sequential_result(STRATEGY.default_schedule, sg, part, cluster, started, num_downsets=lattice.num_downsets,
                               num_downset_pairs=lattice.num_pairs, **extra)
    return replace(result, stats={**dict(result.stats), "replica_mode": "round-robin",
                                  "bandwidth_Bps": piper_bandwidth(cluster)})


CANDIDATE_MAX_DOWNSETS = 10_000
"""Piper's plan is a gpp candidate only on graphs with at most this many downsets (so, by Piper's own rule of
50 pairs per downset, at most 500,000 downset pairs): its search grows with the pairs. The cap admits the gnmt
profile (2,198 downsets) and leaves out the paper-size mmt (6,563 downsets but over four million pairs),
where Piper alone would take longer than every other strategy together; see evals/REPORT.md for timings."""

STRATEGY = Strategy(name="piper", partition=partition, default_schedule="1f1b", default_recompute="auto",
                    costs_recompute=False, gpp_candidate=True, candidate_max_downsets=CANDIDATE_MAX_DOWNSETS)
"""Piper: the downset DP, 1F1B. Its DP prices stages without re-materialization."""
