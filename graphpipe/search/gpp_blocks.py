"""Cost tables of the blocks GraphPipe's DP may make stages of (paper §4; docs/design.md#the-cost-model).

A *block* is children ``lo..hi-1`` of one node of the DP's tree
(:mod:`graphpipe.search.gpp_tree`); a leaf is a block of its one op. For one
micro-batch size :class:`BlockCosts` holds, per node ``x``, tables over
``[lo, hi, device_choice]`` -- the axes of alpa's stage construction
(``compute_cost[start, end, submesh_choice]``), with ``device_choice``
indexing :attr:`BlockCosts.device_counts` (the stage's replica count):

* ``stage_tps[x][lo, hi, c]``: seconds per sample of the block as one stage
  on ``device_counts[c]`` replicas (:meth:`CostArrays.tps
  <graphpipe.costs.CostArrays.tps>`, the one cost model);
* ``stage_cost(x, link)[lo, hi, c]``: ``max(stage_tps, cut)``, the cut being
  PipeDream's ``2 C`` of the bytes leaving the block on ``link``
  (:func:`~graphpipe.search.common.cut_tps`; just ``stage_tps`` without a link);
* ``max_in_flight[x][lo, hi, c]``: the most micro-batches the block can hold
  in flight within device memory (:meth:`CostArrays.max_in_flight
  <graphpipe.costs.CostArrays.max_in_flight>`, capped at ``kcap``; -1 when
  not even the model state fits) -- alpa's ``max_n_succ_stages``.

None of these depends on the DP's target ``t_max`` nor (but the cut) on the
link cuts are costed on, so one :class:`BlockCosts` serves every target and
every cut costing of a micro-batch size: gpp's search builds it once.

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.cluster import preset
>>> from graphpipe.search.gpp_tree import build_tree
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in "abc"]
>>> g = OpGraph.build("chain", ops, [("a", "b", 1), ("b", "c", 1)])
>>> blocks = BlockCosts(build_tree(g), preset("v100", 2), batch_size=8, micro_batch_size=2)
>>> blocks.device_counts, round(float(blocks.stage_tps(blocks.tree.root)[0, 3, 0]), 6)
((1, 2), 0.009)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from graphpipe.cluster import Cluster, Link
from graphpipe.costs import CostArrays
from graphpipe.errors import InputError
from graphpipe.search.common import cut_tps
from graphpipe.search.gpp_tree import DPTree

__all__ = ["BlockCosts", "device_counts"]


ROUND_ROBIN_EXACT_NODES = 8
"""Round-robin replica counts of up to this many whole nodes are all tried; past it every other, then every
fourth, ... (a step of at most 1/8 of the count: the DP's device axis is 27 long at 1,024 devices)."""


def round_robin_counts(limit: int, per_node: int) -> tuple[int, ...]:
    """Round-robin replica counts up to ``limit`` on nodes of ``per_node`` devices: the powers of two up to a
    node (a stage inside one node packs with others), then whole nodes (:data:`ROUND_ROBIN_EXACT_NODES`).

    Whole nodes because a stage's gradient all-reduce crosses nodes on as many lanes as the fewest of its
    devices any node holds (docs/design.md, cost model): 18 devices as 2 + 8 + 8 would all-reduce on two.

    >>> round_robin_counts(40, 8), len(round_robin_counts(1024, 8)), round_robin_counts(6, 8)
    ((1, 2, 4, 8, 16, 24, 32, 40), 27, (1, 2, 4))
    """
    out = [d for d in (1 << k for k in range(per_node.bit_length())) if d <= min(limit, per_node)]
    nodes, step = 2, 1
    while nodes * per_node <= limit:
        out.append(nodes * per_node)
        if nodes >= ROUND_ROBIN_EXACT_NODES * step:
            step *= 2
        nodes += step
    return tuple(out)


def device_counts(micro_batch_size: int, num_devices: int, power_of_two: bool = False,
                  round_robin_mbs: int = 0, per_node: int = 8) -> tuple[int, ...]:
    """Replica counts a stage may use: divisors of ``b`` up to ``N`` (powers of two if asked); with
    ``round_robin_mbs`` (the micro-batch count) and ``b == 1``, :func:`round_robin_counts` up to the fewer of
    ``N`` and the micro-batches (each round-robin replica needs one) on nodes of ``per_node`` devices."""
    if round_robin_mbs and micro_batch_size == 1 and not power_of_two:
        return round_robin_counts(min(num_devices, round_robin_mbs), per_node)
    ds = [d for d in range(1, min(micro_batch_size, num_devices) + 1) if micro_batch_size % d == 0]
    if power_of_two:
        ds = [d for d in ds if d & (d - 1) == 0]
    return tuple(ds)


class BlockCosts:
    """Every block's tables for one micro-batch size (module docstring); computed per node on first use.

    Not a value object: it memoises the tables. ``kcap`` bounds the depth of
    any stage graph (its stage count, at most ``N``, and the longest op path).
    """

    def __init__(self, tree: DPTree, cluster: Cluster, batch_size: int, micro_batch_size: int,
                 num_devices: int | None = None, power_of_two: bool = False, recompute: bool = False,
                 boundary: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
                 round_robin: bool = False):
        if batch_size % micro_batch_size:
            raise InputError(f"micro-batch size {micro_batch_size} does not divide the batch size {batch_size}")
        self.tree = tree
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.num_devices = cluster.num_devices if num_devices is None else num_devices
        self.num_mbs = batch_size // micro_batch_size
        self.device_counts = device_counts(micro_batch_size, self.num_devices, power_of_two,
                                           self.num_mbs if round_robin else 0, cluster.devices_per_node)
        self.round_robin = round_robin and micro_batch_size == 1 and len(self.device_counts) > 1
        """Device counts past 1 are round-robin replicas (:attr:`SearchOptions.round_robin
        <graphpipe.search.common.SearchOptions.round_robin>`): each takes whole micro-batches of one sample."""
        # The DP indexes depth (stages on the longest path to the sink); no
        # stage graph is deeper than its stage count (<= N) or longest op path.
        self.kcap = min(self.num_devices, tree.longest_path)
        self.recompute = bool(recompute)
        """Every stage re-materializes (the search's ``--recompute all``; ``auto`` compares both in gpp)."""
        self.costs = CostArrays.of(tree.graph, cluster)
        self._replicas = np.array(self.device_counts, dtype=np.int64)
        # Samples one action of a replica runs, over the device axis: b / d splitting b, b whole round-robin.
        # The one cost model prices d round-robin replicas of micro-batch 1 as d split replicas of micro-batch d:
        # one sample per action, d actions at once, (F + B) / d per sample, and one sample in flight each.
        self._per_mb = self._replicas if self.round_robin else micro_batch_size
        self._stage_tps: dict[int, np.ndarray] = {}
        self._max_in_flight: dict[int, np.ndarray] = {}
        self._boundary = {} if boundary is None else boundary
        """Boundary bytes depend on the tree alone: tables of other micro-batch sizes may share this dict."""
        self._stage_cost: dict[tuple[int, Link | None], np.ndarray] = {}
        self._lists: dict[tuple[int, Link | None], tuple[list, list]] = {}
        self._targets: dict[Link | None, np.ndarray] = {}
        self._lower_bound: float | None = None
        self._leaves = [x for x, kind in enumerate(tree.kinds) if kind == "op"]
        self._leaf_sums: np.ndarray | None = None

    def _block_sums(self, x: int) -> np.ndarray:
        """sums[lo, hi, :] of children lo..hi-1 of x: (fwd alpha, fwd beta, bwd alpha, bwd beta, params, act)."""
        prefix = np.asarray(self.tree.sums[x], dtype=float)          # (m+1, 6) prefix sums
        return prefix[None, :, :] - prefix[:, None, :]

    def stage_tps(self, x: int) -> np.ndarray:
        """stage_tps[lo, hi, c]: children lo..hi-1 of node x as one stage on ``device_counts[c]`` replicas."""
        got = self._stage_tps.get(x)
        if got is None and self.tree.kinds[x] == "op":
            self._leaf_tables()
            return self._stage_tps[x]
        if got is None:
            s = self._block_sums(x)[:, :, :, None]                     # the device-choice axis last
            got = self._stage_tps[x] = self.costs.tps(s[:, :, 0], s[:, :, 1], s[:, :, 2], s[:, :, 3], s[:, :, 4],
                                                      self._replicas, self._per_mb, self.batch_size,
                                                      self.recompute)
        return got

    def stage_cost(self, x: int, link: Link | None) -> np.ndarray:
        """cost[lo, hi, c] = ``max(stage_tps, cut on link)`` of children lo..hi-1 of x (``stage_tps`` without a link)."""
        key = (x, link)
        got = self._stage_cost.get(key)
        if got is None and self.tree.kinds[x] == "op" and link is not None:
            self._leaf_costs(link)
            return self._stage_cost[key]
        if got is None:
            got = self.stage_tps(x)
            if link is not None:
                cut = cut_tps(self.boundary_bytes(x)[1], link, self.micro_batch_size)
                got = np.maximum(got, cut[:, :, None])
            self._stage_cost[key] = got
        return got

    def max_in_flight(self, x: int) -> np.ndarray:
        """max_in_flight[lo, hi, c]: most micro-batches in flight children lo..hi-1 of x hold within memory on
        ``device_counts[c]`` replicas (``stage_memory <= capacity``, capped at ``kcap``; -1: not even one)."""
        got = self._max_in_flight.get(x)
        if got is None and self.tree.kinds[x] == "op":
            self._leaf_tables()
            return self._max_in_flight[x]
        if got is None:
            got = self._max_in_flight[x] = self._in_flight(x, self.kcap, self.recompute)
        return got

    # A leaf is a block of one child, itself: its tables are those of a node with prefix sums (0, op). The
    # leaves' tables are computed in one vectorised pass over all of them -- the same elementwise arithmetic
    # on the same inputs as one node at a time (so the same numbers), with a few numpy calls instead of
    # a few per leaf. Axis 0 of these arrays follows ``self._leaves``.
    def _leaf_block_sums(self) -> np.ndarray:
        """[leaf, lo, hi, :] as :meth:`_block_sums` gives it for each leaf."""
        if self._leaf_sums is None:
            prefix = np.asarray([self.tree.sums[x] for x in self._leaves], dtype=float).reshape(-1, 2, 6)
            self._leaf_sums = prefix[:, None, :, :] - prefix[:, :, None, :]
        return self._leaf_sums

    def _leaf_in_flight(self, cap: int, recompute: bool) -> np.ndarray:
        """[leaf, lo, hi, c]: :meth:`_in_flight` of every leaf."""
        s = self._leaf_block_sums()[..., None]
        inputs, outputs, saved = (np.stack(part) for part in zip(*self._leaf_boundaries()))
        return self.costs.max_in_flight(s[..., 4, :], s[..., 5, :] + saved[..., None], self._replicas,
                                        self._per_mb, cap, inputs[..., None], outputs[..., None], recompute)

    def _leaf_tables(self) -> None:
        s = self._leaf_block_sums()[..., None]
        tps = self.costs.tps(s[..., 0, :], s[..., 1, :], s[..., 2, :], s[..., 3, :], s[..., 4, :], self._replicas,
                             self._per_mb, self.batch_size, self.recompute)
        held = self._leaf_in_flight(self.kcap, self.recompute)
        for i, x in enumerate(self._leaves):
            self._stage_tps[x], self._max_in_flight[x] = tps[i], held[i]

    def _leaf_costs(self, link: Link) -> None:
        tps = np.stack([self.stage_tps(x) for x in self._leaves])
        outputs = np.stack([outputs for _, outputs, _ in self._leaf_boundaries()])
        cost = np.maximum(tps, cut_tps(outputs, link, self.micro_batch_size)[..., None])
        for i, x in enumerate(self._leaves):
            self._stage_cost[(x, link)] = cost[i]

    def _leaf_boundaries(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`boundary_bytes` of every leaf, from one pass over the edges (summed in edge order, as
        :meth:`boundary_bytes` sums them)."""
        missing = [x for x in self._leaves if x not in self._boundary]
        if missing:
            leaf_of = {self.tree.op_ids[x][0]: x for x in missing}
            into = {x: [0.0, 0.0] for x in missing}   # bytes, saved bytes
            out = {x: 0.0 for x in missing}
            for e in self.tree.graph.edges:
                src, dst = leaf_of.get(e.src), leaf_of.get(e.dst)
                if src is not None:
                    out[src] += e.bytes
                if dst is not None:
                    into[dst][0] += e.bytes
                    into[dst][1] += e.saved
            for x in missing:
                self._boundary[x] = (_one_child(into[x][0]), _one_child(out[x]), _one_child(into[x][1]))
        return [self._boundary[x] for x in self._leaves]

    def _in_flight(self, x: int, cap: int, recompute: bool) -> np.ndarray:
        """[lo, hi, c]: most micro-batches (``<= cap``) children lo..hi-1 of x hold within memory (-1: none)."""
        s = self._block_sums(x)[:, :, :, None]
        inputs, outputs, saved = self.boundary_bytes(x)
        return self.costs.max_in_flight(s[:, :, 4], s[:, :, 5] + saved[:, :, None], self._replicas,
                                        self._per_mb, cap, inputs[:, :, None], outputs[:, :, None], recompute)

    def rows(self, x: int, link: Link | None) -> tuple[list, list]:
        """``stage_cost(x, link)`` and ``max_in_flight(x)`` as nested lists: plain Python indexes them faster."""
        key = (x, link)
        got = self._lists.get(key)
        if got is None:
            got = self._lists[key] = (self.stage_cost(x, link).tolist(), self.max_in_flight(x).tolist())
        return got

    def boundary_bytes(self, x: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(in, out, saved)[lo, hi]: bytes per sample on the edges entering / leaving children lo..hi-1 of x,
        and the ``Edge.saved`` of the entering ones (:func:`graphpipe.costs.received_saved_bytes`).

        Every edge between two children of x goes forward in child order
        (series children in dependency order, the chain view in topological
        order, parallel children unconnected), so an edge from child ``c``
        leaves ``lo..hi-1`` iff ``lo <= c < hi`` and its target is outside x
        or a child ``>= hi``; an edge into child ``c2`` enters it iff
        ``lo <= c2 < hi`` and its source is outside x or a child ``< lo``.
        """
        got = self._boundary.get(x)
        if got is not None:
            return got
        tree = self.tree
        kids = tree.children[x] or (x,)  # a leaf is its own only child
        m = len(kids)
        child_of = {o: i for i, c in enumerate(kids) for o in tree.op_ids[c]}
        ext_out, ext_in, ext_saved = np.zeros(m), np.zeros(m), np.zeros(m)
        between = np.zeros((m, m + 1))   # between[c, c2]: bytes from child c to child c2
        between_saved = np.zeros((m, m + 1))
        for e in tree.graph.edges:
            c, c2 = child_of.get(e.src), child_of.get(e.dst)
            if c is None and c2 is None:
                continue
            if c2 is None:
                ext_out[c] += e.bytes
            elif c is None:
                ext_in[c2] += e.bytes
                ext_saved[c2] += e.saved
            elif c2 < c:
                raise AssertionError(f"edge {e.src}->{e.dst} runs backwards between children of node {x}")
            elif c2 > c:
                between[c, c2] += e.bytes
                between_saved[c, c2] += e.saved
        hi = np.arange(m + 1)
        reaching = np.cumsum(between[:, ::-1], axis=1)[:, ::-1]        # reaching[c, h]: to children >= h
        upto = np.vstack([np.zeros(m + 1), np.cumsum(reaching, axis=0)])  # upto[i, h]: children < i, to >= h
        ext = np.concatenate(([0.0], np.cumsum(ext_out)))
        out = np.maximum(ext[None, :] - ext[:, None] + upto[hi, hi][None, :] - upto, 0.0)  # float noise

        def entering(ext_in: np.ndarray, between: np.ndarray) -> np.ndarray:
            # in[lo, hi] = external inputs of lo..hi-1 + bytes from children < lo into lo..hi-1
            before = np.vstack([np.zeros(m + 1), np.cumsum(between, axis=0)])[:, :m]   # before[lo, c2]: from children < lo
            into = np.concatenate([np.zeros((m + 1, 1)), np.cumsum(before, axis=1)], axis=1)  # into[lo, h]: to c2 < h
            ext = np.concatenate(([0.0], np.cumsum(ext_in)))
            return np.maximum(ext[None, :] - ext[:, None] + into - into[hi, hi][:, None], 0.0)

        got = (entering(ext_in, between), out, entering(ext_saved, between_saved))
        self._boundary[x] = got
        return got

    def candidate_targets(self, link: Link | None) -> np.ndarray:
        """Every stage cost a block can have on ``link``, sorted: the optimal bottleneck is one of them."""
        got = self._targets.get(link)
        if got is None:
            parts = []
            for x in range(len(self.tree.kinds)):
                lo, hi = _blocks_of(self.tree.width(x))
                parts.append(self.stage_cost(x, link)[lo, hi].ravel())
            got = self._targets[link] = np.unique(np.concatenate(parts)) if parts else np.zeros(0)
        return got

    def memory_binds(self, below_tps: float) -> bool:
        """Whether some block that costs less than ``below_tps`` per sample on some device count cannot hold
        every micro-batch of the iteration in flight there (the most any schedule keeps).

        For tables without re-materialization: when this is False, no stage of a plan whose every stage
        costs less than ``below_tps`` is short of memory, whatever its schedule, so re-materializing it
        only adds time.
        """
        if self.recompute:
            raise ValueError("memory_binds asks about stages without re-materialization")
        if self._leaves:
            holds = self._leaf_in_flight(self.num_mbs, False)[:, 0, 1]
            tps = np.stack([self.stage_tps(x)[0, 1] for x in self._leaves])
            if ((tps < below_tps) & (holds < self.num_mbs)).any():
                return True
        for x in range(len(self.tree.kinds)):
            if self.tree.kinds[x] == "op":
                continue
            holds = self._in_flight(x, self.num_mbs, False)
            lo, hi = _blocks_of(self.tree.width(x))
            short = (self.stage_tps(x)[lo, hi] < below_tps) & (holds[lo, hi] < self.num_mbs)
            if short.any():
                return True
        return False

    def lower_bound(self) -> float:
        """No stage graph has a smaller bottleneck: max(total work / N, the heaviest op at its best width).

        Each stage s on d_s devices has d_s * tps_s >= its compute per sample,
        and sum d_s <= N; every op lies in some stage at least as slow as it.
        Compute only: an op's cut is not charged when its stage holds its consumers too.
        """
        if self._lower_bound is None:
            tree = self.tree
            total = float(self.stage_tps(tree.root)[0, tree.width(tree.root), 0])  # one replica: compute per sample
            heaviest = max((float(self.stage_tps(x)[0, 1].min()) for x, kind in enumerate(tree.kinds) if kind == "op"),
                           default=0.0)
            self._lower_bound = max(total / self.num_devices, heaviest)
        return self._lower_bound


def _one_child(value: float) -> np.ndarray:
    """[lo, hi] of a node with one child: ``value`` for the child itself (lo=0, hi=1), 0 elsewhere."""
    return np.array([[0.0, value], [0.0, 0.0]])


@lru_cache(maxsize=None)
def _blocks_of(width: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of every block of a node with ``width`` children: the pairs lo < hi <= width."""
    return np.triu_indices(width + 1, k=1)
