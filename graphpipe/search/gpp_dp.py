"""The dynamic program inside GraphPipe's partitioner (paper §4, Alg. 1; DESIGN §6).

For one micro-batch size ``b`` and one bottleneck target ``t_max`` (seconds
per sample), :class:`BottleneckDP` decides whether some stage graph of the
search space below meets the target on ``N`` devices, and builds the one
with the fewest in-flight micro-batches at the source; :func:`min_bottleneck`
binary-searches ``t_max`` over the finite set of candidate stage TPS values,
so its answer is the exact optimum of the space, not an approximation.

Search space (what "optimal" means here)
----------------------------------------
* **Stages** are unions of SP-tree nodes (:mod:`graphpipe.sp`): a whole node,
  a contiguous range of >= 2 children of a series node, or a contiguous run of
  >= 2 children of a parallel node, children of a parallel node being ordered
  by :func:`parallel_order` (descending per-sample work, then smallest op id,
  so similar branches sit next to each other and can share a stage). Every
  such set is convex, and any partition of the ops into such sets is a DAG of
  stages.
* **Devices**: each stage gets ``d`` devices (data parallelism inside the
  stage when ``d > 1``) with ``d`` a divisor of ``b`` (each replica takes
  ``b / d`` samples); with ``power_of_two`` only powers of two. Stage device
  counts sum to at most ``N``. A stage's cost is computed as if its devices
  were ``0..d-1`` (node-crossing all-reduce iff ``d > devices_per_node``);
  :mod:`graphpipe.search.gpp` places stages so this holds where it can.
* **One micro-batch size** ``b`` for every stage.
* **Cost** (:mod:`graphpipe.costs`, vectorised by ``CostArrays``): stage TPS
  ``stage_tps`` must be ``<= t_max``; memory ``stage_memory`` (with the
  block's boundary bytes as inputs/outputs, and re-materialization when the
  DP runs with ``recompute``) with the in-flight count graph-1F1B gives the stage
  (``min(M, 1 + max over consumer stages)``, ``M = B / b``; sinks 1) must fit
  ``cluster.memory_bytes``. With a ``link``, the stage's cut (the bytes on
  the edges leaving it, :func:`~graphpipe.search.common.cut_tps` on that
  link) must also be ``<= t_max``: a stage costs ``max(stage_tps, cut)``.

The DP (paper Alg. 1, restated)
-------------------------------
State ``(node, k)``: a subgraph of the SP tree whose consumers downstream sit
at depth ``k`` (stages on the longest path to the sink; ``k = 0`` below the
global sink). Value: an array over ``v`` of the fewest devices (then fewest
stages) of any partition of the subgraph that meets ``t_max``, fits memory,
and has depth at most ``v`` at the subgraph's source stages. Graph-1F1B
keeps ``min(depth, M)`` micro-batches in flight on a stage, which is what
memory is charged for. The paper's formulation -- state (node, devices),
value = fewest in-flight micro-batches -- is the same table read the other
way; indexing by depth keeps the table small (``v <= min(N, longest op
path)``) and needs no grid of device counts. Cases:

* *base*: the whole node (or a range / run of its children) is one stage at
  depth ``k + 1``, on the fewest devices that meet ``t_max`` and memory;
* *series* ``C1..Cm``: a suffix DP from ``Cm`` backwards -- the downstream
  half is solved first because the upstream half's activation memory depends
  on its in-flight depth; ``Ci`` is either partitioned recursively with the
  suffix's source depth ``u`` as its downstream depth, or starts a range stage
  ``Ci..Cj-1``;
* *parallel* ``P1..Pp``: a DP over children in order; a child is partitioned
  recursively on its own devices or starts a run ``Pj..Pj'-1`` that forms
  one stage; branches run concurrently on disjoint devices, so devices add up
  and the source depth is the max over branches.

Values are exact in the in-flight and device components (memory and TPS are
monotone), so feasibility and hence the optimal bottleneck are exact; the
stage count is only a tie-break.

The cut term is not monotone in a series range (a longer stage may end at a
smaller activation), so ranges stop growing on compute and memory alone
(both grow with the range) and the cut only decides whether a range is a
stage. Dominance still holds: dropping the first child of a range, or a
branch of a run, never adds an edge leaving the stage, because every edge
inside a node goes forward in child order (checked).

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.cluster import preset
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in "abcd"]
>>> g = OpGraph.build("chain", ops, [("a", "b", 1), ("b", "c", 1), ("c", "d", 1)])
>>> sol = min_bottleneck(g, preset("v100", 2), batch_size=8, micro_batch_size=2)
>>> round(sol.bottleneck_tps, 6), [len(s.op_ids) for s in sol.stages]
(0.006, [4])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from graphpipe.cluster import Cluster, Link
from graphpipe.costs import CostArrays
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph
from graphpipe.search.common import cut_tps
from graphpipe.sp import decompose

__all__ = ["DPTree", "DPStage", "DPSolution", "BottleneckDP", "build_tree", "parallel_order", "min_bottleneck",
           "device_counts", "first_feasible", "chain_tree"]

INF = 1 << 62
_SHIFT = 20  # value = devices << _SHIFT | stages
_STAGE_MASK = (1 << _SHIFT) - 1
_SMALL = 12  # nodes with at most this many children use plain-Python block tables


@dataclass(frozen=True, slots=True)
class DPTree:
    """The SP tree as the DP sees it: ``op_ids`` refer to ``graph``, the graph searched.

    kinds[x] in {"op", "series", "parallel"}; children[x] ordered (series in
    dependency order, parallel by :func:`parallel_order`); ``sums[x][i]`` are
    prefix sums over children ``0..i-1`` of (fwd alpha, fwd beta, bwd alpha,
    bwd beta, param bytes, act bytes) -- a leaf counts as one child, itself.
    """

    graph: OpGraph
    kinds: tuple[str, ...]
    children: tuple[tuple[int, ...], ...]
    op_ids: tuple[tuple[int, ...], ...]
    sums: tuple[tuple[tuple[float, ...], ...], ...]
    root: int
    longest_path: int
    """Ops on the longest path of the graph: no stage graph is deeper."""

    def width(self, x: int) -> int:
        """Number of children (1 for a leaf, which is its own only child)."""
        return max(1, len(self.children[x]))

    def block_ops(self, x: int, lo: int, hi: int) -> tuple[int, ...]:
        """Ops of children ``lo..hi-1`` of node ``x`` (the whole leaf for a leaf)."""
        if not self.children[x]:
            return self.op_ids[x]
        return tuple(sorted(o for c in self.children[x][lo:hi] for o in self.op_ids[c]))


def parallel_order(graph: OpGraph, branches: Sequence[Sequence[int]]) -> list[int]:
    """Order of parallel branches (op-id lists): most per-sample work first, then smallest op id.

    Part of the search space's definition: runs of branches that share a stage
    are contiguous in this order.
    """
    def work(ops: Sequence[int]) -> float:
        return sum(graph.ops[o].fwd.beta + graph.ops[o].bwd.beta for o in ops)

    return sorted(range(len(branches)), key=lambda i: (-work(branches[i]), min(branches[i])))


def build_tree(graph: OpGraph) -> DPTree:
    """Decompose ``graph`` (which must be series-parallel) into the DP's tree."""
    tree = decompose(graph)
    if tree.merged:
        raise InputError(f"graph {graph.name!r} is not series-parallel; contract it first with "
                         "graphpipe.sp.make_series_parallel (the planner does)")
    n = len(tree.nodes)
    kinds = [tree.nodes[x].kind for x in range(n)]
    op_ids = [tuple(tree.nodes[x].op_ids) for x in range(n)]
    children: list[tuple[int, ...]] = []
    for x in range(n):
        kids = tuple(tree.nodes[x].children)
        if kinds[x] == "parallel":
            order = parallel_order(graph, [op_ids[c] for c in kids])
            kids = tuple(kids[i] for i in order)
        children.append(kids)
    sums = []
    longest = [0] * n
    for x in range(n):  # post-order: children first
        if kinds[x] == "op":
            op = graph.ops[op_ids[x][0]]
            parts = [(op.fwd.alpha, op.fwd.beta, op.bwd.alpha, op.bwd.beta, float(op.param_bytes), float(op.act_bytes))]
            longest[x] = 1
        else:
            parts = [sums[c][-1] for c in children[x]]
            lengths = [longest[c] for c in children[x]]
            longest[x] = sum(lengths) if kinds[x] == "series" else max(lengths)
        prefix = [(0.0,) * 6]
        for p in parts:
            prefix.append(tuple(a + b for a, b in zip(prefix[-1], p)))
        sums.append(tuple(prefix))
    return DPTree(graph, tuple(kinds), tuple(children), tuple(op_ids), tuple(sums), tree.root, longest[tree.root])


def chain_tree(graph: OpGraph) -> DPTree:
    """The graph seen as one series of its ops in id (topological) order: the SPP search space.

    Every contiguous range of a topological order is convex and any cut into
    ranges is a DAG of stages, so this tree is valid input for the DP. Its
    in-flight model is the chain's (each range waits for all later ones),
    an upper bound on what graph-1F1B gives the real stage graph, so memory
    is checked conservatively. gpp searches it beside the SP tree so that
    the sequential partitions PipeDream considers are inside its space.
    """
    n = graph.num_ops
    kinds = ["op"] * n + ["series"] if n > 1 else ["op"]
    children = [()] * n + [tuple(range(n))] if n > 1 else [()]
    op_ids = [(i,) for i in range(n)] + ([tuple(range(n))] if n > 1 else [])
    leaf = []
    for op in graph.ops:
        leaf.append((op.fwd.alpha, op.fwd.beta, op.bwd.alpha, op.bwd.beta, float(op.param_bytes), float(op.act_bytes)))
    sums = [((0.0,) * 6, leaf[i]) for i in range(n)]
    if n > 1:
        prefix = [(0.0,) * 6]
        for p in leaf:
            prefix.append(tuple(a + b for a, b in zip(prefix[-1], p)))
        sums.append(tuple(prefix))
    return DPTree(graph, tuple(kinds), tuple(children), tuple(op_ids), tuple(sums), len(kinds) - 1, n)


def device_counts(micro_batch_size: int, num_devices: int, power_of_two: bool = False) -> tuple[int, ...]:
    """Replica counts a stage may use: divisors of ``b`` up to ``N`` (powers of two if asked)."""
    ds = [d for d in range(1, min(micro_batch_size, num_devices) + 1) if micro_batch_size % d == 0]
    if power_of_two:
        ds = [d for d in ds if d & (d - 1) == 0]
    return tuple(ds)


@dataclass(frozen=True, slots=True)
class DPStage:
    op_ids: tuple[int, ...]
    num_devices: int
    in_flight: int
    tps: float


@dataclass(frozen=True, slots=True)
class DPSolution:
    """Optimal bottleneck for one micro-batch size, and a partition achieving it."""

    micro_batch_size: int
    bottleneck_tps: float
    stages: tuple[DPStage, ...]
    """In tree order (depth-first, children in order): neighbours in the tree come out together."""
    source_in_flight: int
    num_targets_tried: int
    dp_states: int

    @property
    def devices_used(self) -> int:
        return sum(s.num_devices for s in self.stages)


class BottleneckDP:
    """The DP for one micro-batch size; :meth:`solve` runs it for one target ``t_max``.

    Not a value object: it memoises per-block costs across targets (they do
    not depend on ``t_max``) and the DP table of the current target.
    """

    def __init__(self, tree: DPTree, cluster: Cluster, batch_size: int, micro_batch_size: int,
                 num_devices: int | None = None, power_of_two: bool = False, link: Link | None = None,
                 recompute: bool = False):
        if batch_size % micro_batch_size:
            raise InputError(f"micro-batch size {micro_batch_size} does not divide the batch size {batch_size}")
        self.tree = tree
        self.cluster = cluster
        self.batch_size = batch_size
        self.b = micro_batch_size
        self.num_devices = cluster.num_devices if num_devices is None else num_devices
        self.num_mbs = batch_size // micro_batch_size
        self.ds = device_counts(micro_batch_size, self.num_devices, power_of_two)
        # The DP indexes depth (stages on the longest path to the sink); no
        # stage graph is deeper than its stage count (<= N) or longest op path.
        # Memory uses the in-flight count graph-1F1B gives, min(depth, M):
        # depth itself is kept uncapped so that shallower graphs stay
        # distinguishable when there are few micro-batches.
        self.kcap = min(self.num_devices, tree.longest_path)
        self.capacity = cluster.memory_bytes
        self.link = link
        """Cuts are costed on this link (None: free, the stage cost is ``stage_tps`` alone)."""
        self.recompute = bool(recompute)
        """Every stage re-materializes (the search's ``--recompute all``; ``auto`` compares both in gpp)."""
        self.costs = CostArrays.of(tree.graph, cluster)
        self._io: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._tables: dict[int, np.ndarray] = {}
        self._compute: dict[int, np.ndarray] = {}
        self._kmax: dict[int, np.ndarray] = {}
        self._list_cache: dict[int, tuple[list, list]] = {}
        self.t_max = float("inf")
        self.dp_states = 0
        self._reset()

    # ------------------------------------------------------------ block costs
    def _node_table(self, x: int) -> np.ndarray:
        """tps[lo, hi, di]: cost of children lo..hi-1 of x as one stage on ``ds[di]`` devices,
        ``max(stage_tps, cut)`` (just ``stage_tps`` without a link)."""
        got = self._tables.get(x)
        if got is None:
            got = self._compute_table(x)
            if self.link is not None:
                cut = cut_tps(self._out_bytes(x), self.link, self.b)
                got = np.maximum(got, cut[:, :, None])
            self._tables[x] = got
        return got

    def _compute_table(self, x: int) -> np.ndarray:
        """stage_tps[lo, hi, di] of children lo..hi-1 of node x on ``ds[di]`` devices (vectorised)."""
        got = self._compute.get(x)
        if got is None:
            pre = np.asarray(self.tree.sums[x], dtype=float)          # (m+1, 6) prefix sums
            diff = pre[None, :, :] - pre[:, None, :]                    # diff[lo, hi] = sums of lo..hi-1
            params = diff[:, :, 4]
            cols = [self.costs.tps(diff[:, :, 0], diff[:, :, 1], diff[:, :, 2], diff[:, :, 3], params, d, self.b,
                                   self.batch_size, self.recompute) for d in self.ds]
            got = np.stack(cols, axis=-1)
            self._compute[x] = got
        return got

    def _out_bytes(self, x: int) -> np.ndarray:
        """out[lo, hi]: bytes per sample on the edges leaving children lo..hi-1 of x (to anything else)."""
        return self._boundary_bytes(x)[1]

    def _boundary_bytes(self, x: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(in, out, saved)[lo, hi]: bytes per sample on the edges entering / leaving children lo..hi-1 of x,
        and the ``Edge.saved`` of the entering ones (:func:`graphpipe.costs.received_saved_bytes`).

        Every edge between two children of x goes forward in child order
        (series children in dependency order, the chain view in topological
        order, parallel children unconnected), so an edge from child ``c``
        leaves ``lo..hi-1`` iff ``lo <= c < hi`` and its target is outside x
        or a child ``>= hi``; an edge into child ``c2`` enters it iff
        ``lo <= c2 < hi`` and its source is outside x or a child ``< lo``.
        """
        got = self._io.get(x)
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
        self._io[x] = got
        return got

    def block_tps(self, x: int, lo: int, hi: int) -> tuple[float, ...]:
        """stage_tps of children lo..hi-1 of x on each device count of ``self.ds``."""
        return tuple(self._node_table(x)[lo, hi].tolist())

    def _kmax_table(self, x: int) -> np.ndarray:
        """kmax[lo, hi, di]: most in-flight micro-batches children lo..hi-1 of x can hold on ``ds[di]``
        devices within memory (``stage_memory <= capacity``; -1 when even the model state does not fit),
        capped at ``kcap``."""
        got = self._kmax.get(x)
        if got is None:
            pre = np.asarray(self.tree.sums[x], dtype=float)
            diff = pre[None, :, :] - pre[:, None, :]
            inputs, outputs, saved = self._boundary_bytes(x)
            cols = [self.costs.max_in_flight(diff[:, :, 4], diff[:, :, 5] + saved, d, self.b, self.kcap, inputs, outputs,
                                             self.recompute) for d in self.ds]
            got = np.stack(cols, axis=-1).astype(np.int64)
            self._kmax[x] = got
        return got

    def candidate_targets(self) -> np.ndarray:
        """Every stage TPS a block of the search space can have, sorted: the optimum is one of them."""
        parts = []
        for x in range(len(self.tree.kinds)):
            m = self.tree.width(x)
            table = self._node_table(x)
            lo, hi = np.triu_indices(m + 1, k=1)
            parts.append(table[lo, hi].ravel())
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0)

    def lower_bound(self) -> float:
        """No stage graph has a smaller bottleneck: max(total work / N, the heaviest op at its best width).

        Each stage s on d_s devices has d_s * tps_s >= its compute per sample,
        and sum d_s <= N; every op lies in some stage at least as slow as it.
        Compute only: an op's cut is not charged when its stage holds its consumers too.
        """
        root = self._compute_table(self.tree.root)
        m = self.tree.width(self.tree.root)
        total = float(root[0, m, 0])  # ds[0] == 1: pure compute per sample
        heaviest = 0.0
        for x, kind in enumerate(self.tree.kinds):
            if kind == "op":
                heaviest = max(heaviest, float(self._compute_table(x)[0, 1].min()))
        return max(total / self.num_devices, heaviest)

    def _reach(self, x: int) -> np.ndarray:
        """Under the current target, reach[lo, hi, di] = the most in-flight micro-batches children
        lo..hi-1 of x can hold as one stage on at most ``ds[di]`` devices (0: cannot be a stage).
        Two blocks with equal rows need the same devices for every in-flight count."""
        got = self._reach_cache.get(x)
        if got is None:
            keff = np.where(self._node_table(x) <= self.t_max, self._kmax_table(x), 0)
            got = np.maximum.accumulate(np.maximum(keff, 0), axis=-1)
            self._reach_cache[x] = got
        return got

    def _range_ends(self, x: int, lo: int) -> list[int]:
        """Ends ``hi`` (>= lo + 2) of the ranges starting at ``lo`` worth evaluating as one stage.

        Stop at the first range too slow or too big to be a stage on compute
        and memory alone (both grow with the range; a cut may not, so a range
        rejected only for its cut is skipped, not a stop); skip a range when
        the next longer one has the same device profile, because a shorter
        remainder never needs more devices or depth (the longer range
        dominates).
        """
        key = (x, lo)
        got = self._ends.get(key)
        if got is not None:
            return got
        m = self.tree.width(x)
        if m <= _SMALL:
            got = []
            for hi in range(lo + 2, m + 1):
                prof = self._profile(x, lo, hi)
                if not prof and (self.link is None or not self._grows_ok(x)[lo, hi]):
                    break
                nxt = self._profile(x, lo, hi + 1) if hi < m else ()
                if prof and nxt != prof:
                    got.append(hi)
        else:
            rows = self._reach(x)[lo, lo + 2:m + 1]                       # hi = lo+2 .. m
            ok = rows[:, -1] > 0 if self.link is None else self._grows_ok(x)[lo, lo + 2:m + 1]
            stop = int(np.argmin(ok)) if not ok.all() else len(ok)
            rows = rows[:stop]
            if stop == 0:
                got = []
            else:
                differs = np.any(rows[:-1] != rows[1:], axis=-1) if stop > 1 else np.zeros(0, dtype=bool)
                keep = np.append(differs, True) & (rows[:, -1] > 0)
                got = [lo + 2 + int(i) for i in np.nonzero(keep)[0]]
        self._ends[key] = got
        return got

    def _grows_ok(self, x: int) -> np.ndarray:
        """ok[lo, hi]: children lo..hi-1 of x meet the current target on compute and fit memory on some
        device count, the cut aside (both only get worse as a range grows)."""
        got = self._grows_cache.get(x)
        if got is None:
            got = np.any((self._compute_table(x) <= self.t_max) & (self._kmax_table(x) > 0), axis=-1)
            self._grows_cache[x] = got
        return got

    def _profile(self, x: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """(devices, largest in-flight that fits) pairs with both increasing: the block's whole
        'fewest devices for in-flight k' function under the current target."""
        key = (x, lo, hi)
        got = self._feas.get(key)
        if got is None:
            out, best = [], 0
            if self.tree.width(x) <= _SMALL:  # plain Python beats numpy's per-call overhead here
                tps_rows, kmax_rows = self._lists(x)
                t = self.t_max
                for d, tt, k in zip(self.ds, tps_rows[lo][hi], kmax_rows[lo][hi]):
                    if tt <= t and k > best:
                        out.append((d, k))
                        best = k
            else:
                for d, k in zip(self.ds, self._reach(x)[lo, hi].tolist()):
                    if k > best:
                        out.append((d, k))
                        best = k
            got = tuple(out)
            self._feas[key] = got
        return got

    def _lists(self, x: int) -> tuple[list, list]:
        got = self._list_cache.get(x)
        if got is None:
            got = (self._node_table(x).tolist(), self._kmax_table(x).tolist())
            self._list_cache[x] = got
        return got

    def _base_devices(self, x: int, lo: int, hi: int, depth: int) -> int:
        """Fewest devices on which children lo..hi-1 of x form one stage meeting t_max and memory (0: none)
        when ``depth`` stages (itself included) lie on its longest path to the sink."""
        k_in = min(depth, self.num_mbs)  # graph-1F1B's in-flight count
        for d, k in self._profile(x, lo, hi):
            if k >= k_in:
                return d
        return 0

    # -------------------------------------------------------------------- DP
    def _reset(self) -> None:
        self._feas: dict[tuple[int, int, int], tuple[tuple[int, int], ...]] = {}
        self._reach_cache: dict[int, np.ndarray] = {}
        self._grows_cache: dict[int, np.ndarray] = {}
        self._ends: dict[tuple[int, int], list[int]] = {}
        self._f: dict[tuple[int, int], list[int]] = {}
        self._g: dict[tuple[int, int, int], list[int]] = {}

    def solve(self, t_max: float) -> list[int]:
        """Run the DP for target ``t_max``; returns the root's value array (index = in-flight bound)."""
        self.t_max = t_max
        self._reset()
        return self._value(self.tree.root, 0)

    def feasible(self, t_max: float) -> bool:
        return any(v < INF for v in self.solve(t_max))

    def _prune(self, arr: list[int]) -> list[int]:
        limit = (self.num_devices + 1) << _SHIFT
        return [v if v < limit else INF for v in arr]

    def _identity(self, k: int) -> list[int]:
        """Value of an empty suffix: its 'source' is the downstream itself, in-flight k."""
        return [INF] * k + [0] * (self.kcap + 1 - k)

    def _base_array(self, x: int, lo: int, hi: int, k: int, rest: list[int] | None = None) -> list[int]:
        k_in = k + 1
        size = self.kcap + 1
        if k_in > self.kcap:
            return [INF] * size
        d = self._base_devices(x, lo, hi, k_in)
        if not d:
            return [INF] * size
        val = (d << _SHIFT) | 1
        if rest is None:
            return [INF] * k_in + [val] * (size - k_in)
        return [INF] * k_in + [val + r if r < INF else INF for r in rest[k_in:]]

    def _value(self, x: int, k: int) -> list[int]:
        key = (x, k)
        got = self._f.get(key)
        if got is None:
            kind = self.tree.kinds[x]
            if kind == "op":
                got = self._base_array(x, 0, 1, k)
            elif kind == "series":
                got = self._series(x, 0, k)
            else:
                got = self._parallel(x, 0, k)
            self._f[key] = got
            self.dp_states += 1
        return got

    @staticmethod
    def _breakpoints(arr: list[int]) -> list[int]:
        """In-flight values where a non-increasing value array strictly improves."""
        out, prev = [], INF
        for u, a in enumerate(arr):
            if a < prev:
                out.append(u)
                prev = a
        return out

    def _series(self, x: int, i: int, k: int) -> list[int]:
        """Children i..m-1 of series node x with downstream depth k (suffix DP)."""
        kids = self.tree.children[x]
        m = len(kids)
        if i == m:
            return self._identity(k)
        key = (x, i, k)
        got = self._g.get(key)
        if got is not None:
            return got
        size = self.kcap + 1
        res = [INF] * size
        nxt = self._series(x, i + 1, k)
        # Child i partitioned on its own; the suffix's source depth u is its downstream depth.
        for u in self._breakpoints(nxt):
            if u > self.kcap:
                break
            gu = nxt[u]
            child = self._value(kids[i], u)
            res = [min(r, gu + c) if c < INF else r for r, c in zip(res, child)]
        # Children i..j-1 as one stage. TPS and memory only grow with j, and a
        # shorter suffix never needs more devices or depth, so among ranges with
        # the same device profile the longest dominates: evaluate only that one.
        for j in self._range_ends(x, i):
            rest = self._series(x, j, k)
            for u in self._breakpoints(rest):
                k_in = u + 1
                if k_in > self.kcap:
                    break
                d = self._base_devices(x, i, j, k_in)
                if not d:
                    continue
                val = rest[u] + ((d << _SHIFT) | 1)
                for v in range(k_in, size):
                    if val < res[v]:
                        res[v] = val
        res = self._prune(res)
        self._g[key] = res
        self.dp_states += 1
        return res

    def _parallel(self, x: int, j: int, k: int) -> list[int]:
        """Children j..p-1 of parallel node x, all with downstream depth k."""
        kids = self.tree.children[x]
        p = len(kids)
        size = self.kcap + 1
        if j == p:
            return [0] * size
        key = (x, j, k)
        got = self._g.get(key)
        if got is not None:
            return got
        nxt = self._parallel(x, j + 1, k)
        child = self._value(kids[j], k)
        res = [a + b if a < INF and b < INF else INF for a, b in zip(child, nxt)]
        for j2 in self._range_ends(x, j):  # same dominance as series ranges
            group = self._base_array(x, j, j2, k, rest=self._parallel(x, j2, k))
            res = [min(a, b) for a, b in zip(res, group)]
        res = self._prune(res)
        self._g[key] = res
        self.dp_states += 1
        return res

    # ------------------------------------------------------------- extraction
    def extract(self, v: int) -> list[DPStage]:
        """Stages of the root solution with source in-flight <= v (after :meth:`solve`)."""
        out: list[DPStage] = []
        self._extract_node(self.tree.root, 0, v, self._value(self.tree.root, 0)[v], out)
        return out

    def _stage(self, x: int, lo: int, hi: int, d: int, k_in: int) -> DPStage:
        tps = self.block_tps(x, lo, hi)[self.ds.index(d)]
        return DPStage(self.tree.block_ops(x, lo, hi), d, min(k_in, self.num_mbs), tps)

    def _extract_node(self, x: int, k: int, v: int, target: int, out: list[DPStage]) -> None:
        kind = self.tree.kinds[x]
        if kind == "op":
            k_in = k + 1
            out.append(self._stage(x, 0, 1, self._base_devices(x, 0, 1, k_in), k_in))
        elif kind == "series":
            self._extract_series(x, 0, k, v, target, out)
        else:
            self._extract_parallel(x, 0, k, v, target, out)

    def _extract_series(self, x: int, i: int, k: int, v: int, target: int, out: list[DPStage]) -> None:
        kids = self.tree.children[x]
        m = len(kids)
        if i == m:
            return
        nxt = self._series(x, i + 1, k)
        for u in self._breakpoints(nxt):
            if u > self.kcap:
                break
            child = self._value(kids[i], u)
            if child[v] < INF and nxt[u] + child[v] == target:
                self._extract_node(kids[i], u, v, child[v], out)
                self._extract_series(x, i + 1, k, u, nxt[u], out)
                return
        for j in self._range_ends(x, i):
            rest = self._series(x, j, k)
            for u in self._breakpoints(rest):
                k_in = u + 1
                if k_in > self.kcap:
                    break
                d = self._base_devices(x, i, j, k_in)
                if d and k_in <= v and rest[u] + ((d << _SHIFT) | 1) == target:
                    out.append(self._stage(x, i, j, d, k_in))
                    self._extract_series(x, j, k, u, rest[u], out)
                    return
        raise AssertionError(f"DP extraction lost its way at series node {x}, child {i}")

    def _extract_parallel(self, x: int, j: int, k: int, v: int, target: int, out: list[DPStage]) -> None:
        kids = self.tree.children[x]
        p = len(kids)
        if j == p:
            return
        nxt = self._parallel(x, j + 1, k)
        child = self._value(kids[j], k)
        if child[v] < INF and nxt[v] < INF and child[v] + nxt[v] == target:
            self._extract_node(kids[j], k, v, child[v], out)
            self._extract_parallel(x, j + 1, k, v, nxt[v], out)
            return
        k_in = k + 1
        for j2 in self._range_ends(x, j):
            rest = self._parallel(x, j2, k)
            d = self._base_devices(x, j, j2, k_in) if k_in <= self.kcap else 0
            if d and k_in <= v and rest[v] < INF and rest[v] + ((d << _SHIFT) | 1) == target:
                out.append(self._stage(x, j, j2, d, k_in))
                self._extract_parallel(x, j2, k, v, rest[v], out)
                return
        raise AssertionError(f"DP extraction lost its way at parallel node {x}, child {j}")

    # ----------------------------------------------------------------- search
    def best_at(self, t_max: float) -> tuple[int, list[DPStage]] | None:
        """(source in-flight, stages) of the shallowest solution meeting ``t_max``, or None."""
        root = self.solve(t_max)
        for v, val in enumerate(root):
            if val < INF:
                return v, self.extract(v)
        return None


def first_feasible(dp: BottleneckDP, targets: Sequence[float], depth: int, start: int = 0,
                   probes: dict[int, list[int]] | None = None) -> tuple[int | None, int]:
    """Index of the smallest target at which the root admits source depth <= ``depth`` (None: none does).

    Feasibility is monotone in the target, so this is a search over a sorted
    array: gallop up from ``start`` (a lower bound, where DP runs are cheap
    because few large stages meet a small target), then bisect the bracket.
    ``probes`` (target index -> root value array) carries DP runs between
    searches for different depths: every earlier probe narrows the bracket.
    Returns (index, DP runs).
    """
    n = len(targets)
    if n == 0:
        return None, 0
    probes = {} if probes is None else probes
    runs = 0

    def ok(i: int) -> bool:
        nonlocal runs
        root = probes.get(i)
        if root is None:
            runs += 1
            root = dp.solve(float(targets[i]))
            probes[i] = root
        return root[depth] < INF

    below = max([i for i, r in probes.items() if r[depth] >= INF], default=-1)   # known infeasible
    above = min([i for i, r in probes.items() if r[depth] < INF], default=n)      # known feasible
    start = min(max(start, below + 1), n - 1)
    if start >= above:
        return (above if above < n else None), runs
    if ok(start):
        return start, runs
    below, step = start, 1
    while True:
        probe = below + step
        if above < n and probe >= above:  # the bracket is already closed by an earlier probe
            break
        if probe >= n - 1:
            if not ok(n - 1):
                return None, runs
            above = n - 1
            break
        if ok(probe):
            above = probe
            break
        below, step = probe, step * 2
    while above - below > 1:  # targets[below] infeasible, targets[above] feasible
        mid = (below + above) // 2
        if ok(mid):
            above = mid
        else:
            below = mid
    return above, runs


def min_bottleneck(graph: OpGraph | DPTree, cluster: Cluster, batch_size: int, micro_batch_size: int,
                   num_devices: int | None = None, power_of_two: bool = False,
                   link: Link | None = None, recompute: bool = False) -> DPSolution | None:
    """The smallest bottleneck TPS of the search space (module docstring) for one micro-batch size,
    cuts costed on ``link`` (None: free).

    Search over the sorted candidate TPS values (:func:`first_feasible`):
    feasibility is monotone in ``t_max`` (a larger target only admits more
    stages), and the optimum is the TPS of some stage, so the search is
    exact. Returns None when nothing fits (memory, or no stage at all).
    """
    tree = graph if isinstance(graph, DPTree) else build_tree(graph)
    dp = BottleneckDP(tree, cluster, batch_size, micro_batch_size, num_devices, power_of_two, link, recompute)
    targets = dp.candidate_targets()
    start = int(np.searchsorted(targets, dp.lower_bound() * (1 - 1e-12)))
    index, tried = first_feasible(dp, targets, dp.kcap, start)
    if index is None:
        return None
    best = dp.best_at(float(targets[index]))
    assert best is not None
    v, stages = best
    return DPSolution(micro_batch_size, max(s.tps for s in stages), tuple(stages), v, tried, dp.dp_states)
