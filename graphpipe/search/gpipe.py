"""GPipe's partitioner (Huang et al., NeurIPS'19): an even split of the layer sequence.

GPipe places ``K`` consecutive groups of layers on ``K`` accelerators, one
each, balancing the work, and runs them fill-drain: all ``M`` forwards, then
all ``M`` backwards, bubble fraction ``(K - 1) / (M + K - 1)``.

Our version:

* **Sequence**: the op-id order (Kahn's algorithm, ties by input position;
  :func:`~graphpipe.search.sequential.linear_order`).
* **K** = number of devices, or the number of ops when there are fewer; one
  device per stage (GPipe has no data parallelism inside a stage).
* **Even split**: the linear-partition DP that minimises the largest stage
  forward + backward time, ``G(q, i) = min_j max(time(i..j), G(q - 1, j + 1))``
  for the best split of the ops from ``i`` on into ``q`` stages; the time per stage is
  :func:`~graphpipe.search.common.stage_tps` with one replica (forward +
  backward time per micro-batch divided by its size, so ranking by it is
  ranking by time at the chosen micro-batch size).
* **Re-materialization** (GPipe §2.3, on by default, ``--recompute none``
  turns it off): each stage keeps only its input activations for the ``M``
  micro-batches fill-drain holds in flight, plus one micro-batch's full
  activations while its backward re-runs the forward; the time per stage
  then includes one more forward (:mod:`graphpipe.costs`). Without it
  fill-drain keeps the whole mini-batch's activations on every stage.
  Splits whose stages do not fit are excluded.
* **Micro-batch size**: every candidate is split and the plan with the best
  simulated fill-drain throughput wins.

Example
-------
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> from graphpipe.cluster import preset
>>> ops = [Op(f"l{i}", "x", Affine(0, t), Affine(0, 2 * t)) for i, t in enumerate([1e-3, 1e-3, 2e-3])]
>>> g = OpGraph.build("chain", ops, [("l0", "l1", 1.0), ("l1", "l2", 1.0)])
>>> [ops for ops, _ in solve(g, preset("v100", 2), batch_size=8, micro_batch_size=2).stages]
[(0, 1), (2,)]
"""

from __future__ import annotations

import logging
import time

import numpy as np

from graphpipe.cluster import Cluster
from graphpipe.costs import range_received_saved
from graphpipe.graph import OpGraph
from graphpipe.search.common import SearchOptions, SearchResult, Strategy, micro_batch_candidates, recompute_all
from graphpipe.search.sequential import (OpArrays, ReplicaCosts, SequentialPartition, choose_micro_batch,
                                         linear_cut_bytes, linear_order, sequential_result)

__all__ = ["partition", "solve", "STRATEGY"]

log = logging.getLogger(__name__)


def solve(graph: OpGraph, cluster: Cluster, batch_size: int, micro_batch_size: int,
          recompute: bool = True) -> SequentialPartition | None:
    """The even split into ``min(devices, ops)`` contiguous stages; None when no split fits in memory."""
    order = linear_order(graph)
    n = len(order)
    num_stages = min(cluster.num_devices, n)
    b = micro_batch_size
    num_mbs = batch_size // b
    arrays = OpArrays.of(graph)
    costs = ReplicaCosts.of(cluster)

    def prefix(values: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(values[list(order)])))

    pa, pb, pp, pact, pfa, pfb = (prefix(a) for a in (arrays.compute_alpha, arrays.compute_beta, arrays.params,
                                                      arrays.act, arrays.fwd_alpha, arrays.fwd_beta))
    cut = np.concatenate(([0.0], linear_cut_bytes(graph, order)))  # cut[i]: bytes crossing into position i
    # cost[i, j] for the stage order[i..j] (j >= i): TPS on one device, inf when it does not fit.
    i_idx, j_idx = np.triu_indices(n)
    cost = np.full((n, n), np.inf)
    params = pp[j_idx + 1] - pp[i_idx]
    tps = costs.tps(pa[j_idx + 1] - pa[i_idx], pb[j_idx + 1] - pb[i_idx], params, 1, b, batch_size,
                    pfa[j_idx + 1] - pfa[i_idx], pfb[j_idx + 1] - pfb[i_idx], recompute)
    received = np.zeros((n, n))  # received[i, j]: received_saved_bytes of order[i..j]
    for i in range(n):
        received[i, i:] = range_received_saved(graph, order, i)
    mem = costs.memory(params, pact[j_idx + 1] - pact[i_idx] + received[i_idx, j_idx], 1, b, num_mbs, cut[i_idx],
                       cut[j_idx + 1], recompute)
    cost[i_idx, j_idx] = np.where(mem <= costs.memory_bytes, tps, np.inf)

    # best[q][i]: smallest max stage time splitting order[i..n-1] into exactly q stages.
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0, n] = 0.0
    for q in range(1, num_stages + 1):
        for i in range(n - q, -1, -1):                      # need at least q ops left
            ends = np.arange(i, n - q + 1)                  # first stage order[i..end]
            cand = np.maximum(cost[i, ends], best[q - 1, ends + 1])
            pick = int(np.argmin(cand))                     # earliest cut among equals
            best[q, i], cut[q, i] = cand[pick], ends[pick]
    if not np.isfinite(best[num_stages, 0]):
        return None
    stages, i = [], 0
    for q in range(num_stages, 0, -1):
        end = int(cut[q, i])
        stages.append((tuple(order[i:end + 1]), 1))
        i = end + 1
    return SequentialPartition(tuple(stages), float(best[num_stages, 0]), b, recompute)


def partition(graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions) -> SearchResult:
    """GPipe's plan: even split at every micro-batch candidate, best simulated fill-drain throughput.

    Every stage re-materializes unless ``options.recompute`` is ``none`` (or ``auto``, which the planner
    resolves by searching both ways)."""
    started = time.perf_counter()
    candidates = micro_batch_candidates(batch_size, options)
    recompute = recompute_all(options, default=True)
    sg, part, extra = choose_micro_batch("gpipe", graph, cluster, batch_size, candidates, STRATEGY.default_schedule,
                                         lambda b, _link: solve(graph, cluster, batch_size, b, recompute),
                                         host=options.host)
    return sequential_result(STRATEGY.default_schedule, sg, part, cluster, started, **extra)


STRATEGY = Strategy(name="gpipe", partition=partition, default_schedule="gpipe", default_recompute="all",
                    costs_recompute=True, segments_checkpoints=False)
"""GPipe: fill-drain; every stage re-materializes, whole, as in its paper (§2.3)."""
