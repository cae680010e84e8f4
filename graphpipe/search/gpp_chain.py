"""GraphPipe's DP on the chain view, one depth level at a time in numpy.

The chain view (:func:`~graphpipe.search.gpp_tree.chain_tree`) is one series
node whose children are the graph's ops in topological order. On it the
recurrence of :class:`~graphpipe.search.gpp_dp.BottleneckDP` reads

    D[i][v] = min over j > i, u < v of  need(i, j, u + 1) + D[j][u],    D[n][v] = 0,

``D[i][v]`` being the (fewest devices, then fewest stages) of ops ``i..n-1``
with at most ``v`` stages, and ``need(i, j, k)`` the fewest devices on which
ops ``i..j-1`` form one stage meeting the target with ``min(k, M)``
micro-batches in flight (graph-1F1B's count for a stage with ``k - 1``
stages after it). The options with ``u < v - 1`` are those of ``D[i][v-1]``,
so

    D[i][v] = min(D[i][v-1],  min over j of need(i, j, v) + D[j][v-1]),

one vector operation over ``(i, j)`` per level ``v`` instead of a Python
loop per state. ``need`` only grows with ``v``, so once a level changes
nothing, no later level does and the table is complete.

It is the same DP, not an approximation: the options are those
:class:`BottleneckDP` evaluates (op ``i`` alone, from the op's own cost
table; ranges ``i..j-1`` of two or more ops pruned by the same dominance
rule, :meth:`BottleneckDP._range_ends`), compared in the same order -- fewest
devices, then fewest stages, then the shortest first stage, then the
smallest depth after it -- so the tables and the extracted stages are
identical (``tests/test_gpp_chain.py`` compares both on random chains and on
the zoo's models). The difference is speed: on mmt-shaped-16x4's chain
view (67 ops) a target takes about 0.6 ms instead of 4.5 ms (random targets,
nothing memoised). Inside the arrays a (devices, stages) pair is one integer,
``devices * _STAGES + stages``, so that numpy's min compares both in order;
the tables it returns name them.

Example
-------
The chain view of a diamond ``s -> a, b -> t`` (ops in id order) at
micro-batch 2, so at most 2 replicas per stage: two stages of two ops.

>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> from graphpipe.search.gpp_tree import chain_tree
>>> edges = [("s", "a", 1), ("s", "b", 1), ("a", "t", 1), ("b", "t", 1)]
>>> diamond = OpGraph.build("diamond", [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in "sabt"], edges)
>>> dp = ChainDP(chain_tree(diamond), preset("v100", 4), batch_size=16, micro_batch_size=2)
>>> depth, stages = dp.best_at(0.003)
>>> depth, [(s.op_ids, s.num_devices) for s in stages]
(2, [((0, 1), 2), ((2, 3), 2)])
"""

from __future__ import annotations

import numpy as np

from graphpipe.cluster import Link
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_dp import INF, DPStage, Table, TargetDP
from graphpipe.search.gpp_tree import DPTree

__all__ = ["ChainDP", "ChainRanges", "is_chain", "pack_bounds", "packed_stage_keys", "rest_bounds"]

_STAGES = 1 << 20
"""A (devices, stages) pair is kept as ``devices * _STAGES + stages``: one integer compares both in order."""
_NONE = 1 << 60
"""The key of an infeasible pair (devices above any cluster's); the sum of two stays inside int64."""


def is_chain(tree: DPTree) -> bool:
    """Whether ``tree`` is one series node over ops: the chain view, or the SP tree of a branchless graph."""
    root = tree.root
    return tree.kinds[root] == "series" and all(tree.kinds[c] == "op" for c in tree.children[root])


def rest_bounds(column: np.ndarray) -> np.ndarray:
    """u[v]: the bound after the first stage of a packed DP column (levels ``0..``), the level before the last
    one at or below ``v`` whose value fell: a level takes a new stage only if it is smaller (0: none)."""
    levels = np.arange(len(column))
    fell = np.r_[False, column[1:] < column[:-1]]
    return np.maximum.accumulate(np.where(fell, levels - 1, 0))


def pack_bounds(n: int, num_devices: int) -> tuple[int, int, int]:
    """``(width, limit, big)`` of a chain of ``n`` ops on ``num_devices``: a DP state is ``key * width + j``
    (``j <= n`` the end of its first stage); keys from ``limit`` on need more devices than there are, so
    packed values from ``big`` on are infeasible, and sums of two stay inside int64."""
    width = n + 1
    limit = (num_devices + 1) * _STAGES
    return width, limit, limit * width


def packed_stage_keys(reach: np.ndarray, ds: np.ndarray, top: int, mbs: int, limit: int, width: int,
                      j: np.ndarray) -> np.ndarray:
    """need[v - 1, pair] as the DPs add it up: the devices-and-one-stage key of each pair as one stage at
    bound ``v`` (``1 <= v < top``), clipped at ``limit`` (infeasible), times ``width``, plus the pair's end
    ``j[pair]``; every level at once. ``reach[pair]`` (sorted along the device choices ``ds``) comes from
    :meth:`ChainRanges.options`; the key is that of the first device count holding ``min(v, mbs)`` in flight
    (none: infeasible), looked up in a table already scaled."""
    table = np.minimum(np.append(ds * _STAGES + 1, _NONE), limit) * width   # index len(ds): none holds that many
    out = table[_first_fitting(reach, top, mbs)]
    out += j
    return out


def _first_fitting(reach: np.ndarray, top: int, mbs: int) -> np.ndarray:
    """first[v - 1, pair]: how many device choices hold fewer than ``min(v, mbs)`` in flight (``1 <= v <
    top``), as int16."""
    # A choice holding r < mbs counts from level v = r + 1 on (row r), one holding mbs or more never: one
    # step per choice and pair, summed down the levels (narrow integers: these arrays, levels x pairs, are
    # the biggest the DPs make).
    levels, pairs = max(top - 1, 0), reach.shape[0]
    steps = np.zeros((levels + 1, pairs), dtype=np.int16)
    columns = np.arange(pairs)
    for row in reach.T:  # one device choice at a time: its pairs are distinct, so no index repeats
        steps[np.where(row < mbs, np.minimum(row, levels), levels), columns] += 1
    return np.cumsum(steps[:levels], axis=0, dtype=np.int16)   # len(ds): no device count holds that many


class ChainRanges:
    """The stage options of a series node's children from ``start`` on, all ops (a chain), as arrays: which
    ranges of them the DP tries under a target, and what each holds on how many devices.

    ``cost[i, j, c]`` and ``held[i, j, c]``: ops ``i..j-1`` (children ``start + i..``) as one stage on
    ``ds[c]`` replicas (``i < n``, ``j <= n``). Op ``i`` alone takes its own leaf's tables, as BottleneckDP's "child" option does (a
    range's prefix sums may differ in the last bit).
    """

    def __init__(self, blocks: BlockCosts, x: int, link: Link | None, start: int = 0):
        kids = blocks.tree.children[x][start:]
        n = self.n = len(kids)
        cost = blocks.stage_cost(x, link)[start:, start:][:n].copy()
        held = blocks.max_in_flight(x)[start:, start:][:n].copy()
        for i, leaf in enumerate(kids):
            cost[i, i + 1] = blocks.stage_cost(leaf, link)[0, 1]
            held[i, i + 1] = blocks.max_in_flight(leaf)[0, 1]
        self.cost = cost
        self.held = held = np.maximum(held, 0)
        # A range of >= 2 ops grows while its compute (not its cut) meets the target and it fits memory on
        # some device count (_range_ends): the cheapest such compute per range says up to which target.
        compute = blocks.stage_tps(x)[start:, start:][:n] if link is not None else cost
        self._grows_below = np.min(np.where(held > 0, compute, np.inf), axis=-1)
        ij = np.arange(n + 1)[None, :] - np.arange(n)[:, None]   # j - i
        self._single = ij == 1
        self._longer = ij >= 2

    def options(self, t_max: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (i, j) that are options under ``t_max``, sorted by i then j, and their rows
        reach[c]: the most in-flight ops i..j-1 hold as one stage on at most ``ds[c]`` devices (0: none)."""
        # Ranges of >= 2 ops are tried while every range from i up to them grows (see __init__).
        grows = (self._grows_below <= t_max) | ~self._longer
        alive = np.logical_and.accumulate(grows, axis=1) & self._longer
        i, j = np.nonzero(self._single | alive)
        reach = np.maximum.accumulate(np.where(self.cost[i, j] <= t_max, self.held[i, j], 0), axis=-1)
        longer = alive[i, j]
        # A longer range is an option when it holds something and differs from the next longer one, or
        # that one is not tried (else the longer one dominates it). Its next is the next pair, if alive.
        ends = np.ones(len(i), dtype=bool)
        ends[:-1] = ~(longer[1:] & (i[1:] == i[:-1])) | np.any(reach[:-1] != reach[1:], axis=-1)
        keep = ~longer | ((reach[:, -1] > 0) & ends)
        return i[keep], j[keep], reach[keep]


class ChainDP(TargetDP):
    """:class:`~graphpipe.search.gpp_dp.BottleneckDP` for a chain tree (module docstring), same interface
    and arguments (:class:`~graphpipe.search.gpp_dp.TargetDP`'s).

    Not a value object: :meth:`solve` keeps the last target's back-pointers for :meth:`extract`.
    """

    def __init__(self, tree: DPTree, *args, **kwargs):
        if not is_chain(tree):
            raise ValueError("ChainDP needs a chain tree: one series node over its ops (gpp_tree.chain_tree)")
        super().__init__(tree, *args, **kwargs)
        self._ranges = ChainRanges(self.blocks, tree.root, self.link)
        self.n = self._ranges.n
        self._cost = self._ranges.cost
        self._ds = np.array(self.ds, dtype=np.int64)
        self._choice: np.ndarray | None = None
        """The last solve's packed table (:meth:`solve`): each state's first stage and, from where its value
        fell, the bound after it."""
        self._levels = 0
        """Bounds of the last solve whose back-pointers are filled in (a solve up to a depth stops early)."""
        self._pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._last: tuple | None = None
        """The last solve's ``(t_max, depth, table, states counted)``: a search often asks the same target
        twice in a row (a feasibility test, then the stages), and the back-pointers are still those."""

    def solve(self, t_max: float, depth: int | None = None) -> Table:
        """Run the DP for target ``t_max``; returns the whole chain's table (index = bound on its depth).

        ``depth``: only bounds up to it are asked about; the table may then end there (level by level,
        bound ``v`` needs only the levels up to ``v``).
        """
        if self._last is not None and self._last[:2] == (t_max, depth):
            self.t_max = t_max
            self.dp_states += self._last[3]
            return self._last[2]
        counted = self.dp_states
        self.t_max = t_max
        n, size, mbs = self.n, self.kcap + 1, self.num_mbs
        top = size if depth is None else min(depth + 1, size)
        i, j, reach = self._ranges.options(t_max)
        starts = np.flatnonzero(np.r_[True, i[1:] != i[:-1]])   # every i has its single op: no empty run
        width, limit, big = pack_bounds(n, self.num_devices)
        # packed[v, i]: ops i.. at bound v as key * width + j (ops i..j-1 the first stage; ``big`` and above:
        # infeasible), so one min per i picks the fewest (devices, stages), then the smallest j (the order
        # the pairs are sorted in); a level keeps its previous value unless a candidate is smaller. A sum
        # reaching the cluster's size is infeasible whatever it is, so it is not clipped.
        j = j.astype(np.int64)
        need = packed_stage_keys(reach, self._ds, top, mbs, limit, width, j)
        packed = np.empty((size, n), dtype=np.int64)
        packed[0] = big
        rest = np.full(n + 1, big, dtype=np.int64)   # the last level's keys times width; the empty suffix: 0
        rest[n] = 0
        total = np.empty(len(j), dtype=np.int64)
        for v in range(1, top):
            np.take(rest, j, out=total)
            total += need[v - 1]
            cur = packed[v]
            np.minimum(np.minimum.reduceat(total, starts), packed[v - 1], out=cur)
            np.subtract(cur, cur % width, out=rest[:n])
            self.dp_states += n
            if not (cur < packed[v - 1]).any():  # need only grows with v: no later level changes anything
                packed[v + 1:] = cur
                top = size
                break
        self._choice, self._levels, self._pairs = packed, top, (i, j, reach)
        root = packed[:top, 0]
        feasible = (root < big).tolist()
        keys, js, rests = (root // width).tolist(), (root % width).tolist(), rest_bounds(root).tolist()
        devices = [key // _STAGES if f else INF for key, f in zip(keys, feasible)]
        stages = [key % _STAGES if f else 0 for key, f in zip(keys, feasible)]
        how = [(jj, u) if f else None for jj, u, f in zip(js, rests, feasible)]
        table = Table.of(devices, stages, how)
        self._last = (t_max, depth, table, self.dp_states - counted)
        return table

    def choice(self, v: int, i: int) -> tuple[int, int]:
        """(j, u) of ops i.. at bound v in the last solve: the first stage is ops i..j-1, the rest within
        bound u."""
        assert self._choice is not None
        column = self._choice[:v + 1, i]
        return int(column[v] % (self.n + 1)), int(rest_bounds(column)[v])

    def extract(self, v: int) -> list[DPStage]:
        """Stages of the solution with depth <= v (after :meth:`solve`), first stage first."""
        assert self._choice is not None and self._pairs is not None
        if v >= self._levels:
            raise ValueError(f"bound {v} was not solved for: the last solve stopped at {self._levels - 1}")
        pi, pj, reach = self._pairs
        flat = pi * (self.n + 1) + pj   # sorted: pairs come sorted by i, then j
        out, i = [], 0
        while i < self.n:
            j, u = self.choice(v, i)
            k_in = min(u + 1, self.num_mbs)
            c = int(np.argmax(reach[np.searchsorted(flat, i * (self.n + 1) + j)] >= k_in))
            out.append(DPStage(tuple(range(i, j)), self.ds[c], k_in, float(self._cost[i, j, c])))
            i, v = j, u
        return out
