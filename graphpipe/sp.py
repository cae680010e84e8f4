"""Series-parallel decomposition of an op graph (docs/design.md#series-parallel-decomposition, GraphPipe §4).

GraphPipe's partitioner (paper Alg. 1) is a dynamic program over a
series-parallel (SP) tree: a *series* node is solved by choosing a cut between
consecutive children, a *parallel* node by splitting devices between children
that run concurrently. This module builds that tree.

Definition used (vertex-based, over the reachability order of the ops)
---------------------------------------------------------------------
Every op is one leaf. An inner node covers a set of ops and is

* ``"series"`` with children ``C1..Ck`` when every op of ``Ci`` reaches every
  op of ``Cj`` for ``i < j`` (so all edges between children point forward and
  any sequence of stage graphs for ``C1, ..., Ck`` composes into a DAG);
* ``"parallel"`` when its children have no edge and no path between them.

This is the classical series-parallel *partial order*: a DAG decomposes this
way iff its reachability order contains no induced "N" (``a<c, a<d, b<d``
with ``b`` incomparable to ``a`` and ``c``). Several sources or sinks are
fine: the root is then a parallel node, or a series whose first/last child is
parallel -- exactly what adding docs/design.md#series-parallel-decomposition's virtual source and sink gives.

Why order-based rather than two-terminal *edge* SP: edge-SP rejects graphs
whose only defect is a transitive ("shortcut") edge such as the bridge
``a->b, a->c, b->c, b->d, c->d`` although a pipeline partitioner only cares
about which op must precede which. On the PipeDream profiles in data/ the two
definitions agree with each other and with their README (alexnet, vgg16,
resnet18, resnet50, inception_v3 SP; nasnetamobile and gnmt not; checked by
series/parallel edge reductions with a virtual source and sink), and
``tests/test_sp.py`` checks the order-based answer against the README.

Algorithm (near-linear in practice)
-----------------------------------
The parallel children of an op set are the weakly connected components of
its induced subgraph (two ops joined by an edge are comparable, and
comparability components are weak components). A weakly connected set splits
in series at every position ``k`` of its (topological) id order such that the
first ``k`` ops are ancestors of every later op; with ancestor sets as
bitmasks this test is one suffix-minimum pass. Cutting at *all* such
positions at once yields series children that cannot be split in series
again, and the weak components of a parallel node are connected, so the tree
comes out flattened (no series under series, no parallel under parallel).
A connected set of two or more ops with no series cut is a *prime* region:
the graph is not SP there. Every node's op set is convex (anything on a path
between two of its ops belongs to it), so reachability inside it equals
reachability in the whole graph and one set of global bitmasks serves all.

Non-SP graphs (GNMT, NASNet) are made SP by contracting small convex op sets
inside the prime regions, each merging two ops of an induced N, until no N is
left (GNMT 48 -> 41 ops, NASNet-A mobile 921 -> 564); see
:func:`make_series_parallel`. Contracting whole prime regions would also give
an SP graph but swallows most of such a model (all of GNMT, 918 of NASNet's
921 ops), leaving the partitioner nothing to cut.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> g = OpGraph.build("diamond", [Op(n, "x") for n in "sabt"],
...                   [("s", "a", 1), ("s", "b", 1), ("a", "t", 1), ("b", "t", 1)])
>>> tree = decompose(g)
>>> root = tree.nodes[tree.root]
>>> root.kind, [tree.nodes[c].kind for c in root.children], num_branches(tree)
('series', ['op', 'parallel', 'op'], 2)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from graphpipe import costs
from graphpipe.errors import GraphCycleError, InputError
from graphpipe.graph import Affine, Edge, Op, OpGraph

__all__ = [
    "SPNode",
    "SPTree",
    "decompose",
    "make_series_parallel",
    "is_series_parallel",
    "num_branches",
    "prime_regions",
    "contract",
    "induced_subgraph",
]

logger = logging.getLogger(__name__)

OP, SERIES, PARALLEL = "op", "series", "parallel"


@dataclass(frozen=True, slots=True)
class SPNode:
    """One node of the SP tree.

    id: index in :attr:`SPTree.nodes`; DP subproblems are memoised by it.
    kind: ``"op"`` (a leaf, one op), ``"series"`` or ``"parallel"``.
    children: child node ids; series in dependency order, parallel sorted by
        their smallest op id; ``()`` for a leaf.
    op_ids: every op of this subgraph, sorted; siblings are disjoint and their
        union is the parent's.
    """

    id: int
    kind: str
    children: tuple[int, ...]
    op_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in (OP, SERIES, PARALLEL):
            raise InputError(f"SP node kind must be 'op', 'series' or 'parallel', got {self.kind!r}")
        if self.kind == OP and (self.children or len(self.op_ids) != 1):
            raise InputError(f"SP leaf {self.id} must hold one op and no children, got {self.op_ids}, {self.children}")
        if self.kind != OP and len(self.children) < 2:
            raise InputError(f"SP {self.kind} node {self.id} needs at least two children, got {self.children}")


@dataclass(frozen=True, slots=True)
class SPTree:
    """A series-parallel tree over ``graph``.

    graph: the graph decomposed (after contraction of non-SP regions).
    nodes: children before parents (post-order); ``nodes[root]`` is the root.
    root: id of the root node (always ``len(nodes) - 1``).
    merged: contracted op name -> original op names (``{}`` if already SP).
    """

    graph: OpGraph
    nodes: tuple[SPNode, ...]
    root: int
    merged: Mapping[str, tuple[str, ...]]

    def leaf_of(self, op_id: int) -> int:
        """Id of the leaf node holding ``op_id``."""
        for node in self.nodes:
            if node.kind == OP and node.op_ids[0] == op_id:
                return node.id
        raise InputError(f"op id {op_id} is not in graph {self.graph.name!r} ({self.graph.num_ops} ops)")


# --------------------------------------------------------------- splitting
def _ancestor_masks(graph: OpGraph) -> list[int]:
    """``anc[v]``: bitmask (bit ``u`` = op id ``u``) of every ancestor of ``v``.

    Op ids are topological, so one pass in id order suffices.
    """
    anc = [0] * graph.num_ops
    for v in range(graph.num_ops):
        mask = 0
        for p in graph.preds(v):
            mask |= anc[p] | (1 << p)
        anc[v] = mask
    return anc


def _components(graph: OpGraph, op_ids: Sequence[int]) -> list[list[int]]:
    """Weakly connected components of the subgraph induced by ``op_ids``.

    Returned sorted by smallest op id, each sorted.
    """
    member = set(op_ids)
    seen: set[int] = set()
    comps: list[list[int]] = []
    for start in op_ids:
        if start in seen:
            continue
        seen.add(start)
        comp = [start]
        stack = [start]
        while stack:
            u = stack.pop()
            for w in graph.succs(u) + graph.preds(u):
                if w in member and w not in seen:
                    seen.add(w)
                    comp.append(w)
                    stack.append(w)
        comp.sort()
        comps.append(comp)
    return comps


def _series_segments(op_ids: Sequence[int], anc: Sequence[int]) -> list[list[int]]:
    """Split sorted ``op_ids`` at every position ``k`` whose prefix precedes the rest.

    ``reach[i]`` = length of the longest prefix of ``op_ids`` made of ancestors
    of ``op_ids[i]``; a cut before position ``k`` is valid iff every op at a
    position ``>= k`` has ``reach >= k``, i.e. the suffix minimum of ``reach``
    at ``k`` is at least ``k``.
    """
    n = len(op_ids)
    pos = {v: i for i, v in enumerate(op_ids)}
    mask = 0
    for v in op_ids:
        mask |= 1 << v
    reach = [0] * n
    for i, v in enumerate(op_ids):
        missing = mask & ~anc[v]  # v itself is always missing, so this is non-zero
        reach[i] = pos[(missing & -missing).bit_length() - 1]
    segments: list[list[int]] = []
    end = n
    suffix_min = n
    for k in range(n - 1, 0, -1):
        suffix_min = min(suffix_min, reach[k])
        if suffix_min >= k:
            segments.append(list(op_ids[k:end]))
            end = k
    segments.append(list(op_ids[:end]))
    segments.reverse()
    return segments


@dataclass(frozen=True, slots=True)
class _Split:
    """One op set and how it splits: kind, child op sets (``prime``: no split)."""

    op_ids: tuple[int, ...]
    kind: str  # op | series | parallel | prime
    parts: tuple[tuple[int, ...], ...]


def _split_all(graph: OpGraph, stop_at_prime: bool = True) -> tuple[list[_Split], list[tuple[int, ...]]]:
    """Split the whole graph top-down; returns (splits in pre-order, prime regions).

    Iterative (no recursion) so deep nesting cannot hit Python's stack limit.
    """
    anc = _ancestor_masks(graph)
    splits: list[_Split] = []
    primes: list[tuple[int, ...]] = []
    stack: list[tuple[int, ...]] = [tuple(range(graph.num_ops))] if graph.num_ops else []
    while stack:
        op_ids = stack.pop()
        if len(op_ids) == 1:
            splits.append(_Split(op_ids, OP, ()))
            continue
        comps = _components(graph, op_ids)
        if len(comps) > 1:
            parts = tuple(tuple(c) for c in comps)
            splits.append(_Split(op_ids, PARALLEL, parts))
        else:
            segments = _series_segments(op_ids, anc)
            if len(segments) == 1:
                primes.append(op_ids)
                splits.append(_Split(op_ids, "prime", ()))
                if stop_at_prime:
                    return splits, primes
                continue
            parts = tuple(tuple(s) for s in segments)
            splits.append(_Split(op_ids, SERIES, parts))
        stack.extend(reversed(parts))
    return splits, primes


def prime_regions(graph: OpGraph) -> list[tuple[int, ...]]:
    """The maximal non-SP regions the decomposition meets (sorted op ids each).

    Each is a convex, weakly connected op set with no series cut and more than
    one op; they are pairwise disjoint. Empty iff ``graph`` is SP.
    """
    _, primes = _split_all(graph, stop_at_prime=False)
    return sorted(primes)


def is_series_parallel(graph: OpGraph) -> bool:
    """True iff the reachability order of ``graph`` is series-parallel (N-free).

    >>> from graphpipe.graph import Op, OpGraph
    >>> is_series_parallel(OpGraph.build("n", [Op(x, "x") for x in "abcd"],
    ...                    [("a", "c", 1), ("a", "d", 1), ("b", "d", 1)]))
    False
    """
    _, primes = _split_all(graph, stop_at_prime=True)
    return not primes


# -------------------------------------------------------------- contraction
def _merged_name(names: Sequence[str], taken: set[str]) -> str:
    if len(names) <= 4:
        base = "merge(" + "+".join(names) + ")"
    else:
        base = f"merge({names[0]}+...+{names[-1]};{len(names)} ops)"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}#{k}"
    taken.add(name)
    return name


def contract(graph: OpGraph, regions: Sequence[Sequence[int]], name: str | None = None
             ) -> tuple[OpGraph, dict[str, tuple[str, ...]]]:
    """Contract each convex op set of ``regions`` into one op.

    The merged op sums forward/backward ``alpha`` and ``beta``, parameter and
    activation bytes (running the region as one op costs what its ops cost);
    its ``out_bytes`` is the output of its members that leave the region (the
    region's sinks' if nothing leaves); parallel edges into/out of a region
    are summed, as stage edges are. Non-convex regions would create a cycle and
    raise :class:`~graphpipe.errors.GraphCycleError` from ``OpGraph.build``.
    """
    region_of: dict[int, int] = {}
    for r, region in enumerate(regions):
        for v in region:
            if v in region_of:
                raise InputError(f"op {graph.ops[v].name!r} is in two regions to contract; regions must be disjoint")
            region_of[v] = r
    taken = {op.name for op in graph.ops}
    region_names: list[str] = []
    mapping: dict[str, tuple[str, ...]] = {}
    for region in regions:
        members = tuple(graph.ops[v].name for v in sorted(region))
        rname = _merged_name(members, taken)
        region_names.append(rname)
        mapping[rname] = members

    def new_name(v: int) -> str:
        r = region_of.get(v)
        return graph.ops[v].name if r is None else region_names[r]

    ops: list[Op] = []
    for v, op in enumerate(graph.ops):
        r = region_of.get(v)
        if r is None:
            ops.append(op)
            continue
        region = sorted(regions[r])
        if v != region[0]:
            continue
        fwd = bwd = wgrad = Affine(0.0, 0.0)
        params = act = 0.0
        for u in region:
            fwd = fwd + graph.ops[u].fwd
            bwd = bwd + graph.ops[u].bwd
            wgrad = wgrad + costs.weight_grad_model(graph.ops[u])
            params += graph.ops[u].param_bytes
            act += graph.ops[u].act_bytes
        measured = any(graph.ops[u].wgrad is not None for u in region)  # else the merged op takes the share too
        leaving = [u for u in region if any(region_of.get(w) != r for w in graph.succs(u))]
        if not leaving:
            leaving = [u for u in region if not graph.succs(u)]
        out = sum(graph.ops[u].out_bytes for u in leaving)
        ops.append(Op(region_names[r], "merged", fwd, bwd, params, act, out, wgrad if measured else None,
                      batchnorm=any(graph.ops[u].batchnorm for u in region),
                      dropout=any(graph.ops[u].dropout for u in region)))
    edge_bytes: dict[tuple[str, str], tuple[float, float]] = {}  # (bytes, saved); an edge inside a region is never cut
    for e in graph.edges:
        key = (new_name(e.src), new_name(e.dst))
        if key[0] == key[1]:
            continue
        nbytes, saved = edge_bytes.get(key, (0.0, 0.0))
        edge_bytes[key] = (nbytes + e.bytes, saved + e.saved)
    edges = [(s, d, b, v) for (s, d), (b, v) in edge_bytes.items()]
    return OpGraph.build(name or graph.name, ops, edges), mapping


def _descendant_masks(graph: OpGraph) -> list[int]:
    """``desc[v]``: bitmask of every descendant of ``v`` (reverse id order pass)."""
    desc = [0] * graph.num_ops
    for v in range(graph.num_ops - 1, -1, -1):
        mask = 0
        for s in graph.succs(v):
            mask |= desc[s] | (1 << s)
        desc[v] = mask
    return desc


def _bits(mask: int):
    """Set bit positions of ``mask``, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _find_ns(graph: OpGraph, region: Sequence[int], anc: Sequence[int], desc: Sequence[int]):
    """Yield induced "N"s ``(a, b, c, d)`` of ``region``: a<c, a<d, b<d, all else incomparable.

    Scans ``d`` in topological order, so the first N yielded has the lowest
    possible ``d``. For that ``d`` the ``b`` of some N is a direct predecessor
    of ``d`` (for an N whose ``b`` is not, the direct predecessor ``b'`` of
    ``d`` above ``b`` either replaces ``b`` or is itself the ``d`` of a lower
    N), and ``c`` can be taken as a direct successor of ``a`` (dually, take
    ``a`` maximal). So the search runs over edges, not over all 4-tuples, and
    always yields at least one N when the region is not SP.
    """
    member = 0
    for v in region:
        member |= 1 << v
    succ_mask: dict[int, int] = {}
    for d in region:
        below_d = anc[d] & member
        not_c = anc[d] | desc[d] | (1 << d)
        for b in graph.preds(d):
            if not (member >> b) & 1:
                continue
            cand_a = below_d & ~(anc[b] | desc[b] | (1 << b))  # below d, incomparable to b
            bad_c = not_c | desc[b]  # c must be incomparable to d and not above b
            for a in _bits(cand_a):
                sm = succ_mask.get(a)
                if sm is None:
                    sm = 0
                    for w in graph.succs(a):
                        sm |= 1 << w
                    succ_mask[a] = sm
                escape = sm & member & ~bad_c
                if escape:
                    yield a, b, (escape & -escape).bit_length() - 1, d


def _hull(members: Sequence[int], anc: Sequence[int], desc: Sequence[int]) -> int:
    """Bitmask of the convex hull of ``members``: every op on a path between two of them."""
    up = down = 0
    for v in members:
        up |= desc[v] | (1 << v)
        down |= anc[v] | (1 << v)
    return up & down


def _pair_fix(n: tuple[int, int, int, int], anc: Sequence[int], desc: Sequence[int]) -> int:
    """Bitmask of the smallest convex op set that merges two ops of the N ``n``.

    Merging any two of an N's four ops destroys it; candidates are the convex
    hulls of the six pairs, smallest first. Ties prefer comparable pairs
    (``b``,``d`` then ``a``,``c``: fusing a producer into its consumer, like
    fusing layers) over incomparable ones (which would fuse two branches).
    """
    a, b, c, d = n
    best_key, best_mask = None, 0
    for position, pair in enumerate(((b, d), (a, c), (a, d), (a, b), (c, d), (b, c))):
        mask = _hull(pair, anc, desc)
        key = (bin(mask).count("1"), position)
        if best_key is None or key < best_key:
            best_key, best_mask = key, mask
    return best_mask


def _region_fixes(graph: OpGraph, region: Sequence[int], anc: Sequence[int], desc: Sequence[int]
                  ) -> list[tuple[int, ...]]:
    """Disjoint convex op sets to contract in ``region`` in one pass (at least one).

    The first comes from the lowest N; later Ns whose fix touches no op of an
    earlier fix (nor its neighbours, to keep joint contraction acyclic in the
    common case) are batched so that big regions need few rounds.
    """
    fixes: list[int] = []
    used = 0
    for n in _find_ns(graph, region, anc, desc):
        if any((used >> v) & 1 for v in n):
            continue
        mask = _pair_fix(n, anc, desc)
        if mask & used:
            continue
        fixes.append(mask)
        for v in _bits(mask):
            used |= 1 << v
            for w in graph.succs(v) + graph.preds(v):
                used |= 1 << w
    if not fixes:  # impossible for a prime region; contract it whole rather than fail
        logger.warning("%s: no N found in a non-SP region of %d ops; contracting it whole", graph.name, len(region))
        return [tuple(region)]
    return [tuple(_bits(m)) for m in fixes]


def induced_subgraph(graph: OpGraph, op_ids: Sequence[int]) -> OpGraph:
    """The subgraph on ``op_ids`` (sorted ids keep the topological order)."""
    new_id = {v: i for i, v in enumerate(op_ids)}
    edges = tuple(Edge(new_id[e.src], new_id[e.dst], e.bytes, e.saved) for e in graph.edges
                  if e.src in new_id and e.dst in new_id)
    return OpGraph(graph.name, tuple(graph.ops[v] for v in op_ids), edges)


def make_series_parallel(graph: OpGraph) -> tuple[OpGraph, dict[str, tuple[str, ...]]]:
    """Return ``(sp_graph, merged)``: ``graph`` with small non-SP regions contracted.

    docs/design.md#series-parallel-decomposition: a DAG that is not SP is made SP by contracting the smallest
    non-SP regions into single ops. Greedy: while the decomposition meets
    prime regions (:func:`prime_regions`), find one induced N in each and
    contract the smallest convex set that merges two of its ops. Prime regions
    are modules (every other op relates to all of a region's ops alike), so
    fixes in different regions are independent and done in the same round.
    Each round removes at least one op, so this terminates; the result is SP
    because the loop only stops when no prime region is left. The final groups
    are convex in ``graph`` (a path leaving and re-entering a group would be a
    cycle in the contracted DAG) and are contracted in one step so that names
    are flat. ``merged`` maps each new op name to the original op names;
    ``{}`` (and ``graph`` itself) when already SP.

    >>> from graphpipe.graph import Op, OpGraph
    >>> n = OpGraph.build("n", [Op(x, "x") for x in "abcd"], [("a", "c", 1), ("a", "d", 1), ("b", "d", 1)])
    >>> g, merged = make_series_parallel(n)
    >>> merged, is_series_parallel(g)
    ({'merge(b+d)': ('b', 'd')}, True)
    """
    groups: dict[str, tuple[str, ...]] = {}  # merged op name -> original names
    rounds = 0
    work = [graph]
    while work:
        current = work.pop()
        for region in prime_regions(current):
            # A prime region is a module, so it is fixed on its own induced
            # subgraph: later rounds cost the region's size, not the graph's.
            sub = induced_subgraph(current, region)
            rounds += 1
            anc, desc = _ancestor_masks(sub), _descendant_masks(sub)
            fixes = _region_fixes(sub, range(sub.num_ops), anc, desc)
            try:
                contracted, mapping = contract(sub, fixes)
            except GraphCycleError:
                # the batched fixes jointly closed a cycle; one fix alone never does
                contracted, mapping = contract(sub, fixes[:1])
            for new, old in mapping.items():
                groups[new] = tuple(n for o in old for n in groups.pop(o, (o,)))
            work.append(contracted)
    if not groups:
        return graph, {}
    original_ids = [sorted(graph.op_id(n) for n in names) for names in groups.values()]
    original_ids.sort()
    sp_graph, merged = contract(graph, original_ids)
    logger.info("%s: %d rounds contracted %d non-SP region(s) of %s ops", graph.name, rounds,
                len(merged), [len(v) for v in merged.values()])
    return sp_graph, merged


# ------------------------------------------------------------------ the tree
def decompose(graph: OpGraph) -> SPTree:
    """The series-parallel tree of ``graph``, contracting non-SP regions first.

    >>> from graphpipe.graph import Op, OpGraph
    >>> chain = OpGraph.build("c", [Op(n, "x") for n in "abc"], [("a", "b", 1), ("b", "c", 1)])
    >>> t = decompose(chain)
    >>> t.nodes[t.root].kind, t.nodes[t.root].children
    ('series', (0, 1, 2))
    """
    if graph.num_ops == 0:
        raise InputError(f"graph {graph.name!r} has no ops; nothing to decompose")
    sp_graph, merged = make_series_parallel(graph)
    splits, primes = _split_all(sp_graph, stop_at_prime=True)
    if primes:  # cannot happen: contraction of prime regions leaves an SP order
        raise AssertionError(f"contracted graph {sp_graph.name!r} is still not series-parallel")
    # splits are in pre-order (parent before children, children left to right);
    # number them in post-order so children come before parents.
    by_ops = {s.op_ids: s for s in splits}
    nodes: list[SPNode] = []
    node_id: dict[tuple[int, ...], int] = {}
    stack: list[tuple[tuple[int, ...], bool]] = [(splits[0].op_ids, False)]
    while stack:
        op_ids, expanded = stack.pop()
        split = by_ops[op_ids]
        if expanded or split.kind == OP:
            children = tuple(node_id[p] for p in split.parts)
            nid = len(nodes)
            nodes.append(SPNode(nid, split.kind, children, op_ids))
            node_id[op_ids] = nid
            continue
        stack.append((op_ids, True))
        stack.extend((p, False) for p in reversed(split.parts))
    return SPTree(sp_graph, tuple(nodes), len(nodes) - 1, dict(merged))


def num_branches(graph_or_tree: OpGraph | SPTree) -> int:
    """Children of the widest parallel node (1 for a chain).

    An :class:`OpGraph` is decomposed first (non-SP regions contracted).
    """
    tree = graph_or_tree if isinstance(graph_or_tree, SPTree) else decompose(graph_or_tree)
    return max((len(n.children) for n in tree.nodes if n.kind == PARALLEL), default=1)
