"""The dynamic program inside GraphPipe's partitioner (paper §4, Alg. 1; docs/design.md#partitioners).

For one micro-batch size ``b`` and one bottleneck target ``t_max`` (seconds
per sample), :class:`BottleneckDP` decides whether some stage graph of the
search space below meets the target on ``N`` devices, and builds the one
with the fewest in-flight micro-batches at the source;
:func:`~graphpipe.search.gpp_solve.min_bottleneck` binary-searches ``t_max``
over the finite set of candidate stage TPS values, so its answer is the
exact optimum of the space, not an approximation.

Search space (what "optimal" means here)
----------------------------------------
* **Stages** are unions of SP-tree nodes (:mod:`graphpipe.sp`): a whole node,
  a contiguous range of >= 2 children of a series node, or a contiguous run of
  >= 2 children of a parallel node, children of a parallel node being ordered
  by :func:`~graphpipe.search.gpp_tree.parallel_order` (descending per-sample work, then smallest op id,
  so similar branches sit next to each other and can share a stage). Every
  such set is convex, and any partition of the ops into such sets is a DAG of
  stages.
* **Devices**: each stage gets ``d`` devices (data parallelism inside the
  stage when ``d > 1``) with ``d`` a divisor of ``b`` (each replica takes
  ``b / d`` samples); with ``power_of_two`` only powers of two; with
  ``round_robin`` at ``b = 1``, :func:`~graphpipe.search.gpp_blocks.round_robin_counts`
  (replicas taking whole micro-batches in turn). Stage device
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

Modules: the tree (:mod:`graphpipe.search.gpp_tree`), the block cost
tables on the one cost model (:mod:`graphpipe.search.gpp_blocks`), and here
the recurrence and the search over targets.

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
stage count is only a tie-break. A state's value is a :class:`Table`: per
bound ``v`` a (devices, stages) pair and the choice that reached it (the
back-pointer :meth:`BottleneckDP.extract` follows), recorded while solving:
among equal pairs the first option in the order above wins.

Between targets nothing is recomputed that cannot have changed: a state's
value depends on ``t_max`` only through which block costs in its scope
(the blocks inside its subgraph) are ``<= t_max``, so states are memoised
under the number of those costs at or below the target (:meth:`BottleneckDP._rank`).
The bisection's later probes differ in one block and reuse all states but
that block's ancestors.

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
>>> from graphpipe.search.gpp_tree import build_tree
>>> dp = BottleneckDP(build_tree(g), preset("v100", 2), batch_size=8, micro_batch_size=2)
>>> v, stages = dp.best_at(0.006)
>>> v, [(s.op_ids, s.num_devices) for s in stages]
(1, [((0, 1, 2, 3), 2)])
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from graphpipe.cluster import Cluster, Link
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_tree import DPTree

__all__ = ["Table", "DPStage", "DPSolution", "TargetDP", "BottleneckDP", "INF"]

INF = 1 << 62
"""Devices of a bound no partition meets (more than any cluster has)."""
_SMALL = 12  # nodes with at most this many children use plain-Python block tables


@dataclass(frozen=True, slots=True)
class Table:
    """A DP state's value, indexed by ``v``, the bound on the depth at the subgraph's source.

    ``devices[v]`` and ``stages[v]``: the fewest devices, then the fewest
    stages, of a partition meeting the target with source depth ``<= v``
    (``devices[v] == INF``: none). ``choice[v]``: how that partition starts
    (the back-pointer), one of

    * ``("stage", d)``: a leaf as one stage on ``d`` devices;
    * ``("child", u)`` (series): the child partitioned with downstream depth
      ``u``, the rest of the series with source depth ``<= u``;
    * ``("range", j, u, d)`` (series): children ``i..j-1`` one stage on ``d``
      devices at depth ``u + 1``, the rest with source depth ``<= u``;
    * ``("child",)`` (parallel): the child partitioned on its own devices beside the other branches;
    * ``("run", j, d)`` (parallel): children ``i..j-1`` one stage on ``d`` devices;
    * None: an empty rest.

    A table asked for bounds up to some depth only may end there
    (:meth:`ChainDP.solve <graphpipe.search.gpp_chain.ChainDP.solve>`): it
    then has fewer entries than ``kcap + 1``.
    """

    devices: tuple[int, ...]
    stages: tuple[int, ...]
    choice: tuple[tuple | None, ...]
    breakpoints: tuple[int, ...] = ()
    """Bounds ``v`` where the (devices, stages) pair strictly improves on every smaller bound
    (:meth:`of` fills it in): only these are worth handing to an upstream neighbour."""

    @classmethod
    def of(cls, devices: Sequence[int], stages: Sequence[int], choice: Sequence[tuple | None]) -> "Table":
        points, best_d, best_s = [], INF, 0
        for v, d in enumerate(devices):
            if d < best_d or (d == best_d and d < INF and stages[v] < best_s):
                points.append(v)
                best_d, best_s = d, stages[v]
        return cls(tuple(devices), tuple(stages), tuple(choice), tuple(points))

    def feasible(self, v: int) -> bool:
        return self.devices[v] < INF


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


class TargetDP:
    """What both DPs share: the sizes and block cost tables of one micro-batch size and cut costing, and the
    search interface -- :meth:`solve` one target, :meth:`extract` its stages, :meth:`best_at` both.

    :class:`BottleneckDP` runs on any tree; :class:`~graphpipe.search.gpp_chain.ChainDP`, the same
    recurrence vectorised, on chains. ``blocks`` (the same tree, cluster, sizes and ``recompute``) lets
    several cut costings share one set of block cost tables.
    """

    def __init__(self, tree: DPTree, cluster: Cluster, batch_size: int, micro_batch_size: int,
                 num_devices: int | None = None, power_of_two: bool = False, link: Link | None = None,
                 recompute: bool = False, blocks: BlockCosts | None = None):
        if blocks is None:
            blocks = BlockCosts(tree, cluster, batch_size, micro_batch_size, num_devices, power_of_two, recompute)
        self.blocks = blocks
        self.tree = tree
        self.batch_size = batch_size
        self.b = micro_batch_size
        self.num_devices = blocks.num_devices
        self.num_mbs = blocks.num_mbs
        self.ds = blocks.device_counts
        # Memory uses the in-flight count graph-1F1B gives, min(depth, M):
        # depth itself is kept uncapped so that shallower graphs stay
        # distinguishable when there are few micro-batches.
        self.kcap = blocks.kcap
        self.link = link
        """Cuts are costed on this link (None: free, the stage cost is ``stage_tps`` alone)."""
        self.recompute = blocks.recompute
        self.t_max = float("inf")
        self.dp_states = 0

    def candidate_targets(self) -> np.ndarray:
        """Every stage cost a block can have, sorted: the optimum is one of them."""
        return self.blocks.candidate_targets(self.link)

    def lower_bound(self) -> float:
        """:meth:`BlockCosts.lower_bound <graphpipe.search.gpp_blocks.BlockCosts.lower_bound>`."""
        return self.blocks.lower_bound()

    def solve(self, t_max: float, depth: int | None = None) -> Table:
        """The root's table under target ``t_max`` (index = bound on the source depth); with ``depth``, the
        table may end at that bound."""
        raise NotImplementedError

    def extract(self, v: int) -> list[DPStage]:
        """Stages of the last solved target's solution with source depth <= v, by the back-pointers."""
        raise NotImplementedError

    def feasible(self, t_max: float) -> bool:
        return any(d < INF for d in self.solve(t_max).devices)

    def best_at(self, t_max: float) -> tuple[int, list[DPStage]] | None:
        """(source in-flight, stages) of the shallowest solution meeting ``t_max``, or None."""
        root = self.solve(t_max)
        for v, d in enumerate(root.devices):
            if d < INF:
                return v, self.extract(v)
        return None


class BottleneckDP(TargetDP):
    """The DP for one micro-batch size and cut costing, on any tree; :meth:`solve` runs it for one target.

    Not a value object: it memoises states across targets (module docstring).
    Arguments as :class:`TargetDP`'s.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._memo: dict[tuple, Table] = {}
        self._feas: dict[tuple[int, int, int, int], tuple[tuple[int, int], ...]] = {}
        self._ends: dict[tuple[int, int, int], list[int]] = {}
        self._rows: dict[tuple[int, int], list[float]] = {}
        self._identities: dict[int, Table] = {}
        self._reset()

    # ------------------------------------------------------- blocks at t_max
    def _reach(self, x: int) -> np.ndarray:
        """Under the current target, reach[lo, hi, c] = the most in-flight micro-batches children
        lo..hi-1 of x can hold as one stage on at most ``ds[c]`` devices (0: cannot be a stage).
        Two blocks with equal rows need the same devices for every in-flight count."""
        got = self._reach_cache.get(x)
        if got is None:
            keff = np.where(self.blocks.stage_cost(x, self.link) <= self.t_max, self.blocks.max_in_flight(x), 0)
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
        key = (x, lo, self._row_rank(x, lo))
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
            got = np.any((self.blocks.stage_tps(x) <= self.t_max) & (self.blocks.max_in_flight(x) > 0), axis=-1)
            self._grows_cache[x] = got
        return got

    def _profile(self, x: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """(devices, largest in-flight that fits) pairs with both increasing: the block's whole
        'fewest devices for in-flight k' function under the current target."""
        key = (x, lo, hi, self._row_rank(x, lo))
        got = self._feas.get(key)
        if got is None:
            out, best = [], 0
            if self.tree.width(x) <= _SMALL:  # plain Python beats numpy's per-call overhead here
                cost_rows, in_flight_rows = self.blocks.rows(x, self.link)
                t = self.t_max
                for d, tt, k in zip(self.ds, cost_rows[lo][hi], in_flight_rows[lo][hi]):
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

    def _base_devices(self, x: int, lo: int, hi: int, depth: int) -> int:
        """Fewest devices on which children lo..hi-1 of x form one stage meeting t_max and memory (0: none)
        when ``depth`` stages (itself included) lie on its longest path to the sink."""
        return _fewest_devices(self._profile(x, lo, hi), min(depth, self.num_mbs))  # graph-1F1B's in-flight

    # ------------------------------------------------------- memo by scope
    def _row_costs(self, x: int, lo: int) -> list[float]:
        """Sorted costs (with and without the cut) of the blocks starting at child ``lo`` of node x: all the
        values :meth:`_profile` and :meth:`_range_ends` compare with ``t_max`` for them."""
        key = (x, lo)
        got = self._rows.get(key)
        if got is None:
            parts = [self.blocks.stage_cost(x, self.link)[lo, lo + 1:].ravel()]
            if self.link is not None:  # ranges stop on compute alone (_grows_ok)
                parts.append(self.blocks.stage_tps(x)[lo, lo + 1:].ravel())
            got = self._rows[key] = np.sort(np.concatenate(parts)).tolist()
        return got

    def _row_rank(self, x: int, lo: int) -> int:
        """How many of :meth:`_row_costs` are ``<= t_max``: the blocks starting at ``lo`` look the same to
        every target of equal row rank, so their profiles and range ends are kept under it."""
        key = (x, lo)
        got = self._row_ranks.get(key)
        if got is None:
            got = self._row_ranks[key] = bisect_right(self._row_costs(x, lo), self.t_max)
        return got

    def _rank(self, x: int, i: int) -> int:
        """How many block costs inside children i.. of x are ``<= t_max`` (the rows starting there and
        everything inside those children): states with equal ranks make the same comparisons, so they have
        the same value. Counted part by part, the parts being disjoint."""
        key = (x, i)
        got = self._ranks.get(key)
        if got is None:
            kids = self.tree.children[x]
            got = self._row_rank(x, i)
            if kids:
                got += self._rank(kids[i], 0) + (self._rank(x, i + 1) if i + 1 < len(kids) else 0)
            self._ranks[key] = got
        return got

    # ------------------------------------------------------------------- DP
    def _reset(self) -> None:
        """Forget what depends on the target itself (what is keyed by a rank stays)."""
        self._reach_cache: dict[int, np.ndarray] = {}
        self._grows_cache: dict[int, np.ndarray] = {}
        self._ranks: dict[tuple[int, int], int] = {}
        self._row_ranks: dict[tuple[int, int], int] = {}

    def solve(self, t_max: float, depth: int | None = None) -> Table:
        """Run the DP for target ``t_max``; returns the root's table (index = bound on the source depth).

        ``depth`` (the bounds asked about go up to it) is for :class:`~graphpipe.search.gpp_chain.ChainDP`'s
        sake: this DP always fills the whole table.
        """
        self.t_max = t_max
        self._reset()
        return self._value(self.tree.root, 0)

    def _table(self, devices: list[int], stages: list[int], choice: list) -> Table:
        """A state's table, bounds needing more devices than there are marked infeasible."""
        n = self.num_devices
        for v, d in enumerate(devices):
            if d > n:
                devices[v], stages[v], choice[v] = INF, 0, None
        self.dp_states += 1
        return Table.of(devices, stages, choice)

    def _identity(self, k: int) -> Table:
        """Value of an empty suffix: its 'source' is the downstream itself, depth k."""
        got = self._identities.get(k)
        if got is None:
            size = self.kcap + 1
            got = Table.of((INF,) * k + (0,) * (size - k), (0,) * size, (None,) * size)
            self._identities[k] = got
        return got

    def _value(self, x: int, k: int) -> Table:
        """Node x partitioned with its downstream consumers at depth k."""
        kind = self.tree.kinds[x]
        if kind == "series":
            return self._series(x, 0, k)
        if kind == "parallel":
            return self._parallel(x, 0, k)
        key = (x, 0, k, self._rank(x, 0))
        got = self._memo.get(key)
        if got is None:  # base: the leaf is one stage at depth k + 1
            size, k_in = self.kcap + 1, k + 1
            d = self._base_devices(x, 0, 1, k_in) if k_in <= self.kcap else 0
            if not d:
                got = self._table([INF] * size, [0] * size, [None] * size)
            else:
                got = self._table([INF] * k_in + [d] * (size - k_in), [0] * k_in + [1] * (size - k_in),
                                  [None] * k_in + [("stage", d)] * (size - k_in))
            self._memo[key] = got
        return got

    def _will_ask(self, x: int, depths: Sequence[int]) -> None:
        """Node x is about to be asked for these downstream depths (a hint for subclasses that solve several
        depths at once; this DP solves each when asked)."""

    def _series(self, x: int, i: int, k: int) -> Table:
        """Children i..m-1 of series node x with downstream depth k (suffix DP)."""
        kids = self.tree.children[x]
        if i == len(kids):
            return self._identity(k)
        key = (x, i, k, self._rank(x, i))
        got = self._memo.get(key)
        if got is not None:
            return got
        size = self.kcap + 1
        devices, stages, choice = [INF] * size, [0] * size, [None] * size
        nxt = self._series(x, i + 1, k)
        # Child i partitioned on its own; the suffix's source depth u is its downstream depth.
        leaf = self.tree.kinds[kids[i]] == "op"
        if leaf:
            self._series_leaf(kids[i], nxt, devices, stages, choice)
        else:
            self._will_ask(kids[i], nxt.breakpoints)
        for u in () if leaf else nxt.breakpoints:
            rest_d, rest_s, how = nxt.devices[u], nxt.stages[u], ("child", u)
            child = self._value(kids[i], u)
            if not child.breakpoints:
                continue
            for v in range(child.breakpoints[0], size):  # nothing is feasible below its first breakpoint
                d, s = rest_d + child.devices[v], rest_s + child.stages[v]
                if child.devices[v] < INF and (d < devices[v] or (d == devices[v] and s < stages[v])):
                    devices[v], stages[v], choice[v] = d, s, how
        # Children i..j-1 as one stage. TPS and memory only grow with j, and a
        # shorter suffix never needs more devices or depth, so among ranges with
        # the same device profile the longest dominates: evaluate only that one.
        # A range stage at depth u + 1 serves every bound v >= u + 1 alike, so
        # keep the best per first bound (ties: the earlier option) and sweep.
        first_at: list[tuple | None] = [None] * size   # (devices, stages, order, choice)
        order = 0
        for j in self._range_ends(x, i):
            rest, profile = self._series(x, j, k), self._profile(x, i, j)
            for u in rest.breakpoints:
                k_in = u + 1
                if k_in > self.kcap:
                    break
                need = _fewest_devices(profile, min(k_in, self.num_mbs))
                if not need:
                    continue
                option = (rest.devices[u] + need, rest.stages[u] + 1, order, ("range", j, u, need))
                order += 1
                held = first_at[k_in]
                if held is None or option[:2] < held[:2]:
                    first_at[k_in] = option
        best = None
        for v in range(size):
            here = first_at[v]
            if here is not None and (best is None or here[:3] < best[:3]):
                best = here
            if best is not None and (best[0] < devices[v] or (best[0] == devices[v] and best[1] < stages[v])):
                devices[v], stages[v], choice[v] = best[0], best[1], best[3]
        got = self._memo[key] = self._table(devices, stages, choice)
        return got

    def _series_leaf(self, leaf: int, nxt: Table, devices: list[int], stages: list[int], choice: list) -> None:
        """The "child" options of :meth:`_series` when the child is one op, in one sweep over the bounds.

        A leaf's table is infeasible below its first breakpoint and constant from there on, so the option
        ``("child", u)`` offers one (devices, stages) pair to every bound from a start that grows with
        ``u``. Offering the options in ``u`` order and keeping the first strictly best one at each bound is
        what the general loop (every ``u``, every bound) computes, in time linear in the bounds.
        """
        offers = []
        for u in nxt.breakpoints:
            child = self._value(leaf, u)
            if child.breakpoints:
                start = child.breakpoints[0]
                offers.append((start, nxt.devices[u] + child.devices[start], nxt.stages[u] + child.stages[start],
                               ("child", u)))
        best, at, size = None, 0, len(devices)
        for v in range(size):
            while at < len(offers) and offers[at][0] <= v:
                offer = offers[at]
                at += 1
                if best is None or offer[1] < best[1] or (offer[1] == best[1] and offer[2] < best[2]):
                    best = offer
            if best is not None:
                if at == len(offers):  # no offer left: the best holds for every remaining bound
                    devices[v:], stages[v:], choice[v:] = ([best[1]] * (size - v), [best[2]] * (size - v),
                                                           [best[3]] * (size - v))
                    return
                devices[v], stages[v], choice[v] = best[1], best[2], best[3]

    def _parallel(self, x: int, j: int, k: int) -> Table:
        """Children j..p-1 of parallel node x, all with downstream depth k."""
        kids = self.tree.children[x]
        size = self.kcap + 1
        if j == len(kids):
            return self._identity(0)  # no branch left: nothing to add, at any bound
        key = (x, j, k, self._rank(x, j))
        got = self._memo.get(key)
        if got is not None:
            return got
        nxt = self._parallel(x, j + 1, k)
        child = self._value(kids[j], k)
        devices, stages, choice = [INF] * size, [0] * size, [None] * size
        for v in range(size):  # branches on disjoint devices: devices and stages add up
            if child.devices[v] < INF and nxt.devices[v] < INF:
                devices[v], stages[v] = child.devices[v] + nxt.devices[v], child.stages[v] + nxt.stages[v]
                choice[v] = ("child",)
        k_in = k + 1
        for j2 in self._range_ends(x, j):  # same dominance as series ranges
            need = self._base_devices(x, j, j2, k_in) if k_in <= self.kcap else 0
            if not need:
                continue
            rest, how = self._parallel(x, j2, k), ("run", j2, need)
            for v in range(k_in, size):
                if rest.devices[v] < INF:
                    d, s = rest.devices[v] + need, rest.stages[v] + 1
                    if d < devices[v] or (d == devices[v] and s < stages[v]):
                        devices[v], stages[v], choice[v] = d, s, how
        got = self._memo[key] = self._table(devices, stages, choice)
        return got

    # ------------------------------------------------------------- extraction
    def extract(self, v: int) -> list[DPStage]:
        """Stages of the root solution with source depth <= v (after :meth:`solve`), by the back-pointers."""
        out: list[DPStage] = []
        self._collect(self.tree.root, 0, v, out)
        return out

    def _stage(self, x: int, lo: int, hi: int, d: int, k_in: int) -> DPStage:
        tps = float(self.blocks.stage_cost(x, self.link)[lo, hi, self.ds.index(d)])
        return DPStage(self.tree.block_ops(x, lo, hi), d, min(k_in, self.num_mbs), tps)

    def _collect(self, x: int, k: int, v: int, out: list[DPStage]) -> None:
        kind = self.tree.kinds[x]
        if kind == "series":
            self._collect_series(x, 0, k, v, out)
        elif kind == "parallel":
            self._collect_parallel(x, 0, k, v, out)
        else:
            _, d = self._value(x, k).choice[v]
            out.append(self._stage(x, 0, 1, d, k + 1))

    def _collect_series(self, x: int, i: int, k: int, v: int, out: list[DPStage]) -> None:
        while i < len(self.tree.children[x]):
            how = self._series(x, i, k).choice[v]
            if how[0] == "child":
                u = how[1]
                self._collect(self.tree.children[x][i], u, v, out)
                i, v = i + 1, u
            else:
                _, j, u, d = how
                out.append(self._stage(x, i, j, d, u + 1))
                i, v = j, u

    def _collect_parallel(self, x: int, j: int, k: int, v: int, out: list[DPStage]) -> None:
        while j < len(self.tree.children[x]):
            how = self._parallel(x, j, k).choice[v]
            if how[0] == "child":
                self._collect(self.tree.children[x][j], k, v, out)
                j += 1
            else:
                _, j2, d = how
                out.append(self._stage(x, j, j2, d, k + 1))
                j = j2


def _fewest_devices(profile: tuple[tuple[int, int], ...], in_flight: int) -> int:
    """The first device count of a block's profile that holds ``in_flight`` micro-batches (0: none does)."""
    for d, k in profile:
        if k >= in_flight:
            return d
    return 0
