"""What every partitioner shares: options, result type, and the one cost definition.

Every strategy module (``gpp``, ``pipedream``, ``piper``, ``gpipe``) exposes
``partition(graph, cluster, batch_size, options) -> SearchResult``. They all
score a candidate stage with :func:`stage_tps` and :func:`stage_memory`, so
the brute-force oracles in the tests and the partitioners agree on the
objective. Final plans are then scored by the one simulator.

Time per sample (TPS) of a stage (GraphPipe §4, "bottleneck TPS"): one
replica processes ``b / r`` samples per micro-batch of size ``b`` over ``r``
replicas, so the stage spends ``fwd(b/r) + bwd(b/r)`` seconds per ``b``
samples, plus the gradient all-reduce once per iteration of ``batch_size``
samples. The pipeline's throughput is bounded by ``1 / max_stage TPS``.

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
from typing import Any, Iterable, Mapping, Sequence

from graphpipe.cluster import Cluster
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph
from graphpipe.stages import StageGraph

__all__ = ["SearchOptions", "SearchResult", "stage_tps", "stage_memory", "divisors", "micro_batch_candidates"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    micro_batch_size: int | None = None
    """Force one micro-batch size for every stage; None lets the search choose."""
    per_stage_micro_batch: bool = False
    """Let each stage pick its own micro-batch size (GraphPipe option; default off as in the paper)."""
    max_downsets: int = 200_000
    """Piper's guard: refuse graphs with more downsets than this."""
    power_of_two: bool = False
    """Restrict device counts and micro-batch sizes to powers of two (the paper's setting)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and (not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1):
            raise InputError(f"--micro-batch-size must be a positive integer, got {self.micro_batch_size!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    stage_graph: StageGraph
    schedule_name: str
    """The strategy's schedule: gpp -> graph-1f1b, pipedream/piper -> 1f1b, gpipe -> gpipe."""
    stats: Mapping[str, Any] = field(default_factory=dict)
    """At least ``time_s`` (search wall time) and ``bottleneck_tps`` (s/sample)."""


def stage_tps(graph: OpGraph, op_ids: Iterable[int], devices: Sequence[int], micro_batch_size: int,
              batch_size: int, cluster: Cluster) -> float:
    """Seconds per sample the stage needs: compute per micro-batch / b, plus all-reduce / batch."""
    op_ids = tuple(op_ids)
    r = len(devices)
    per_replica = micro_batch_size / r
    compute = graph.fwd_time(op_ids, per_replica) + graph.bwd_time(op_ids, per_replica)
    params = sum(graph.ops[i].param_bytes for i in op_ids)
    return compute / micro_batch_size + cluster.allreduce_time(devices, params) / batch_size


def stage_memory(graph: OpGraph, op_ids: Iterable[int], num_replicas: int, micro_batch_size: int,
                 in_flight: int, cluster: Cluster) -> float:
    """Peak bytes on one device of the stage: model state + saved activations of ``in_flight`` micro-batches."""
    op_ids = tuple(op_ids)
    params = sum(graph.ops[i].param_bytes for i in op_ids)
    act = sum(graph.ops[i].act_bytes for i in op_ids)
    return cluster.state_bytes(params) + act * (micro_batch_size / num_replicas) * in_flight


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def micro_batch_candidates(batch_size: int, options: SearchOptions) -> tuple[int, ...]:
    """Micro-batch sizes a search may use: the forced one, or divisors of the batch."""
    if options.micro_batch_size is not None:
        if batch_size % options.micro_batch_size:
            raise InputError(f"--micro-batch-size {options.micro_batch_size} does not divide the batch size {batch_size}")
        return (options.micro_batch_size,)
    sizes = divisors(batch_size)
    if options.power_of_two:
        sizes = tuple(s for s in sizes if s & (s - 1) == 0)
    return sizes


def check_fits(sg: StageGraph, cluster: Cluster, in_flight: Mapping[int, int]) -> list[tuple[int, float]]:
    """(device, bytes) for every device whose estimated memory exceeds the cluster's."""
    over = []
    per_device: dict[int, float] = {}
    for s in sg.stages:
        mem = stage_memory(sg.graph, s.op_ids, s.num_replicas, s.micro_batch_size, in_flight[s.id], cluster)
        for d in s.devices:
            per_device[d] = per_device.get(d, 0.0) + mem
    for d, mem in sorted(per_device.items()):
        if mem > cluster.memory_bytes:
            over.append((d, mem))
    return over
