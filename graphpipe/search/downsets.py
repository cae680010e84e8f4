"""Downsets (ideals) of an op DAG: counting, the search-size guard, enumeration.

Piper's DP (``graphpipe.search.piper``) runs over the downsets of the graph:
a stage is the difference of two nested downsets. They are enumerated
breadth-first from the empty set by adding one minimal op at a time, and
counted first (as antichains, by a memoised include/exclude recursion) so
Piper's guard can refuse before enumerating.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> g = OpGraph.build("v", [Op("s", "x"), Op("a", "x"), Op("b", "x")], [("s", "a", 1), ("s", "b", 1)])
>>> count_downsets(g), [bin(m) for m in enumerate_downsets(g)]
(5, ['0b0', '0b1', '0b11', '0b101', '0b111'])
"""

from __future__ import annotations

from typing import Sequence

from graphpipe.errors import InputError
from graphpipe.graph import OpGraph

__all__ = [
    "DownsetLimitError",
    "count_downsets",
    "count_downset_pairs",
    "check_downset_limit",
    "PAIRS_PER_DOWNSET",
    "enumerate_downsets",
]


PAIRS_PER_DOWNSET = 50
"""Piper's pair guard is this many downset pairs per allowed downset (10 million by default)."""


class DownsetLimitError(InputError):
    """Piper's guard: the graph has more downsets (or downset pairs) than the search may visit."""

    def __init__(self, graph_name: str, count: int, limit: int, pairs: int | None = None,
                 pair_limit: int | None = None, what: str | None = None, fix: str | None = None):
        self.count = count
        self.limit = limit
        self.pairs = pairs
        self.pair_limit = pair_limit
        if what is None and pairs is None:
            what = f"has {count} downsets, more than the limit of {limit}"
        elif what is None:
            what = (f"has {count} downsets (limit {limit}) but {pairs} downset pairs, more than the limit of "
                    f"{pair_limit} pairs ({PAIRS_PER_DOWNSET} x max_downsets)")
        if fix is None:
            fix = ("Use --strategy gpp or pipedream (Piper's time and memory grow with the number of pairs; the "
                   "bound is SearchOptions.max_downsets for Python callers)")
        super().__init__(f"piper: graph {graph_name!r} {what}; Piper's DP grows like n^k for k branches of n ops. "
                         + fix)


# --------------------------------------------------------------------- downsets
def _pred_masks(graph: OpGraph) -> list[int]:
    return [sum(1 << p for p in graph.preds(v)) for v in range(graph.num_ops)]


def _count_antichains(succs: Sequence[Sequence[int]]) -> int:
    """Antichains of a DAG whose node ids are topological, by include/exclude on the lowest node.

    ``count(rest) = count(rest - comparable(v)) + count(rest - v)`` for the
    lowest ``v`` in the candidate set ``rest``, memoised on ``rest``; on the
    branchy graphs of interest the memo stays small (k chains give O(k n)).
    """
    n = len(succs)
    preds: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for w in succs[v]:
            preds[w].append(v)
    anc = [0] * n
    for v in range(n):
        for p in preds[v]:
            anc[v] |= anc[p] | (1 << p)
    desc = [0] * n
    for v in reversed(range(n)):
        for w in succs[v]:
            desc[v] |= desc[w] | (1 << w)
    comparable = [anc[v] | desc[v] | (1 << v) for v in range(n)]
    memo: dict[int, int] = {0: 1}
    stack = [(1 << n) - 1]
    while stack:
        rest = stack[-1]
        if rest in memo:
            stack.pop()
            continue
        v = (rest & -rest).bit_length() - 1
        with_v, without_v = rest & ~comparable[v], rest & ~(1 << v)
        missing = [x for x in (with_v, without_v) if x not in memo]
        if missing:
            stack.extend(missing)
            continue
        memo[rest] = memo[with_v] + memo[without_v]
        stack.pop()
    return memo[(1 << n) - 1]


def count_downsets(graph: OpGraph) -> int:
    """Number of downsets (= antichains: a downset is the set below its maximal ops) of the DAG."""
    return _count_antichains([graph.succs(v) for v in range(graph.num_ops)])


def count_downset_pairs(graph: OpGraph) -> int:
    """Number of pairs of downsets ``D ⊊ D'``: the candidate stages Piper's DP scores.

    Pairs ``D ⊆ D'`` are exactly the downsets of the graph doubled, with op
    ``v``'s copy for ``D`` (id ``2v + 1``) placed after its copy for ``D'``
    (id ``2v``), so ``v ∈ D`` forces ``v ∈ D'``; subtract the ``D = D'``
    ones. Interleaving the copies keeps the counting memo as small as for
    the graph itself.
    """
    n = graph.num_ops
    succs: list[list[int]] = [[] for _ in range(2 * n)]
    for v in range(n):
        succs[2 * v] = [2 * w for w in graph.succs(v)] + [2 * v + 1]
        succs[2 * v + 1] = [2 * w + 1 for w in graph.succs(v)]
    return _count_antichains(succs) - count_downsets(graph)


def check_downset_limit(graph: OpGraph, max_downsets: int) -> tuple[int, int]:
    """Piper's guard, before any enumeration: (downsets, pairs), or :class:`DownsetLimitError`.

    Two limits from the one knob: ``max_downsets`` downsets, and
    ``PAIRS_PER_DOWNSET * max_downsets`` downset pairs, because the DP's time
    and memory grow with the pairs (every pair is a candidate stage with a
    cost per replica count); CANDLE-Uno's 7 x 4 encoders have only ~78k
    downsets but ~171 million pairs.
    """
    num = count_downsets(graph)
    if num > max_downsets:
        raise DownsetLimitError(graph.name, num, max_downsets)
    pairs = count_downset_pairs(graph)
    if pairs > PAIRS_PER_DOWNSET * max_downsets:
        raise DownsetLimitError(graph.name, num, max_downsets, pairs, PAIRS_PER_DOWNSET * max_downsets)
    return num, pairs


def enumerate_downsets(graph: OpGraph, limit: int | None = None) -> list[int]:
    """All downsets as bitmasks, sorted by (size, mask); breadth-first from the empty set.

    Level ``L + 1`` is every level-``L`` downset plus one op all of whose
    predecessors it already holds. Raises :class:`DownsetLimitError` past
    :func:`check_downset_limit` with ``limit`` (counted first, before any enumeration).
    """
    if limit is not None:
        check_downset_limit(graph, limit)
    n = graph.num_ops
    preds = _pred_masks(graph)
    level = [0]
    out: list[int] = [0]
    for _ in range(n):
        nxt: set[int] = set()
        for d in level:
            for v in range(n):
                bit = 1 << v
                if not d & bit and preds[v] & ~d == 0:
                    nxt.add(d | bit)
        level = sorted(nxt)
        out.extend(level)
    return out
