"""The linearised min-max DP over our own cost model: Piper's seed and the tests' oracle.

This was ``--strategy pipedream`` until that strategy became the real
optimizer's hierarchical DP (:mod:`graphpipe.search.pipedream`). It stays as
a DP over *our* cost definitions (:func:`~graphpipe.search.common.stage_tps`,
``stage_memory``, micro-batch-splitting replicas), which is what Piper needs
as an upper bound on its own search (a chain of contiguous ranges is one of
Piper's chains) and what the brute-force tests check. It follows PipeDream's
first (flat) recursion

    A(j, m) = min over i < j, m' <= m of max(A(i, m - m'), 2 C_i, T(i+1..j, m'))

over prefixes ``1..j`` of the layer order on ``m`` machines.

Our version of that DP:

* **Linearisation**: the op-id order of the graph (Kahn's algorithm, ties
  by input position; :func:`~graphpipe.search.sequential.linear_order`).
* **Stage time**: :func:`graphpipe.search.common.stage_tps`, the objective
  shared by every partitioner, and the cut after the stage as a stage of
  its own, ``2 C`` per sample (:func:`~graphpipe.search.common.cut_tps`:
  the bytes of every edge crossing the cut, forward and back, at one
  link's latency and bandwidth). PipeDream takes the bandwidth of the
  hierarchy level the cut sits on, known here only after placement, so
  :func:`partition` solves without the term and with each of the cluster's
  links (:func:`~graphpipe.search.common.comm_links`) and lets the
  simulator pick. Without it a slow link can make PipeDream cut where
  activations are largest: 1F1B keeps only ``K - q`` micro-batches in
  flight, so transfer delays longer than the downstream work stall it
  (VGG-16 at 16 V100s lost 2x that way).
* **Memory**: 1F1B keeps ``min(K - q, M)`` micro-batches in flight on stage
  ``q`` of ``K`` (§3.1; ``M`` micro-batches per iteration), so a stage's
  memory depends on how many stages *follow* it. The recursion therefore
  runs over suffixes, with the number of stages in the suffix as an extra
  index: ``V(i, m, k)`` = best bottleneck of ops ``i..n-1`` on at most
  ``m`` devices as ``k`` stages. Stages that do not fit are excluded.
  ``k`` is capped at ``M``: any stage with ``M`` or more stages after it
  holds ``M`` micro-batches, so those counts share one bucket.
* **Replicas and devices**: a stage's replica count divides its micro-batch
  (each replica gets an equal share) and is costed on devices ``0..r-1``,
  as in gpp; devices need not all be used (``V(n, m, 0) = 0`` for every
  ``m``); :func:`~graphpipe.search.sequential.layouts` then lays the stages
  out on disjoint device blocks.
* **Micro-batch size**: every candidate x cut costing is partitioned and
  the plan with the best simulated 1F1B throughput wins (as gpp does).

Ties are broken toward fewer stages, then the earliest cut, then fewer
replicas for the earlier stage, so results are deterministic.

Example
-------
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> from graphpipe.cluster import preset
>>> ops = [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3), 4e6, 1e5) for i in range(4)]
>>> g = OpGraph.build("chain", ops, [(f"l{i}", f"l{i+1}", 1e4) for i in range(3)])
>>> part = solve(g, preset("v100", 2), batch_size=8, micro_batch_size=2)
>>> [(ops, r) for ops, r in part.stages]
[((0, 1), 1), ((2, 3), 1)]
"""

from __future__ import annotations

import logging
import time

import numpy as np

from graphpipe.cluster import Cluster, Link
from graphpipe.costs import range_received_saved
from graphpipe.graph import OpGraph
from graphpipe.search.common import SearchOptions, SearchResult, Strategy, comm_links, cut_tps, micro_batch_candidates
from graphpipe.search.sequential import (OpArrays, ReplicaCosts, SequentialPartition, choose_micro_batch,
                                         linear_cut_bytes, linear_order, sequential_result, replica_mask)

__all__ = ["partition", "solve", "STRATEGY"]

log = logging.getLogger(__name__)


def solve(graph: OpGraph, cluster: Cluster, batch_size: int, micro_batch_size: int,
          power_of_two: bool = False, link: Link | None = None) -> SequentialPartition | None:
    """PipeDream's DP at one micro-batch size; None when no partition fits in memory.

    Replica counts divide the micro-batch size (and are powers of two when
    ``power_of_two``), see :func:`~graphpipe.search.sequential.replica_mask`.
    With ``link``, the cut after every stage but the last costs
    :func:`~graphpipe.search.common.cut_tps` on it (PipeDream's ``2 C``).
    """
    order = linear_order(graph)
    n, num_devices = len(order), cluster.num_devices
    b = micro_batch_size
    num_mbs = batch_size // b
    max_k = min(num_devices, n, num_mbs)  # last index is the ">= max_k stages" bucket when num_mbs is the cap
    arrays = OpArrays.of(graph)
    costs = ReplicaCosts.of(cluster)

    # Prefix sums along the linear order: a stage i..j sums to prefix[j + 1] - prefix[i].
    def prefix(values: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(values[list(order)])))

    pa, pb, pp, pact = (prefix(a) for a in (arrays.compute_alpha, arrays.compute_beta, arrays.params, arrays.act))
    cut = cut_tps(linear_cut_bytes(graph, order), link, b)  # cut[j]: after position j (0 after the last op)
    # Replica counts, axis "r": only the allowed ones (they split the micro-batch), ascending, so the
    # first-minimum tie-break (earliest cut, then fewest replicas) is the one over every count 1..N.
    r = np.flatnonzero(replica_mask(num_devices, b, power_of_two)) + 1
    k = np.arange(1, max_k + 1)                            # stages in the suffix, axis "k"
    m = np.arange(0, num_devices + 1)                      # devices available, axis "m"
    # rest[m, r] = m - r devices left for the following stages (-1 = not enough).
    rest = m[:, None] - r[None, :]
    rest_ok = rest >= 0
    rest = np.where(rest_ok, rest, 0)
    # Stage ends are taken in chunks so the (j, m, r, k) candidate array stays near CHUNK_CELLS cells
    # at any device count (1024 devices: ~1,000 x 11 x 34 cells per stage end).
    per_end = (num_devices + 1) * len(r) * max_k
    chunk = max(1, CHUNK_CELLS // max(1, per_end))

    # value[i][m, k]: the DP table V(i, m, k) (axis k = 0..max_k); choice[i][m, k] = (j, r, k_next).
    inf = np.inf
    value = [np.full((num_devices + 1, max_k + 1), inf) for _ in range(n + 1)]
    value[n][:, 0] = 0.0
    choice: list[np.ndarray | None] = [None] * (n + 1)
    for i in range(n - 1, -1, -1):
        received = range_received_saved(graph, order, i)
        best_value = np.full((num_devices + 1, max_k), inf)
        best_choice = np.zeros((num_devices + 1, max_k, 3), dtype=np.int64)
        for lo in range(i, n, chunk):
            j = np.arange(lo, min(n, lo + chunk))          # stage = order[i..j], axis "j"
            got, how = _stage_ends(value, i, j, pa, pb, pp, pact, received, cut,
                                   r, k, rest, rest_ok, costs, b, batch_size, num_mbs, max_k)
            better = got < best_value                       # strict: an earlier chunk (earlier cut) wins ties
            best_value = np.where(better, got, best_value)
            best_choice = np.where(better[:, :, None], how, best_choice)
        value[i][:, 1:] = best_value
        choice[i] = best_choice

    top = value[0][num_devices]
    num_stages = int(np.argmin(top))                       # fewest stages among the best
    if not np.isfinite(top[num_stages]):
        return None
    stages = []
    i, avail, kk = 0, num_devices, num_stages
    while i < n:
        j_end, replicas, k_next = (int(x) for x in choice[i][avail, kk - 1])
        stages.append((tuple(order[i:j_end + 1]), replicas))
        i, avail, kk = j_end + 1, avail - replicas, k_next
    return SequentialPartition(tuple(stages), float(top[num_stages]), b)


CHUNK_CELLS = 2_000_000
"""Cells of the (stage end, devices, replicas, stages) candidate array :func:`solve` builds at once."""


def _stage_ends(value, i: int, j: np.ndarray, pa, pb, pp, pact, received: float, cut: np.ndarray, r: np.ndarray,
                k: np.ndarray, rest: np.ndarray, rest_ok: np.ndarray, costs: ReplicaCosts, b: int,
                batch_size: int, num_mbs: int, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best first stage ``order[i..j]`` over the stage ends ``j`` given, for every (m, k).

    Returns (value (m, k), choice (m, k, 3) as (j, r, k_next)); the first minimum over (j, r) in
    that order wins, i.e. the earliest cut, then the fewest replicas.
    """
    sa, sb = pa[j + 1] - pa[i], pb[j + 1] - pb[i]
    sp, sact = pp[j + 1] - pp[i], pact[j + 1] - pact[i] + received
    tps = costs.tps(sa[:, None], sb[:, None], sp[:, None], r[None, :], b, batch_size)          # (j, r)
    tps = np.maximum(tps, cut[j][:, None])                                                   # + the cut after it
    mem = costs.memory(sp[:, None, None], sact[:, None, None], r[None, :, None], b, k[None, None, :])
    fits = mem <= costs.memory_bytes                                                          # (j, r, k)
    # Following suffix: V(j + 1, m - r, k - 1); the capped bucket also accepts max_k after it.
    nxt = np.stack([value[jj + 1] for jj in j])                                              # (j, m, k)
    follow = nxt[:, :, :-1]                                                                  # k-1 for k=1..max_k
    follow_from = np.broadcast_to(k - 1, follow.shape).copy()
    if num_mbs == max_k:
        cap = nxt[:, :, max_k]
        better = cap < follow[:, :, -1]
        follow[:, :, -1] = np.where(better, cap, follow[:, :, -1])
        follow_from[:, :, -1] = np.where(better, max_k, max_k - 1)
    after = follow[:, rest, :]                                                               # (j, m, r, k)
    after_from = follow_from[:, rest, :]
    cand = np.maximum(tps[:, None, :, None], after)
    cand = np.where(rest_ok[None, :, :, None] & fits[:, None, :, :], cand, np.inf)
    num_m = rest.shape[0]
    flat = cand.transpose(1, 3, 0, 2).reshape(num_m, max_k, -1)                             # (m, k, j*r)
    best = flat.argmin(axis=2)
    got = np.take_along_axis(flat, best[:, :, None], axis=2)[:, :, 0]
    best_j, best_r = np.divmod(best, len(r))
    from_flat = after_from.transpose(1, 3, 0, 2).reshape(num_m, max_k, -1)
    best_from = np.take_along_axis(from_flat, best[:, :, None], axis=2)[:, :, 0]
    return got, np.stack([j[best_j], r[best_r], best_from], axis=-1)


def partition(graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions) -> SearchResult:
    """The linear DP's plan: every micro-batch candidate and cut costing, best simulated 1F1B throughput.

    Raises :class:`~graphpipe.errors.InfeasibleError` when nothing fits.
    """
    started = time.perf_counter()
    candidates = micro_batch_candidates(batch_size, options)
    sg, part, extra = choose_micro_batch("linear-dp", graph, cluster, batch_size, candidates, STRATEGY.default_schedule,
                                         lambda b, link: solve(graph, cluster, batch_size, b, options.power_of_two, link),
                                         comm_links(cluster), host=options.host)
    return sequential_result(STRATEGY.default_schedule, sg, part, cluster, started, **extra)


STRATEGY = Strategy(name="linear-dp", partition=partition, default_schedule="1f1b", default_recompute="auto",
                    costs_recompute=False)
"""The chain DP on its own (not a ``--strategy``; Piper's building block, kept for tests and comparisons)."""
