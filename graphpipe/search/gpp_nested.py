"""GraphPipe's DP on an SP tree whose long chains are solved in numpy, every downstream depth at once.

An SP tree that is not itself a chain often holds one: T5's encoder is a
series node of some fifty ops beside the decoder's embedding. The general
DP (:class:`~graphpipe.search.gpp_dp.BottleneckDP`) solves such a node once
per downstream depth ``k`` its parent asks about, a Python loop per state
(node, child, ``k``); on T5-11B that was most of the search.
:class:`NestedChainDP` is that DP, except that a run of more than
``_MIN_CHAIN`` op children ending a series node (the whole node, or the ops
after a parallel child, like T5's decoder) is solved for every ``k`` in one
numpy pass, by the recurrence of :mod:`graphpipe.search.gpp_chain` with a
third axis:

    D[k][v][i] = min(D[k][v-1][i],  min over j of need(i, j, v) + D[k][v-1][j]),
    D[k][v][n] = 0 if v >= k else infeasible,

the boundary being the general DP's empty suffix at downstream depth ``k``
(:meth:`BottleneckDP._identity <graphpipe.search.gpp_dp.BottleneckDP._identity>`).
The options and their order are the chain DP's, which equal the general
DP's, so the tables and the extracted stages are the general DP's
(``tests/test_gpp_nested.py`` checks both on random SP graphs with nested
chains and on a small T5). Level ``v`` only changes depths ``k < v``, and a
depth whose level changes nothing is complete (``need`` grows with ``v``), so
each level works on a window of depths. The depths ``k`` are independent
rows, and a parent asks about few of them (T5's encoder: the breakpoints of
the decoder's table, a handful of up to 73), so a chain is solved only at
the depths its parent announces (:meth:`BottleneckDP._will_ask
<graphpipe.search.gpp_dp.BottleneckDP._will_ask>`) and at any other it is
asked about.

The tables are memoised like the general DP's, under the rank of the node's
scope; the rows of each chain's last few ranks are kept (a search returns to
ranks it left), for the tables and for :meth:`extract`, which solves a row
again when no kept one has the current rank (the same comparisons, so the
same answer).

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> from graphpipe.search.gpp_tree import build_tree
>>> names = [f"e{i}" for i in range(14)] + ["x", "t"]
>>> ops = [Op(n, "x", Affine(0, 1e-3), Affine(0, 2e-3)) for n in names]
>>> edges = [(a, b, 1) for a, b in zip(names[:13], names[1:14])] + [("e13", "t", 1), ("x", "t", 1)]
>>> tree = build_tree(OpGraph.build("enc", ops, edges))
>>> dp = NestedChainDP(tree, preset("v100", 8), 16, 2)
>>> [dp.chains[x][1].n for x in dp.chains]  # the 14-op branch
[14]
>>> general = BottleneckDP(tree, preset("v100", 8), 16, 2)
>>> dp.best_at(0.008) == general.best_at(0.008)
True
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Sequence

import numpy as np

from graphpipe.search.gpp_chain import _STAGES, ChainRanges, pack_bounds, packed_stage_keys, rest_bounds
from graphpipe.search.gpp_dp import INF, BottleneckDP, DPStage, Table

__all__ = ["NestedChainDP"]

_MIN_CHAIN = 12
"""Chains of at most this many ops stay with the general DP: numpy's per-call overhead beats their loops."""
_KEEP = 8
"""Solves kept per chain: a search returns to a rank it left (another depth, a target between two tried)."""


class NestedChainDP(BottleneckDP):
    """:class:`~graphpipe.search.gpp_dp.BottleneckDP` with its long nested chains vectorised (module
    docstring); same arguments, same tables and stages.

    Not a value object: it memoises states across targets and keeps each chain's latest back-pointers.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tree = self.tree
        self.chains: dict[int, tuple[int, ChainRanges]] = {}
        """The chains solved in numpy: per series node, where its last run of more than ``_MIN_CHAIN`` op
        children starts, and that run's options."""
        self._depths: dict[int, int] = {}
        """Per chain, the downstream depths its parents can ask about: stages below it hold at least one op
        each of a path from it to the sink, which has at most the graph's longest path minus its own ops."""
        longest = _longest_paths(tree)
        for x, kind in enumerate(tree.kinds):
            kids = tree.children[x]
            start = len(kids)
            while start and tree.kinds[kids[start - 1]] == "op":
                start -= 1
            if kind == "series" and len(kids) - start > _MIN_CHAIN:
                self.chains[x] = start, ChainRanges(self.blocks, x, self.link, start)
                self._depths[x] = min(self.kcap + 1, tree.longest_path - longest[x] + 1)
        self._solved: dict[int, dict[int, tuple[dict[int, np.ndarray], dict[int, int]]]] = {}
        """Per chain, its latest solves by rank, oldest first (at most ``_KEEP``): the packed table of each
        downstream depth solved (:meth:`_solve_chain`) and the DP states each counted."""
        self._pending: dict[int, set[int]] = {}
        """Per chain, the downstream depths its parent said it will ask about (:meth:`_will_ask`)."""
        self._asked: dict[int, set[int]] = {}
        """Per chain, the depths asked during the current visit to its rank (each counted once a visit)."""

    def _series(self, x: int, i: int, k: int) -> Table:
        start = self.chains[x][0] if x in self.chains else len(self.tree.children[x])
        if i < start or i == len(self.tree.children[x]):
            return super()._series(x, i, k)
        key = (x, i, k, self._rank(x, i))
        got = self._memo.get(key)
        if got is None:
            packed, width, big = self._chain_row(x, k)
            column = packed[:, i - start]
            rests = rest_bounds(column).tolist()
            row, js = (column // width).tolist(), (column % width).tolist()
            feasible = (column < big).tolist()
            got = self._memo[key] = Table.of(
                [c // _STAGES if f else INF for c, f in zip(row, feasible)],
                [c % _STAGES if f else 0 for c, f in zip(row, feasible)],
                [("chain", start + j, u) if f else None for j, u, f in zip(js, rests, feasible)])
        return got

    def _reset(self) -> None:
        super()._reset()
        self._pending = {}   # hints are for one target

    def _will_ask(self, x: int, depths: Sequence[int]) -> None:
        """Node x is about to be asked for these downstream depths: the chains it ends in (through parallel
        nodes, and as the last children of series nodes) are solved for all of them at once."""
        kind = self.tree.kinds[x]
        if kind == "parallel":
            for child in self.tree.children[x]:
                self._will_ask(child, depths)
        elif kind == "series" and x in self.chains:
            self._pending.setdefault(x, set()).update(d for d in depths if d < self._depths[x])

    def _chain_row(self, x: int, k: int) -> tuple[np.ndarray, int, int]:
        """Chain x's packed table at downstream depth k under the current target, ``[v, i]`` (solved if not
        yet, with the depths its parent said it will ask about): :meth:`_solve_chain`'s answer."""
        rank = self._rank(x, self.chains[x][0])
        kept = self._solved.setdefault(x, {})
        if not kept or next(reversed(kept)) != rank:   # a new visit to this rank
            got = kept.pop(rank, None)
            if got is None:
                if len(kept) >= _KEEP:
                    del kept[next(iter(kept))]
                got = ({}, {})
            kept[rank] = got   # the latest last
            self._asked[x] = set()
        rows, states = kept[rank]
        if k not in rows:
            wanted = sorted({k} | {d for d in self._pending.pop(x, ()) if d not in rows})
            packed, counted = self._solve_chain(x, wanted)
            for r, d in enumerate(wanted):
                rows[d], states[d] = packed[:, r], counted[r]
        if k not in self._asked[x]:   # a state is counted once a visit, as the chain DP counts a target
            self._asked[x].add(k)
            self.dp_states += states[k]
        width, _, big = pack_bounds(self.chains[x][1].n, self.num_devices)
        return rows[k], width, big

    def _solve_chain(self, x: int, depths: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        """(packed, states): ``packed[v, r, i]``, ops i.. of chain x with downstream depth ``depths[r]``
        (sorted, distinct) and source depth <= v, as ``key * width + j`` where ``key`` is the (devices,
        stages) key and ops i..j-1 the first stage (:func:`~graphpipe.search.gpp_chain.pack_bounds`: from
        ``big`` on, infeasible); ``states[r]``:
        the DP states row r evaluated. The bound after the first stage is the level before the last one
        whose value fell (a level takes a stage only if it is smaller, :meth:`_series`).

        Rows are independent, so only those asked about are solved. One integer per state lets a level be
        a few numpy calls: the candidates ``need + rest`` of every pair packed with their ``j`` compare as
        the recurrence orders them (the smallest key, then the smallest ``j``), and a level keeps its
        previous value unless a candidate is smaller. A sum that reaches the cluster's size is infeasible
        whatever it is, so it is not clipped."""
        ranges = self.chains[x][1]
        n, size, mbs = ranges.n, self.kcap + 1, self.num_mbs
        m = len(depths)
        ds = np.array(self.ds, dtype=np.int64)
        pi, pj, reach = ranges.options(self.t_max)
        starts = np.flatnonzero(np.r_[True, pi[1:] != pi[:-1]])   # every i has its single op: no empty run
        width, limit, big = pack_bounds(n, self.num_devices)
        pj = pj.astype(np.int64)
        # need[v - 1, pair]: the pair as one stage at depth v; with j packed in
        need = packed_stage_keys(reach, ds, size, mbs, limit, width, pj)
        rest = np.full((2, m, n + 1), big, dtype=np.int64)   # key * width at levels v - 1 and v, by parity
        first = min(depths[0] + 1, size)
        rest[(first - 1) & 1, :bisect_right(depths, first - 1), n] = 0   # the empty suffix meets depth k
        packed = np.empty((size, m, n), dtype=np.int64)
        packed[:first] = big
        left = np.full(m, size, dtype=np.int64)   # the level at which each row left the window
        lo = 0
        scratch = np.empty((m, len(pj)), dtype=np.int64)
        for v in range(first, size):
            # rows lo..hi-1: those below lo are complete, those from hi on have nothing feasible yet
            hi = bisect_left(depths, v)
            now = rest[v & 1]
            now[bisect_left(depths, v - 1):bisect_right(depths, v), n] = 0   # from level k on, in both buffers
            if lo >= hi:
                if lo == m:
                    break
                packed[v, lo:] = big
                continue
            total = scratch[:hi - lo]
            np.take(rest[(v - 1) & 1, lo:hi], pj, axis=1, out=total)
            total += need[v - 1]
            cur = packed[v, lo:hi]
            np.minimum(np.minimum.reduceat(total, starts, axis=1), packed[v - 1, lo:hi], out=cur)
            np.subtract(cur, cur % width, out=now[lo:hi, :n])
            packed[v, hi:] = big
            # a row whose level changed nothing is complete (need only grows with v, gpp_chain), and the
            # window leaves its lowest rows first
            while lo < hi and not (packed[v, lo] < packed[v - 1, lo]).any():
                left[lo] = v + 1
                lo += 1
        for r in range(lo):   # rows that left the window hold their last level from there on
            v = left[r] - 1
            packed[v + 1:, r] = packed[v, r]
        states = [n * max(int(left[r]) - 1 - d, 0) for r, d in enumerate(depths)]
        return packed, states

    def _collect_series(self, x: int, i: int, k: int, v: int, out: list[DPStage]) -> None:
        if x not in self.chains:
            return super()._collect_series(x, i, k, v, out)
        kids = self.tree.children[x]
        start = self.chains[x][0]
        while i < start:   # the general DP's steps up to the chain
            how = self._series(x, i, k).choice[v]
            if how[0] == "child":
                self._collect(kids[i], how[1], v, out)
                i, v = i + 1, how[1]
            else:
                _, j, u, d = how
                out.append(self._stage(x, i, j, d, u + 1))
                i, v = j, u
        if i == len(kids):
            return
        packed, width, _ = self._chain_row(x, k)
        while i < len(kids):
            column = packed[:v + 1, i - start]
            j, u = start + int(column[v] % width), int(rest_bounds(column)[v])
            if j == i + 1:   # the op alone, from its own leaf's tables (the general DP's "child")
                out.append(self._stage(kids[i], 0, 1, self._base_devices(kids[i], 0, 1, u + 1), u + 1))
            else:
                out.append(self._stage(x, i, j, self._base_devices(x, i, j, u + 1), u + 1))
            i, v = j, u


def _longest_paths(tree) -> list[int]:
    """Ops on the longest path through each node of ``tree`` (series: the sum over children, parallel: the
    most of any child)."""
    out = [0] * len(tree.kinds)

    def visit(x: int) -> int:
        kids = tree.children[x]
        if not kids:
            out[x] = 1
        else:
            lengths = [visit(c) for c in kids]
            out[x] = sum(lengths) if tree.kinds[x] == "series" else max(lengths)
        return out[x]

    visit(tree.root)
    return out
