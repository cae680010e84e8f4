"""PipeDream's hierarchical DP, as msr-fiddle/pipedream's optimizer computes it.

The kernel of ``--strategy pipedream`` (:mod:`graphpipe.search.pipedream`):
a re-implementation of ``optimizer/optimizer_graph_hierarchical.py`` and of
the antichain DAG of ``graph/graph.py`` in that repository (Narayanan et al.,
SOSP'19, §3.1, "Partitioning Algorithm"). Written from reading the code;
every formula below names the expression it mirrors.

States (``graph.py``: ``antichain_dag``, ``augment_antichain``,
``next_antichains``, ``topological_sort``)
    The DP does not cut a linearisation: it cuts between *antichains*. Starting
    from the source, an antichain is advanced one edge at a time; its
    *augmented* form adds every ancestor that still has an edge leaving the
    ancestor set. Each distinct antichain is a state; the states, ordered by
    the optimizer's DFS topological sort, index the DP. State ``j`` stands for
    every op up to and including its augmented antichain (a downset); a stage
    between states ``k`` and ``j`` (``k`` an ancestor of ``j`` in the
    antichain DAG) holds the ops of ``j`` not in ``k``. Per state the optimizer
    keeps cumulative sums: compute (fwd + bwd of a micro-batch, seconds),
    activation and parameter bytes, and the output bytes of its augmented
    antichain; a stage's values are differences of two states' sums
    (``compute_times[k + 1][j] = states[j] - states[k]``).

Per level of the cluster (``compute_partitioning``; ``m`` machines at this
level, ``B`` its bandwidth, ``w`` machines in one machine of the level below,
1 at the lowest):

* data parallel, no split: ``A[i][j][m] = (T(i..j) + 4 (m-1) P(i..j) / (B m) / w) / m``
  (in the code ``m`` is 0-based: ``(4 m P / (B (m+1))) / w``, then ``/ (m+1)``);
* a split after state ``k`` with ``m'`` machines for the last stage::

      A[i][j][m] = min over k, m' of max(A[i][k][m - m'],
                                         (T(k+1..j) + 4 (m'-1) P(k+1..j) / (B m')) / m',
                                         2 a_k / (B m'),  2 a_j / (B m'))

  where ``a_k`` is the output bytes of state ``k`` (the input the stage
  receives; divided by ``m'`` because its replicas receive different
  micro-batches, PipeDream's ``2 a_s / (B m')``), ``a_j`` its own output
  (not charged for the last state), and the all-reduce term is *not* divided
  by ``w`` here (the code's asymmetry, kept). The transfer terms are the
  optimizer's ``--activation_compression_ratio 1``.
* ``T`` of the level above is this level's ``A[i][j][last]``: one machine of
  the next level is a whole pipeline of this level.

For rows ``i > 0`` (stages that start after state ``i - 1``, needed by the
level above) the optimizer skips split points ``k`` that are ancestors of
``i - 1`` but not states unrelated to it, whose differences are then not a
set of ops; we keep that too, since the level above reads those values.

Each row is its own recursion (``A[i][j][m]`` reads row ``i`` only), so a
row is computed alone, over the pairs ``(j, k)`` with ``k`` an ancestor of
``j`` (the only splits allowed) rather than the whole ``(j, k)`` square,
with every ``m'`` of a machine count ``m`` in one array: on branchy graphs
most pairs of states are unrelated, and the square costs ``s^3`` per level.

What differs (each stated where the code does it):

* **Memory** is an extra constraint PipeDream's default run lacks (its
  ``--use_memory_constraint`` is off by default), in our cost model's terms:
  a replica holds the model state of its stage (weights, gradients,
  optimizer: ``Cluster.state_bytes``) plus the saved activations of the
  micro-batches in flight on it. Under our 1F1B(-RR) a replica of the stage
  at position ``i`` of ``K`` holds ``K - i`` of its micro-batches, at most
  one more than the devices after it: ``M - m + 1`` for a stage whose prefix
  uses ``m`` of the ``M`` devices (the optimizer's own rule counts
  ``ceil((M - m) / m')`` and stashes a weight copy per micro-batch, as
  asynchronous PipeDream does; our 1F1B flushes). It is checked at the
  lowest level, where a machine is a device; a node-level DP cannot know the
  nodes after it, so it assumes they all follow (an upper bound). The
  strategy then has the simulator check the plan (:mod:`~graphpipe.search.pipedream`).
* **Several sources**: the optimizer starts its antichains at the first
  source only (after dropping Input nodes), so a graph with several real
  sources would lose ops; we start from a virtual, free root above them.
* Ties between equal splits go to the smallest state index ``k``, then the
  fewest replicas ``m'`` (the optimizer's order is that of a Python set).
* Link latency is not in PipeDream's formulas and is not added.

Example
-------
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> ops = [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3), 4e6, 1e3, 1e3) for i in range(4)]
>>> g = OpGraph.build("chain", ops, [(f"l{i}", f"l{i+1}", 1e3) for i in range(3)])
>>> states = antichain_states(g)
>>> len(states.members), sorted(states.members[1])
(4, [0, 1])
>>> sol = solve_levels(states, g, micro_batch_size=8, levels=((2, 1e9),))
>>> [(ops, r) for ops, r, _ in sol.stages], round(sol.time_per_batch, 6)   # 2 ops x (8 + 16) ms
([((0, 1), 1), ((2, 3), 1)], 0.048)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from graphpipe.errors import InputError
from graphpipe.graph import OpGraph

__all__ = ["AntichainStates", "LevelSolution", "StateLimitError", "antichain_states", "prefix_states", "state_sums",
           "solve_levels", "REMOVED_KINDS", "MAX_STATES"]

REMOVED_KINDS = ("Input", "__getitem__")
"""Kinds the optimizer drops before its DP: Input sources (zeroed, kept in the first stage) and
``__getitem__`` sinks (tuple unpacking with no consumer; placed with their producer)."""


@dataclass(frozen=True, slots=True)
class AntichainStates:
    """The optimizer's DP states for one graph, in its topological order."""

    members: tuple[frozenset[int], ...]
    """Op ids up to and including each state's augmented antichain (a downset, without removed ops)."""
    outputs: tuple[tuple[int, ...], ...]
    """Each state's augmented antichain: the ops whose output bytes its cut carries."""
    ancestors: np.ndarray
    """``ancestors[j, k]``: state ``k`` precedes state ``j`` in the antichain DAG (transitively)."""
    inputs: tuple[int, ...]
    """Dropped Input sources: the first stage gets them."""
    dropped_sinks: tuple[int, ...]
    """Dropped ``__getitem__`` sinks: each goes to the stage of its last producer."""


def _bits(x: int):
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


MAX_STATES = 4000
"""Stop enumerating antichain states past this many: the DP is cubic in them (inception_v3 has about
221,000 and the zoo's mmt about 6,600, which the real optimizer cannot handle either)."""


class StateLimitError(InputError):
    """More antichain states than the limit (:data:`MAX_STATES`)."""


def _removed(graph: OpGraph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Input sources, ``__getitem__`` sinks once the inputs are gone): what ``main`` drops before its DP."""
    n = graph.num_ops
    inputs = tuple(v for v in range(n) if graph.ops[v].kind == "Input" and not graph.preds(v))
    gone = set(inputs)
    dropped = tuple(v for v in range(n) if v not in gone and graph.ops[v].kind == "__getitem__"
                    and not [w for w in graph.succs(v) if w not in gone])
    return inputs, dropped


def prefix_states(graph: OpGraph) -> AntichainStates:
    """States = the prefixes of the op-id linearisation: the antichain DAG of the graph's chain version.

    What :mod:`graphpipe.search.pipedream` falls back to past :data:`MAX_STATES` antichain states: the
    DP is unchanged, cuts are restricted to the linear order, and a prefix's output is every op in it
    with a consumer outside it (the augmented antichain of the prefix).

    >>> from graphpipe.graph import Op, OpGraph
    >>> g = OpGraph.build("d", [Op(n, "x") for n in "sabt"], [("s", "a", 1), ("s", "b", 1), ("a", "t", 1), ("b", "t", 1)])
    >>> prefix_states(g).outputs
    ((0,), (0, 1), (1, 2), (3,))
    """
    inputs, dropped = _removed(graph)
    gone = set(inputs) | set(dropped)
    order = [v for v in range(graph.num_ops) if v not in gone]
    members, outputs = [], []
    for j in range(len(order)):
        prefix = frozenset(order[:j + 1])
        members.append(prefix)
        outputs.append(tuple(v for v in order[:j + 1] if any(w not in prefix and w not in gone
                                                              for w in graph.succs(v))) or (order[j],))
    s = len(order)
    ancestors = np.tril(np.ones((s, s), dtype=bool), k=-1)
    return AntichainStates(tuple(members), tuple(outputs), ancestors, inputs, dropped)


def antichain_states(graph: OpGraph, max_states: int = MAX_STATES) -> AntichainStates:
    """The antichain DAG's states in the optimizer's order (module docstring; ``graph.py``).

    Raises :class:`StateLimitError` past ``max_states`` states.
    """
    inputs, dropped = _removed(graph)
    reach = _Reach.of(graph, set(inputs) | set(dropped))
    antichain_of, edges, inserted = _antichain_dag(reach, graph.name, max_states)
    order = _topological_order(edges, inserted)
    ancestors = _ancestor_matrix(order, edges)
    members, outputs = [], []
    for x in order:
        aug = reach.augment(antichain_of[x])
        mask = 0
        for v in aug:
            mask |= reach.anc[reach.local[v]] | (1 << reach.local[v])
        members.append(frozenset(reach.keep[i] for i in _bits(mask) if reach.keep[i] != -1))
        outputs.append(tuple(v for v in aug if v != -1))
    return AntichainStates(tuple(members), tuple(outputs), ancestors, inputs, dropped)


@dataclass(frozen=True, slots=True)
class _Reach:
    """The graph the optimizer's ``graph.py`` walks: inputs and dropped ops removed, a virtual root (-1) above
    several sources, and each node's strict ancestors and descendants as bitsets over local indices."""

    keep: list[int]
    """Ops kept, topological, root first; ``local`` maps an op to its index here."""
    local: dict[int, int]
    succs: dict[int, list[int]]
    anc: list[int]
    desc: list[int]
    root: int

    @classmethod
    def of(cls, graph: OpGraph, removed: set[int]) -> "_Reach":
        keep = [v for v in range(graph.num_ops) if v not in removed]
        succs = {v: [w for w in graph.succs(v) if w not in removed] for v in keep}
        preds = {v: [u for u in graph.preds(v) if u not in removed] for v in keep}
        sources = [v for v in keep if not preds[v]]
        root = -1
        if len(sources) > 1:  # virtual root above several sources (module docstring)
            succs[root], preds[root] = list(sources), []
            for v in sources:
                preds[v] = [root]
            keep = [root] + keep
        else:
            root = sources[0]
        local = {v: i for i, v in enumerate(keep)}
        anc = [0] * len(keep)
        for v in keep:  # keep is topological (op ids are), root first
            for u in preds[v]:
                anc[local[v]] |= anc[local[u]] | (1 << local[u])
        desc = [0] * len(keep)
        for v in reversed(keep):
            for w in succs[v]:
                desc[local[v]] |= desc[local[w]] | (1 << local[w])
        return cls(keep, local, succs, anc, desc, root)

    def augment(self, antichain: tuple[int, ...]) -> tuple[int, ...]:
        """``augment_antichain``: ancestors of a node that still feed something outside its ancestor set."""
        extra = set()
        for a in antichain:
            mask = self.anc[self.local[a]]
            for p in _bits(mask):
                if any(not (mask >> self.local[o]) & 1 and o != a for o in self.succs[self.keep[p]]):
                    extra.add(self.keep[p])
        return tuple(sorted(extra)) + tuple(antichain)

    def deaugment(self, nodes: list[int]) -> tuple[int, ...]:
        """``deaugment_augmented_antichain``: drop nodes with a descendant in the list, then duplicates."""
        mask = 0
        for v in nodes:
            mask |= 1 << self.local[v]
        out: list[int] = []
        for v in nodes:
            if not self.desc[self.local[v]] & mask and v not in out:
                out.append(v)
        return tuple(out)

    def next_antichains(self, antichain: tuple[int, ...]) -> list[tuple[int, ...]]:
        """``next_antichains``: replace one node of the augmented antichain by a successor (``is_next_antichain``)."""
        aug = self.augment(antichain)
        aug_mask = 0
        for v in aug:
            aug_mask |= 1 << self.local[v]
        out = []
        for u in aug:
            for v in self.succs[u]:
                if v in antichain or self.desc[self.local[v]] & aug_mask:
                    continue
                out.append(self.deaugment([v if x == u else x for x in aug]))
        return out


def _antichain_dag(reach: _Reach, name: str, max_states: int
                   ) -> tuple[list[tuple[int, ...]], list[list[int]], list[int]]:
    """``antichain_dag``: breadth-first from the source; node order = first appearance in an edge.

    ``(antichain of each node, edges out of each node, nodes in insertion order)``.
    """
    start = (reach.root,)
    node_of: dict[frozenset, int] = {frozenset(start): 0}
    antichain_of: list[tuple[int, ...]] = [start]
    edges: list[list[int]] = [[]]
    inserted: list[int] = []
    inserted_seen: set[int] = set()
    expanded: set[frozenset] = set()
    queue = [start]
    head = 0
    while head < len(queue):
        antichain = queue[head]
        head += 1
        key = frozenset(antichain)
        if key in expanded:
            continue
        expanded.add(key)
        for nxt in reach.next_antichains(antichain):
            nkey = frozenset(nxt)
            if nkey not in node_of:
                if len(antichain_of) >= max_states:
                    raise StateLimitError(f"pipedream: {name!r} has more than {max_states} antichain states (the "
                                          f"optimizer's DP is cubic in them); use --strategy gpp or piper for this "
                                          f"graph")
                node_of[nkey] = len(antichain_of)
                antichain_of.append(nxt)
                edges.append([])
            a, b = node_of[key], node_of[nkey]
            for x in (a, b):
                if x not in inserted_seen:
                    inserted_seen.add(x)
                    inserted.append(x)
            edges[a].append(b)
            queue.append(nxt)
    return antichain_of, edges, inserted or [0]


def _topological_order(edges: list[list[int]], inserted: list[int]) -> list[int]:
    """``topological_sort``: DFS from each node in insertion order, children in edge order; reversed post-order."""
    order: list[int] = []
    marked: set[int] = set()
    for s in inserted:
        if s in marked:
            continue
        stack = [(s, 0)]
        while stack:
            x, i = stack.pop()
            if i < len(edges[x]):
                stack.append((x, i + 1))
                y = edges[x][i]
                if y not in marked:  # the stack is the DFS path; a DAG never meets it again
                    stack.append((y, 0))
                continue
            if x not in marked:
                marked.add(x)
                order.append(x)
    order.reverse()
    return order


def _ancestor_matrix(order: list[int], edges: list[list[int]]) -> np.ndarray:
    """``ancestors[j, k]``: state ``k`` (a position in ``order``) precedes state ``j`` in the antichain DAG."""
    position = {x: i for i, x in enumerate(order)}
    num_states = len(order)
    ancestors = np.zeros((num_states, num_states), dtype=bool)
    direct = [[] for _ in range(num_states)]
    for a in range(len(edges)):
        for b in edges[a]:
            direct[position[b]].append(position[a])
    for j in range(num_states):
        for k in direct[j]:
            ancestors[j] |= ancestors[k]
            ancestors[j, k] = True
    return ancestors


@dataclass(frozen=True, slots=True)
class StateSums:
    """Cumulative per-state sums for one micro-batch of ``b`` samples (``main``'s ``states[i].*``)."""

    compute: np.ndarray
    """Seconds of forward + backward of every op in the state."""
    activation: np.ndarray
    """Saved-activation bytes of the state's ops for one micro-batch."""
    params: np.ndarray
    """Parameter bytes of the state's ops."""
    output: np.ndarray
    """Output bytes of the state's augmented antichain for one micro-batch (what a cut after it carries)."""


def state_sums(states: AntichainStates, graph: OpGraph, micro_batch_size: int) -> StateSums:
    """Per-state sums at micro-batch ``b``: the profile's per-batch figures when ``b`` is its batch."""
    b = micro_batch_size
    compute = np.array([op.fwd(b) + op.bwd(b) for op in graph.ops], dtype=float)
    act = np.array([op.act_bytes * b for op in graph.ops], dtype=float)
    params = np.array([float(op.param_bytes) for op in graph.ops], dtype=float)
    out = np.array([op.out_bytes * b for op in graph.ops], dtype=float)

    def total(values: np.ndarray, sets) -> np.ndarray:
        return np.array([float(values[sorted(s)].sum()) if s else 0.0 for s in sets])

    return StateSums(total(compute, states.members), total(act, states.members), total(params, states.members),
                     total(out, states.outputs))


def _ranges(per_state: np.ndarray) -> np.ndarray:
    """``table[i, j]`` = value of the stage after state ``i - 1`` up to state ``j`` (row 0: from the start);
    NaN where ``j < i`` (``main``'s ``compute_times``, ``activation_sizes``, ``parameter_sizes``)."""
    s = len(per_state)
    table = np.full((s + 1, s), np.nan)
    table[0] = per_state
    rows = np.arange(1, s + 1)[:, None]
    cols = np.arange(s)[None, :]
    diff = per_state[None, :] - per_state[:, None]     # diff[i-1, j] = state j - state i-1
    table[1:] = np.where(cols >= rows, diff, np.nan)
    return table


def _received_saved(states: AntichainStates, graph: OpGraph, micro_batch_size: int) -> np.ndarray:
    """``table[i, j]`` (as :func:`_ranges`): :func:`graphpipe.costs.received_saved_bytes` of the stage after
    state ``i - 1`` up to state ``j``, for one micro-batch (not in the real optimizer, whose profiles have
    no saved edges; 0 on them)."""
    s = len(states.members)
    table = np.zeros((s + 1, s))
    for e in graph.saved_edges:
        has_src = np.array([e.src in m for m in states.members], dtype=float)
        has_dst = np.array([e.dst in m for m in states.members], dtype=float)
        # rows 1..s: source inside state i-1, destination inside state j but not state i-1
        table[1:] += e.saved * micro_batch_size * (has_src * (1.0 - has_dst))[:, None] * has_dst[None, :]
    return table


@dataclass(frozen=True, slots=True)
class _Level:
    """``compute_partitioning``'s table ``A[i][j][m]`` as arrays (m 0-based: m + 1 machines)."""

    time: np.ndarray
    """Seconds per micro-batch; NaN = no configuration."""
    split: np.ndarray
    """State ``k`` after which the last stage starts; -1 = no split (one data-parallel stage)."""
    rest: np.ndarray
    """0-based machine index of ``A[i][k][.]`` for the stages before the split."""
    replicas: np.ndarray
    """Machines of the last stage."""


def _in_flight(machines: int, used, replicas, num_mbs: int, outside: int):
    """Micro-batches in flight on one replica (module docstring, "Memory"): one more than the devices
    after the stage (``outside`` of them beyond this level), at most the iteration's share of a replica."""
    return np.minimum(machines - used + 1 + outside, np.ceil(num_mbs / replicas))


def _level(compute: np.ndarray, act: np.ndarray, params: np.ndarray, output: np.ndarray, ancestors: np.ndarray,
           num_machines: int, within: int, bandwidth: float, final: bool, memory: float,
           state_per_byte: float, num_mbs: int, outside: int) -> _Level:
    """One ``compute_partitioning`` call (module docstring), vectorised over split points and replica counts."""
    rows, s = compute.shape
    M, bw = num_machines, bandwidth
    m1 = np.arange(1, M + 1, dtype=float)                                   # machines, m + 1
    with np.errstate(invalid="ignore"):
        # No split: (T + 4 m P / (B (m+1)) / w) / (m+1); memory: ceil((M - (m+1)) / (m+1)) stashed copies.
        dp = (compute[:, :, None] + 4 * (m1 - 1) * params[:, :, None] / (bw * m1) / within) / m1
        held = _in_flight(M, m1, m1, num_mbs, outside) * act[:, :, None] + state_per_byte * params[:, :, None]
        dp = np.where(held > memory, np.nan, dp)
    time = dp
    split = np.full(time.shape, -1, dtype=np.int64)
    rest = np.full(time.shape, -1, dtype=np.int64)
    replicas = np.broadcast_to(np.arange(1, M + 1), time.shape).copy()
    # Stage k+1..j (rows k + 1 of the tables), stored in axis order (j, k, m') so that a candidate array
    # flattens to (j, k * m') -- k first, then m', the optimizer's order -- without a copy.
    last_c, last_p, last_a = compute[1:].T, params[1:].T, act[1:].T                        # (j, k)
    state = state_per_byte * last_p
    mp_all = np.arange(1, M)                                                                 # m' = 1..M-1
    in_t = 2.0 * output[:, None] / (bw * m1[None, :])                         # (k, m'): 2 a_k / (B m')
    out_t = np.where(np.arange(s)[:, None] < s - 1, 2.0 * output[:, None] / (bw * m1[None, :]), 0.0)  # (j, m')
    # The last stage's time and its transfers in and out do not depend on m: computed once for every m'.
    with np.errstate(invalid="ignore"):
        last = (last_c[:, :, None] + 4 * (mp_all - 1) * last_p[:, :, None] / (bw * mp_all)) / mp_all  # (j, k, m')
        last = np.maximum(np.maximum(last, in_t[None, :, :M - 1]), out_t[:, None, :M - 1])
    # Rows are independent: A[i][j][m] reads only A[i][k][m - m'] (m' >= 1) of its own row. Each row is
    # swept over the (j, k) pairs it may split at (k an ancestor of j), not the dense (j, k) square.
    pj, pk = np.nonzero(ancestors)                                             # sorted by j, then k
    pairs = _Pairs(pj, pk, last[pj, pk, :], last_a[pj, pk][:, None], state[pj, pk][:, None])
    for i in ([0] if final else range(min(rows, s - 1))):  # the top level reads row 0 only
        _row(i, pairs, time, split, rest, replicas, M, num_mbs, outside, memory)
    return _Level(time, split, rest, replicas)


@dataclass(frozen=True, slots=True)
class _Pairs:
    """The split pairs ``(j, k)``, state ``k`` an ancestor of state ``j``, sorted by ``j`` then ``k``, with the
    last stage's (``k + 1 .. j``) time per ``m'``, activation bytes and model-state bytes."""

    j: np.ndarray
    k: np.ndarray
    last: np.ndarray
    """(pairs, m')"""
    act: np.ndarray
    """(pairs, 1)"""
    state: np.ndarray
    """(pairs, 1)"""


def _row(i: int, pairs: _Pairs, time: np.ndarray, split: np.ndarray, rest: np.ndarray, replicas: np.ndarray,
         M: int, num_mbs: int, outside: int, memory: float) -> None:
    """Row ``i`` of :func:`_level`'s tables in place: ``A[i][j][m]`` for every ``j > i`` and ``m``.

    The last stage runs from state ``k + 1`` to ``j``, after ``A[i][k][m - m']``: ``k`` is an ancestor of
    ``j`` at or after ``i`` (``A[i][k]`` is empty before ``i``). States are numbered in a topological
    order, so an ancestor has the smaller index: ``k >= i`` alone gives ``j > i`` and leaves out the
    ancestors of state ``i - 1`` (the optimizer's rule past row 0). The candidates of one ``j`` are its
    pairs in ``k`` order, each with ``m' = 1..m``; the first minimum of that run is the optimizer's choice
    (its loops go k, then m', and replace only on a strictly smaller time).
    """
    keep = np.flatnonzero(pairs.k >= i)
    if len(keep) == 0:
        return
    pj, pk = pairs.j[keep], pairs.k[keep]
    starts = np.flatnonzero(np.concatenate(([True], pj[1:] != pj[:-1])))
    js = pj[starts]
    lengths = np.diff(np.append(starts, len(pj)))
    last_p, act_p, state_p = pairs.last[keep], pairs.act[keep], pairs.state[keep]
    row = time[i]
    for m in range(1, M):
        mp = np.arange(1, m + 1)
        with np.errstate(invalid="ignore"):
            held = _in_flight(M, m + 1, mp, num_mbs, outside) * act_p + state_p
            cand = np.maximum(row[pk[:, None], m - mp], last_p[:, :m])          # (pairs, m'): A[i][k][m-m']
        ok = held <= memory
        ok &= ~np.isnan(cand)
        flat = np.where(ok, cand, np.inf).reshape(-1)                           # runs of lengths * m per j
        value = np.minimum.reduceat(flat, starts * m)
        hit = np.flatnonzero(flat == np.repeat(value, lengths * m))
        first = hit[np.searchsorted(hit, starts * m)] if len(hit) else hit
        current = row[js, m]
        better = np.isfinite(value) & (np.isnan(current) | (current > value))
        if not better.any():
            continue
        pos = first[better]
        pair, mp_index = np.divmod(pos, m)
        jb = js[better]
        row[jb, m] = value[better]
        split[i, jb, m] = pk[pair]
        rest[i, jb, m] = m - (mp_index + 1)
        replicas[i, jb, m] = mp_index + 1


@dataclass(frozen=True, slots=True)
class LevelSolution:
    """The optimizer's answer: stages in pipeline order and its "time per stage in pipeline"."""

    stages: tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...]
    """``(op ids, replica count, devices)`` per stage, pipeline order; devices follow the levels."""
    time_per_batch: float
    """``A[0][S-1][M-1]`` of the top level: seconds per micro-batch per stage (the DP's objective)."""
    level_stages: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per level, top first: the ``(first state row, end state, machines)`` ranges analyze_partitioning prints."""


def solve_levels(states: AntichainStates, graph: OpGraph, micro_batch_size: int,
                 levels: Sequence[tuple[int, float]], memory_bytes: float = math.inf,
                 state_per_byte: float = 0.0, num_micro_batches: int | None = None) -> LevelSolution | None:
    """Run the hierarchical DP (``main``: one ``compute_partitioning`` per level, lowest first).

    ``levels``: ``(machines, bandwidth bytes/s)`` per level, lowest first (``-n 4 2 -b 12.5e9 1.25e9``
    is ``((4, 12.5e9), (2, 1.25e9))``). ``memory_bytes`` / ``state_per_byte`` / ``num_micro_batches``
    (per iteration; None: unbounded): the memory constraint (module docstring). None when nothing fits.
    """
    sums = state_sums(states, graph, micro_batch_size)
    compute = _ranges(sums.compute)
    act, params = _ranges(sums.activation) + _received_saved(states, graph, micro_batch_size), _ranges(sums.params)
    tables: list[_Level] = []
    within = 1
    total = math.prod(machines for machines, _ in levels)
    for index, (machines, bandwidth) in enumerate(levels):
        # Memory is checked where a machine is a device (module docstring); above, every range fits.
        memory = memory_bytes if index == 0 else math.inf
        table = _level(compute, act, params, sums.output, states.ancestors, machines, within, bandwidth,
                       index == len(levels) - 1, memory, state_per_byte,
                       num_micro_batches if num_micro_batches is not None else 1 << 40, total - machines)
        tables.append(table)
        compute = table.time[:, :, -1]
        within = machines
    s = len(states.members)
    top = float(tables[-1].time[0, s - 1, -1])
    if not math.isfinite(top):
        return None

    def analyze(table: _Level, start: int, end: int, machines: int) -> list[tuple[int, int, int]]:
        # analyze_partitioning: follow the splits back from A[start][end - 1][machines - 1].
        out, j, m, stop = [], end - 1, machines - 1, end
        while True:
            k = int(table.split[start, j, m])
            if k < 0:
                out.append((start, stop, int(table.replicas[start, j, m])))
                return out[::-1]
            out.append((k + 1, stop, int(table.replicas[start, j, m])))
            j, m, stop = k, int(table.rest[start, j, m]), k + 1

    unit = [1]
    for machines, _ in levels[:-1]:
        unit.append(unit[-1] * machines)
    placed: list[tuple[int, int, tuple[int, ...]]] = []
    per_level: list[list[tuple[int, int, int]]] = [[] for _ in levels]

    # The splits, expanded depth first from the top level (an explicit stack: a recursive closure would
    # be a reference cycle holding the tables until the garbage collector runs).
    pending: list[tuple[int, int, int, list[int]]] = [(len(levels) - 1, 0, s, [0])]
    while pending:
        level, start, end, bases = pending.pop()
        offset, below = 0, []
        for a, b, r in analyze(tables[level], start, end, levels[level][0]):
            per_level[len(levels) - 1 - level].append((a, b, r))
            sub = [base + (offset + t) * unit[level] for base in bases for t in range(r)]
            offset += r
            if level == 0:
                placed.append((a, b, tuple(sorted(sub))))
            else:
                below.append((level - 1, a, b, sub))
        pending.extend(reversed(below))
    stage_of = {}
    stages: list[tuple[list[int], tuple[int, ...]]] = []
    for q, (a, b, devices) in enumerate(placed):
        ops = set(states.members[b - 1]) - (set(states.members[a - 1]) if a > 0 else set())
        stages.append((sorted(ops), devices))
        for v in ops:
            stage_of[v] = q
    for v in states.inputs:          # main(): the Input sources go to stage 0
        stages[0][0].append(v)
        stage_of[v] = 0
    for v in states.dropped_sinks:   # with their last producer
        q = max((stage_of[u] for u in graph.preds(v) if u in stage_of), default=len(stages) - 1)
        stages[q][0].append(v)
        stage_of[v] = q
    return LevelSolution(tuple((tuple(sorted(ops)), len(devices), devices) for ops, devices in stages), top,
                         tuple(tuple(x) for x in per_level))
