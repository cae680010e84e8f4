"""Brute-force oracles for the partitioners (on graphs of <= 8 ops, DP = brute force).

Independent of the DPs they check: they enumerate every stage graph of a
stated space explicitly, derive in-flight counts from the stage graph's own
edges (graph-1F1B's rule, ``1 + max over consumers``, capped at the number of
micro-batches), and score with the shared ``search.common`` cost functions.

The gpp space (``graphpipe.search.gpp_dp`` docstring): stages are SP-tree
nodes, contiguous ranges (>= 2) of a series node's children, or contiguous
runs (>= 2) of a parallel node's children ordered by descending per-sample
work then smallest op id; stage device counts divide the micro-batch size
and sum to at most N; a stage on d devices is costed on devices 0..d-1.
With a link, a stage costs max(stage_tps, cut_tps of the bytes on the edges
leaving it), the edges counted here from the graph's edge list.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from graphpipe.cluster import Cluster, Link
from graphpipe.graph import OpGraph
from graphpipe.search.common import cut_tps, stage_memory, stage_tps
from graphpipe.sp import decompose

__all__ = ["BruteResult", "sp_blocks", "partitions_into", "in_flight_counts", "best_assignment", "brute_force_gpp"]


@dataclass(frozen=True)
class BruteResult:
    bottleneck_tps: float
    stages: tuple[tuple[tuple[int, ...], int], ...]  # (op ids, device count)
    num_partitions: int


def sp_blocks(graph: OpGraph) -> set[frozenset[int]]:
    """Every op set that may form a stage in gpp's search space."""
    tree = decompose(graph)
    assert not tree.merged, "brute force expects a series-parallel graph"
    blocks: set[frozenset[int]] = set()

    def work(ops: Iterable[int]) -> float:
        return sum(graph.ops[o].fwd.beta + graph.ops[o].bwd.beta for o in ops)

    for node in tree.nodes:
        blocks.add(frozenset(node.op_ids))
        kids = [tree.nodes[c].op_ids for c in node.children]
        if node.kind == "parallel":
            kids.sort(key=lambda ops: (-work(ops), min(ops)))
        for lo in range(len(kids)):
            for hi in range(lo + 2, len(kids) + 1):
                blocks.add(frozenset(o for k in kids[lo:hi] for o in k))
    return blocks


def partitions_into(num_ops: int, blocks: set[frozenset[int]]) -> Iterator[list[frozenset[int]]]:
    """Every partition of ops 0..n-1 into members of ``blocks``."""
    by_min: dict[int, list[frozenset[int]]] = {}
    for b in blocks:
        by_min.setdefault(min(b), []).append(b)

    def rec(taken: frozenset[int], acc: list[frozenset[int]]):
        free = [o for o in range(num_ops) if o not in taken]
        if not free:
            yield list(acc)
            return
        first = free[0]
        for b in sorted(by_min.get(first, []), key=sorted):
            if not b & taken:
                acc.append(b)
                yield from rec(taken | b, acc)
                acc.pop()

    yield from rec(frozenset(), [])


def in_flight_counts(graph: OpGraph, stages: Sequence[frozenset[int]], num_mbs: int) -> list[int] | None:
    """graph-1F1B in-flight per stage from the stage graph's edges; None if the stages form a cycle."""
    stage_of = {o: i for i, s in enumerate(stages) for o in s}
    succs = [set() for _ in stages]
    for e in graph.edges:
        a, b = stage_of[e.src], stage_of[e.dst]
        if a != b:
            succs[a].add(b)
    memo: dict[int, int] = {}
    visiting: set[int] = set()

    def depth(s: int) -> int | None:
        if s in memo:
            return memo[s]
        if s in visiting:
            return None
        visiting.add(s)
        best = 0
        for c in succs[s]:
            dc = depth(c)
            if dc is None:
                return None
            best = max(best, dc)
        visiting.discard(s)
        memo[s] = best + 1
        return best + 1

    out = []
    for s in range(len(stages)):
        d = depth(s)
        if d is None:
            return None
        out.append(min(d, num_mbs))
    return out


def best_assignment(graph: OpGraph, stages: Sequence[frozenset[int]], cluster: Cluster, batch_size: int,
                    micro_batch_size: int, device_choices: Sequence[int],
                    link: Link | None = None) -> tuple[float, tuple[int, ...]] | None:
    """Min over device counts (sum <= N) of the bottleneck TPS, memory respected; None if nothing fits."""
    n = cluster.num_devices
    flights = in_flight_counts(graph, stages, batch_size // micro_batch_size)
    if flights is None or len(stages) > n:
        return None
    best = None
    per_stage = []
    for s, k in zip(stages, flights):
        leaving = sum(e.bytes for e in graph.edges if e.src in s and e.dst not in s)
        cut = float(cut_tps(leaving, link, micro_batch_size))
        opts = []
        for d in device_choices:
            mem = stage_memory(graph, sorted(s), d, micro_batch_size, k, cluster)
            if mem <= cluster.memory_bytes:
                tps = stage_tps(graph, sorted(s), tuple(range(d)), micro_batch_size, batch_size, cluster)
                opts.append((d, max(tps, cut)))
        if not opts:
            return None
        per_stage.append(opts)
    for combo in itertools.product(*per_stage):
        if sum(d for d, _ in combo) > n:
            continue
        value = max(t for _, t in combo)
        if best is None or value < best[0]:
            best = (value, tuple(d for d, _ in combo))
    return best


def brute_force_gpp(graph: OpGraph, cluster: Cluster, batch_size: int, micro_batch_size: int,
                    power_of_two: bool = False, link: Link | None = None) -> BruteResult | None:
    """Optimal bottleneck TPS over gpp's whole search space, by enumeration."""
    choices = [d for d in range(1, cluster.num_devices + 1) if micro_batch_size % d == 0
               and (not power_of_two or d & (d - 1) == 0)]
    best = None
    count = 0
    for stages in partitions_into(graph.num_ops, sp_blocks(graph)):
        count += 1
        got = best_assignment(graph, stages, cluster, batch_size, micro_batch_size, choices, link)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], tuple((tuple(sorted(s)), d) for s, d in zip(stages, got[1])))
    if best is None:
        return None
    return BruteResult(best[0], best[1], count)
