"""PipeDream's partitioner (Narayanan et al., SOSP'19, §3.1) as its optimizer computes it: the SPP baseline.

``--strategy pipedream`` runs the hierarchical DP of msr-fiddle/pipedream's
``optimizer/optimizer_graph_hierarchical.py`` over the antichain DAG
(:mod:`graphpipe.search.pipedream_dp`, which states the formulas), places
the stages level by level, feeds replicas whole micro-batches round-robin
(1F1B-RR: micro-batch ``i`` to replica ``i mod r``, so any replica count
works, 3 + 1 included) and schedules them with 1F1B.

* **Levels from the cluster**: devices per node at the intra-node bandwidth,
  then nodes at the inter-node bandwidth (the optimizer's
  ``-n DPN NODES -b INTRA INTER``). A cluster whose links are identical is
  one flat level of ``N`` devices (a hierarchy with equal links only
  restricts the search), as is one whose ``N`` fits in a node. ``N`` that
  neither fits in a node nor is a multiple of the node size is refused:
  the levels cannot hold it (:class:`InfeasibleError`, so that a search
  over device counts skips it; one line and exit 2 on the command line).
* **Micro-batch**: PipeDream's unit of work is one replica's minibatch, the
  batch the profile was taken at; with ``--batch-size`` ``B`` on ``N``
  devices that is the data-parallel share ``B / N`` (``128 N`` on ``N``
  devices gives PipeDream's 128), or ``--micro-batch-size``. The DP's
  times are per micro-batch; ``search.model_bottleneck_tps`` is the DP's
  objective (the optimizer's "time per stage in pipeline") divided by it.
* **Memory** is kept as an extra constraint (see the kernel), and the plan
  is simulated: when its simulated peak does not fit, the next smaller
  divisor of the batch is tried as the micro-batch (what a PipeDream user
  does on running out of memory: lower the per-worker minibatch);
  ``search.micro_batch_share`` keeps the data-parallel share.
* **Branchy graphs**: past :data:`~graphpipe.search.pipedream_dp.MAX_STATES`
  antichain states (mmt has about 6,600, candle-uno and dlrm far more; the
  real optimizer cannot run there either) the same DP runs over the prefixes
  of the linearisation (``search.states`` says ``linearised``, else
  ``antichains``).
* Link latency and ``power_of_two`` are not part of PipeDream's search and
  are ignored by it (the simulator still charges latency).

Example
-------
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> from graphpipe.cluster import preset
>>> heavy = Op("l0", "x", Affine(0, 3e-3), Affine(0, 6e-3), 0, 1e3, 1e3)   # heavy, no weights: replicate it
>>> ops = [heavy] + [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3), 4e8, 1e3, 1e3) for i in (1, 2)]
>>> g = OpGraph.build("chain", ops, [("l0", "l1", 1e3), ("l1", "l2", 1e3)])
>>> result = partition(g, preset("v100", 4).with_memory(1e12), 32, SearchOptions())
>>> [(s.op_ids, s.devices, s.replica_mode) for s in result.stage_graph.stages]
[((0,), (0, 1), 'round-robin'), ((1,), (2,), 'split'), ((2,), (3,), 'split')]
>>> cluster_levels(preset("v100", 8))
((4, 50000000000.0), (2, 12500000000.0))
"""

from __future__ import annotations

import logging
import time

from graphpipe.cluster import Cluster
from graphpipe.errors import InfeasibleError, PlanError
from graphpipe.graph import OpGraph
from graphpipe.search.common import SearchOptions, SearchResult, Strategy, divisors, placed_bottleneck, simulated_peaks
from graphpipe.search.pipedream_dp import StateLimitError, antichain_states, prefix_states, solve_levels
from graphpipe.search.refusal import divisor_error, pipedream_refusal
from graphpipe.stages import Stage, StageGraph

__all__ = ["partition", "cluster_levels", "pipedream_micro_batch", "STRATEGY", "REPLICA_MODE"]

log = logging.getLogger(__name__)

REPLICA_MODE = "round-robin"
"""How PipeDream's replicas share work (1F1B-RR); recorded in ``search.replica_mode``."""


def cluster_levels(cluster: Cluster) -> tuple[tuple[int, float], ...]:
    """``(machines, bandwidth)`` per level, lowest first, as the optimizer's ``-n`` / ``-b`` (module docstring)."""
    n, per_node = cluster.num_devices, cluster.devices_per_node
    intra, inter = cluster.intra_node.bandwidth_Bps, cluster.inter_node.bandwidth_Bps
    if n <= per_node or intra == inter:
        return ((n, intra if n <= per_node else inter),)
    if per_node == 1:
        return ((n, inter),)
    if n % per_node:
        raise InfeasibleError(f"pipedream: the cluster's levels ({per_node} devices per node, then nodes) cannot hold "
                         f"{n} devices; use a multiple of {per_node} devices (or at most {per_node})")
    return ((per_node, intra), (n // per_node, inter))


def pipedream_micro_batch(batch_size: int, num_devices: int, options: SearchOptions) -> int:
    """The forced micro-batch, else the data-parallel share ``batch / N`` (largest divisor of the batch not above it)."""
    if options.micro_batch_size is not None:
        if batch_size % options.micro_batch_size:
            raise divisor_error(options.micro_batch_size, batch_size)
        return options.micro_batch_size
    share = max(1, batch_size // num_devices)
    return max(d for d in divisors(batch_size) if d <= share)


def partition(graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions) -> SearchResult:
    """PipeDream's plan (module docstring). Raises :class:`InfeasibleError` when no stage layout fits in memory."""
    started = time.perf_counter()
    levels = cluster_levels(cluster)
    share = pipedream_micro_batch(batch_size, cluster.num_devices, options)
    try:
        states, state_kind = antichain_states(graph), "antichains"
    except StateLimitError as exc:
        log.info("%s; cutting the linearisation instead", exc)
        states, state_kind = prefix_states(graph), "linearised"
    sizes = [share] if options.micro_batch_size is not None else \
        [d for d in sorted(divisors(batch_size), reverse=True) if d <= share]
    tried: list = []  # (micro-batch, why it failed) for the refusal message
    found, not_a_partition = _solve(graph, cluster, batch_size, options, states, levels, sizes, tried)
    if not_a_partition:
        # On some branchy graphs the optimizer's antichain order is not nested, and its answer
        # then names a stage that is not a set of ops (empty, or an op in two stages): PipeDream's
        # own optimizer would emit it; we cut the linearisation instead, as past the state limit.
        log.info("pipedream: the antichain DP's answer is not a partition of %s; cutting the linearisation",
                 graph.name)
        states, state_kind = prefix_states(graph), "linearised (antichain answer not a partition)"
        tried.clear()
        found, _ = _solve(graph, cluster, batch_size, options, states, levels, sizes, tried)
    if found is None:
        raise pipedream_refusal(graph, cluster, batch_size, tried, options.micro_batch_size is not None, states, levels,
                                REPLICA_MODE, STRATEGY.default_schedule)
    b, sol, sg = found
    stats = {
        "time_s": time.perf_counter() - started,
        "bottleneck_tps": placed_bottleneck(sg, cluster),
        "model_bottleneck_tps": sol.time_per_batch / b,
        "pipedream_time_per_stage_s": sol.time_per_batch,
        "micro_batch_size": b,
        "micro_batch_share": share,
        "devices_used": len(sg.devices_used()),
        "num_stages": sg.num_stages,
        "replica_mode": REPLICA_MODE,
        "replicas": [r for _, r, _ in sol.stages],
        "levels": [[m, bw] for m, bw in levels],
        "num_states": len(states.members),
        "states": state_kind,
    }
    log.debug("pipedream: %d states, levels %s, replicas %s, %.6g s per micro-batch of %d", len(states.members),
              levels, stats["replicas"], sol.time_per_batch, b)
    return SearchResult(stage_graph=sg, schedule_name=STRATEGY.default_schedule, stats=stats)


def _solve(graph: OpGraph, cluster: Cluster, batch_size: int, options: SearchOptions, states, levels,
           sizes, tried: list) -> tuple[tuple | None, bool]:
    """The first micro-batch size whose DP answer is a partition that fits (simulated): ``((b, sol, sg), False)``;
    ``(None, True)`` when the DP's answer is not a partition of the graph, ``(None, False)`` when nothing fits.
    Each size that fails is appended to ``tried`` with why (:data:`graphpipe.search.refusal.Tried`)."""
    for b in sizes:
        sol = solve_levels(states, graph, b, levels, memory_bytes=cluster.memory_bytes,
                           state_per_byte=cluster.state_bytes(1.0), num_micro_batches=batch_size // b)
        if sol is None or max(r for _, r, _ in sol.stages) > batch_size // b:
            # nothing fits, or a round-robin stage has more replicas than micro-batches
            tried.append((b, "memory", None) if sol is None else (b, "replicas", max(r for _, r, _ in sol.stages)))
            continue
        try:
            stages = [Stage(q, ops, devices, b, replica_mode=REPLICA_MODE if r > 1 else "split")
                      for q, (ops, r, devices) in enumerate(sol.stages)]
            sg = StageGraph.build(graph, stages, batch_size, cluster.num_devices, sequential=True)
        except PlanError as exc:
            log.info("pipedream: the DP's answer at micro-batch %d is not a partition (%s)", b, exc)
            return None, True
        if max(simulated_peaks(sg, cluster, STRATEGY.default_schedule)) <= cluster.memory_bytes:
            return (b, sol, sg), False
        tried.append((b, "simulated", sg))
        log.info("pipedream: the plan at micro-batch %d does not fit in memory (simulated); trying smaller", b)
    return None, False


STRATEGY = Strategy(name="pipedream", partition=partition, default_schedule="1f1b", default_recompute="auto",
                    costs_recompute=False, exact_devices=True, gpp_candidate=True)
"""PipeDream: 1F1B with round-robin replicas. Planned on exactly N devices: its optimizer always spreads the
stages over all N machines (its DP splits m machines between the last stage and the rest, never leaving one
idle), and ``--strategy pipedream`` must give that optimizer's answer, not a plan on fewer devices it never
makes. Its DP prices stages without re-materialization."""
