"""Sequential stage layouts: what the SPP baselines (PipeDream, Piper, GPipe) share.

What the three share, so that they differ only in the space they search:

* the **linearisation** PipeDream and GPipe cut into contiguous ranges:
  the op-id order of :class:`~graphpipe.graph.OpGraph`, which is Kahn's
  algorithm with ties broken by input position (``OpGraph.build``); any
  contiguous range of a topological order is convex, so every range is a
  legal stage;
* the **downsets** (ideals) Piper's DP runs over live in
  :mod:`graphpipe.search.downsets`;
* **vectorised stage costs**: the formulas of :mod:`graphpipe.costs`
  evaluated on numpy arrays of candidate stages (the DPs score millions of candidates). A stage of ``r``
  replicas is costed on the canonical device set ``0..r-1`` (inside one node
  when ``r <= devices_per_node``, as gpp does); stages are later placed on
  disjoint device blocks (:func:`layouts`) and the reported bottleneck is
  recomputed with :func:`stage_tps` on the placed devices;
* **communication** (PipeDream's ``2 C`` term): a cut carrying ``B`` bytes
  per sample costs ``2 (latency / b + B / bandwidth)`` per sample
  (:func:`~graphpipe.search.common.cut_tps`), a pipeline stage of its own
  in the min-max objective. The bandwidth is that of the hierarchy level the cut lands on, which the
  DP cannot know before placement, so PipeDream and Piper are solved
  without the term and with each link of the cluster
  (:func:`~graphpipe.search.common.comm_links`);
* **plan choice** (:func:`choose_micro_batch`): every candidate micro-batch
  size x cut costing is partitioned, each answer placed in each layout,
  and the plans are compared by *simulated* throughput under the
  strategy's own schedule, as ``gpp`` does.

Memory model (PipeDream §3.1): under 1F1B stage ``q`` of ``K`` keeps
``min(K - q, M)`` micro-batches in flight, ``M = batch / micro_batch``.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> g = OpGraph.build("c", [Op("a", "x"), Op("b", "x"), Op("c", "x")], [("a", "b", 4), ("b", "c", 8)])
>>> linear_order(g), linear_cut_bytes(g, linear_order(g)).tolist()
((0, 1, 2), [4.0, 8.0, 0.0])
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from graphpipe import costs
from graphpipe.cluster import Cluster, Link
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph
from graphpipe.search.common import SearchResult, link_name, placed_bottleneck, simulated
from graphpipe.stages import Stage, StageGraph

__all__ = [
    "linear_order",
    "OpArrays",
    "ReplicaCosts",
    "SequentialPartition",
    "layouts",
    "linear_cut_bytes",
    "choose_micro_batch",
    "sequential_result",
    "replica_mask",
    "lower_bound_tps",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- linearisation
def linear_order(graph: OpGraph) -> tuple[int, ...]:
    """The topological order the sequential baselines cut: op ids 0..n-1.

    ``OpGraph`` ids already are Kahn's order with ties by input position, so
    the linearisation is deterministic and shared with every other module.
    """
    for e in graph.edges:
        if e.src >= e.dst:  # pragma: no cover - OpGraph guarantees it
            raise InputError(f"op ids of {graph.name!r} are not topological at edge {e.src}->{e.dst}")
    return tuple(range(graph.num_ops))


# ------------------------------------------------------------ vectorised costs
@dataclass(frozen=True, slots=True)
class OpArrays:
    """Per-op cost coefficients as arrays, so that stage sums are dot products or prefix differences."""

    compute_alpha: np.ndarray
    """fwd.alpha + bwd.alpha (seconds per call)."""
    compute_beta: np.ndarray
    """fwd.beta + bwd.beta (seconds per sample)."""
    params: np.ndarray
    act: np.ndarray
    fwd_alpha: np.ndarray
    """fwd.alpha alone: what a re-materializing stage runs again inside B."""
    fwd_beta: np.ndarray

    @classmethod
    def of(cls, graph: OpGraph) -> "OpArrays":
        ops = graph.ops
        return cls(np.array([op.fwd.alpha + op.bwd.alpha for op in ops], dtype=float),
                   np.array([op.fwd.beta + op.bwd.beta for op in ops], dtype=float),
                   np.array([float(op.param_bytes) for op in ops], dtype=float),
                   np.array([float(op.act_bytes) for op in ops], dtype=float),
                   np.array([op.fwd.alpha for op in ops], dtype=float),
                   np.array([op.fwd.beta for op in ops], dtype=float))


@dataclass(frozen=True, slots=True)
class ReplicaCosts:
    """The formulas of :mod:`graphpipe.costs` for stages of ``r`` replicas on devices ``0..r-1``.

    ``link_latency[r]`` / ``link_bandwidth[r]`` are the link a ring over
    ``0..r-1`` runs on (inter-node iff ``r > devices_per_node``); index 0 is
    unused (a stage has at least one replica). :meth:`tps` and
    :meth:`memory` are :func:`graphpipe.costs.time_per_sample` and
    :func:`graphpipe.costs.memory_bytes` on arrays.
    """

    num_devices: int
    link_latency: np.ndarray
    link_bandwidth: np.ndarray
    bytes_per_param: float
    memory_bytes: float

    @classmethod
    def of(cls, cluster: Cluster) -> "ReplicaCosts":
        lat, bandwidth = costs.replica_link_tables(cluster)
        return cls(cluster.num_devices, lat, bandwidth, float(cluster.bytes_per_param), cluster.memory_bytes)

    @property
    def state_per_byte(self) -> float:
        """Model-state bytes per parameter byte (:func:`graphpipe.costs.state_bytes` of one byte)."""
        return costs.state_bytes(1.0, self.bytes_per_param)

    def tps(self, compute_alpha, compute_beta, params, r, micro_batch_size: int, batch_size: int,
            fwd_alpha=0.0, fwd_beta=0.0, recompute=False):
        """Vectorised stage time per sample: arrays broadcast against each other and against ``r``.

        ``compute_*`` are forward + backward sums; ``fwd_*`` the forward alone, needed only with ``recompute``.
        """
        return costs.time_per_sample(fwd_alpha, fwd_beta, compute_alpha - fwd_alpha, compute_beta - fwd_beta, params,
                                     r, micro_batch_size, batch_size, self.link_latency[r], self.link_bandwidth[r],
                                     recompute)

    def memory(self, params, act, r, micro_batch_size: int, in_flight, inputs=0.0, outputs=0.0, recompute=False):
        """Vectorised stage memory: state + buffers + activations of ``in_flight`` micro-batches.

        ``inputs``/``outputs``: bytes per sample entering / leaving the stage (the cuts around it);
        left at 0 the buffer term is not charged.
        """
        return costs.memory_bytes(params, act, inputs, outputs, micro_batch_size / r, in_flight, recompute,
                                  self.bytes_per_param)


# ----------------------------------------------------------- partitions, plans
@dataclass(frozen=True, slots=True)
class SequentialPartition:
    """A sequence of stages (op ids, replica count) in pipeline order and its model bottleneck."""

    stages: tuple[tuple[tuple[int, ...], int], ...]
    bottleneck_tps: float
    """max stage TPS on the canonical device sets (the DP's objective)."""
    micro_batch_size: int
    recompute: bool = False
    """Every stage re-materializes (GPipe's default)."""
    replica_mode: str = "split"
    """How replicated stages share micro-batches (``graphpipe.stages.REPLICA_MODES``; Piper: round-robin)."""


def layouts(graph: OpGraph, cluster: Cluster, batch_size: int, part: SequentialPartition) -> list[StageGraph]:
    """The stages on disjoint device blocks, in each distinct layout tried; sequential stage graphs.

    The DPs cost ``r`` replicas as devices ``0..r-1`` (inside one node when
    ``r <= devices_per_node``). Two layouts are tried: contiguous blocks in
    pipeline order (neighbouring stages share a node, so transfers stay on
    NVLink) and blocks largest first (power-of-two blocks then align with
    nodes, so no all-reduce crosses a node needlessly); the caller keeps the
    one the simulator rates faster, pipeline order on ties. Each is a
    ``sequential`` stage graph (SPP: stage i feeds only stage i + 1, which
    relays everything crossing the cut) whose ids keep the pipeline order,
    as the 1F1B in-flight counts assumed; ``StageGraph.build`` checks
    partition, convexity, disjoint devices and edge direction.
    """
    counts = [replicas for _, replicas in part.stages]
    pipeline_order = list(range(len(counts)))
    largest_first = sorted(pipeline_order, key=lambda q: (-counts[q], q))
    out, seen = [], set()
    for order in (pipeline_order, largest_first):
        devices: list[tuple[int, ...]] = [()] * len(counts)
        next_device = 0
        for q in order:
            devices[q] = tuple(range(next_device, next_device + counts[q]))
            next_device += counts[q]
        if tuple(devices) in seen:
            continue
        seen.add(tuple(devices))
        stages = [Stage(q, tuple(ops), devices[q], part.micro_batch_size, part.recompute,
                        replica_mode=part.replica_mode if len(devices[q]) > 1 else "split")
                  for q, (ops, _) in enumerate(part.stages)]
        out.append(StageGraph.build(graph, stages, batch_size, cluster.num_devices, sequential=True))
    return out


def linear_cut_bytes(graph: OpGraph, order: Sequence[int]) -> np.ndarray:
    """Bytes per sample crossing the cut after position ``j`` of ``order`` (``j = 0..n-1``; the last is 0).

    Every edge from position ``p`` to ``q > p`` crosses the cuts ``p..q-1``
    (a sequential pipeline relays it through the stages between).
    """
    pos = {v: i for i, v in enumerate(order)}
    diff = np.zeros(len(order) + 1)
    for e in graph.edges:
        diff[pos[e.src]] += e.bytes
        diff[pos[e.dst]] -= e.bytes
    return np.cumsum(diff)[: len(order)]


def choose_micro_batch(strategy: str, graph: OpGraph, cluster: Cluster, batch_size: int,
                       candidates: Sequence[int], schedule_name: str,
                       solve: Callable[[int, Link | None], SequentialPartition | None],
                       links: Sequence[Link | None] = (None,), host=None) -> tuple[StageGraph, SequentialPartition, dict]:
    """Partition at every candidate micro-batch size and cut cost, keep the best simulated throughput.

    ``solve(b, link)`` is the strategy's DP at micro-batch size ``b`` with
    cuts costed on ``link`` (``None``: not costed); every distinct answer is
    simulated in every distinct :func:`layouts`. Ties go to the smaller
    model bottleneck, then to the smaller micro-batch size, then to the
    earlier link and layout, so the choice is deterministic. Raises
    :class:`InfeasibleError` when no size gives a partition that fits in
    memory. ``host`` (a :class:`graphpipe.sched.SharedHost`) simulates on a
    shared host.
    """
    tried = []
    plans = []  # (b, link index, layout index, partition, stage graph)
    for b in candidates:
        seen: set = set()
        for li, link in enumerate(links):
            part = solve(b, link)
            if part is None:
                tried.append(f"{b}: no partition fits")
                break  # the cut term never changes which partitions fit in memory
            if part.stages in seen:
                continue
            seen.add(part.stages)
            for lay, sg in enumerate(layouts(graph, cluster, batch_size, part)):
                plans.append((b, li, lay, part, sg))
    # Simulate the most promising first (lowest bound on the iteration time) and skip a plan whose bound
    # already loses to the best simulated one: at 1024 devices a small micro-batch means 16,384 of them to
    # simulate. The winner is the same: the key below orders every plan, whatever the order they are scored in.
    bounds = [_iteration_bound_s(sg, cluster, host) for *_, sg in plans]
    best = None
    for index in sorted(range(len(plans)), key=lambda x: (bounds[x], x)):
        b, li, lay, part, sg = plans[index]
        if best is not None and bounds[index] > 0 and batch_size / bounds[index] < best[3] * (1 - 1e-6):
            tried.append(f"{b}/{li}/{lay}: bound {batch_size / bounds[index]:.4g} samples/s, not simulated")
            continue
        throughput = simulated(sg, cluster, schedule_name, host)[0]
        tried.append(f"{b}/{li}/{lay}: {throughput:.4g} samples/s")
        key = (-throughput, part.bottleneck_tps, b, li, lay)
        if best is None or key < best[0]:
            best = (key, sg, part, throughput)
    log.debug("%s micro-batch candidates: %s", strategy, "; ".join(tried))
    if best is None:
        from graphpipe.search.refusal import sequential_memory_refusal

        raise sequential_memory_refusal(strategy, graph, cluster, candidates, forced=len(candidates) == 1,
                                        batch_size=batch_size)
    (_, _, _, li, _), sg, part, throughput = best
    return sg, part, {"throughput_estimate": throughput, "cut_link": link_name(cluster, links[li])}




def _iteration_bound_s(sg: StageGraph, cluster: Cluster, host=None) -> float:
    """A lower bound of ``sg``'s simulated iteration time under any schedule on dedicated devices
    (:func:`graphpipe.search.gpp.pipeline_bound_s`); 0 (no bound) on a shared host."""
    if host is not None:
        return 0.0
    from graphpipe.search.gpp import pipeline_bound_s

    return pipeline_bound_s(sg, cluster)


def replica_mask(num_devices: int, micro_batch_size: int, power_of_two: bool = False) -> np.ndarray:
    """``mask[r - 1]``: may a stage have ``r`` replicas? They must split the micro-batch evenly
    (a StageGraph invariant), and be a power of two under ``SearchOptions.power_of_two``."""
    r = np.arange(1, num_devices + 1)
    ok = micro_batch_size % r == 0
    if power_of_two:
        ok &= (r & (r - 1)) == 0
    return ok


def lower_bound_tps(arrays: OpArrays, num_devices: int, micro_batch_size: int) -> float:
    """A bound no partition beats: every stage has ``r * TPS >= compute(b) / b`` and ``sum r <= N``."""
    b = micro_batch_size
    total = float(arrays.compute_alpha.sum() + arrays.compute_beta.sum() * b)
    return total / (b * num_devices)


def sequential_result(strategy_schedule: str, sg: StageGraph, part: SequentialPartition, cluster: Cluster,
                      started: float, **extra) -> SearchResult:
    """The SearchResult every sequential baseline returns: same stats keys for all three."""
    stats = {
        "time_s": time.perf_counter() - started,
        "bottleneck_tps": placed_bottleneck(sg, cluster),
        "model_bottleneck_tps": part.bottleneck_tps,
        "micro_batch_size": part.micro_batch_size,
        "devices_used": len(sg.devices_used()),
        "num_stages": sg.num_stages,
        **extra,
    }
    return SearchResult(stage_graph=sg, schedule_name=strategy_schedule, stats=stats)
