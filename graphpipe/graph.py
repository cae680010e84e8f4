"""The OpGraph IR: a frozen DAG of layer-granularity ops with a cost model.

Every op carries an affine time model ``t(b) = alpha + beta * b`` seconds for
forward and backward at micro-batch size ``b`` (fixed kernel overhead plus
per-sample work, docs/design.md#the-cost-model), its parameter bytes, and per-sample byte counts
for saved activations and output. Edges carry bytes per sample.

Example
-------
>>> g = OpGraph.build("toy", [Op("a", "linear", Affine(0.0, 1e-3), Affine(0.0, 2e-3)),
...                           Op("b", "linear", Affine(0.0, 1e-3), Affine(0.0, 2e-3))],
...                   [("a", "b", 16.0)])
>>> g.num_ops, g.op_id("b"), g.succs(0)
(2, 1, (1,))
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from graphpipe.errors import FormatError, GraphCycleError, InputError
from graphpipe.files import read_json_file, write_json_atomic  # re-exported: graph readers and writers

__all__ = [
    "Affine",
    "Op",
    "Edge",
    "OpGraph",
    "SharedParams",
    "GRAPH_FORMAT",
    "graph_to_dict",
    "graph_from_dict",
    "affine_field",
    "read_graph_json",
    "read_json_file",
    "write_json_atomic",
]

GRAPH_FORMAT = "graphpipe.graph/1"
MAX_OPS = 20_000
"""Most ops a graph document may have: searches over larger graphs do not finish in hours."""


@dataclass(frozen=True, slots=True)
class Affine:
    """``t(b) = alpha + beta * b`` seconds; alpha is per call, beta per sample."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        for value in (self.alpha, self.beta):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InputError(f"time coefficients must be finite and >= 0, got {self.alpha}, {self.beta}")

    def __call__(self, b: float) -> float:
        return self.alpha + self.beta * b

    def __add__(self, other: "Affine") -> "Affine":
        return Affine(self.alpha + other.alpha, self.beta + other.beta)

    def scaled(self, factor: float) -> "Affine":
        return Affine(self.alpha * factor, self.beta * factor)


ZERO = Affine(0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Op:
    """One layer-granularity operator.

    name: unique within the graph.
    kind: free-form layer kind ("transformer", "linear", "embedding", ...).
    fwd, bwd: time models in seconds for one call at micro-batch size b.
    param_bytes: bytes of this op's parameters (as stored, fp32 = 4 per param).
    act_bytes: saved-activation bytes per sample kept from F until its B.
    out_bytes: output bytes per sample.
    wgrad: the weight-gradient part (zero bubble's W) of ``bwd``, when a
    profile measured it (``graphpipe profile``); None otherwise, and
    :func:`graphpipe.costs.weight_grad_time` takes a fixed share of ``bwd``.
    batchnorm: the op holds a BatchNorm that updates running statistics
    (the capture sees it, inside a block too). The runtime merges those
    statistics over whole-copy replicas only, so a graph with one plans
    whole-copy stages (:func:`graphpipe.search.planner.make_plan`).
    dropout: the op draws a dropout with p > 0 (a module or a function,
    inside a block too). A sequence-parallel TP stage draws such masks over
    the whole tokens, as one process does, and keeps them whole
    (:func:`graphpipe.costs.tp_saved_bytes`).
    """

    name: str
    kind: str
    fwd: Affine = ZERO
    bwd: Affine = ZERO
    param_bytes: float = 0
    act_bytes: float = 0
    out_bytes: float = 0
    wgrad: Affine | None = None
    batchnorm: bool = False
    dropout: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InputError(f"op name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.batchnorm, bool):
            raise InputError(f"op {self.name!r}: batchnorm must be true or false, got {self.batchnorm!r}")
        if not isinstance(self.dropout, bool):
            raise InputError(f"op {self.name!r}: dropout must be true or false, got {self.dropout!r}")
        if self.wgrad is not None and not isinstance(self.wgrad, Affine):
            raise InputError(f"op {self.name!r}: wgrad must be an Affine time model or None, got {self.wgrad!r}")
        for key in ("param_bytes", "act_bytes", "out_bytes"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InputError(f"op {self.name!r}: {key} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Edge:
    """Data flowing from op ``src`` to op ``dst`` (ids), ``bytes`` per sample.

    ``saved``: bytes per sample of that data which ``dst`` saves for backward
    while another op's ``act_bytes`` already holds the same tensor (the
    producer saved it too, e.g. a ReLU output that the next Linear saves as
    its input; or an earlier consumer did). On one device the tensor is kept
    once; a stage that holds ``dst`` but not ``src`` keeps its own received
    copy, so :func:`graphpipe.costs.received_saved_bytes` charges ``saved``
    to it when the edge is cut. 0 when unknown (graphs written without it,
    PipeDream profiles).
    """

    src: int
    dst: int
    bytes: float = 0
    saved: float = 0

    def __post_init__(self) -> None:
        for key in ("bytes", "saved"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"edge {self.src}->{self.dst}: {key} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class SharedParams:
    """Parameters several ops read (tied weights: a GPT's embedding and output head).

    ``ops``: the op names, in graph order; ``bytes``: the shared parameters'
    size, counted in the first op's ``param_bytes`` only. Ops in different
    stages each hold a copy, and the copies' gradients are summed every
    iteration (the runtime's tied-parameter all-reduce).
    """

    ops: tuple[str, ...]
    bytes: float

    def __post_init__(self) -> None:
        if len(self.ops) < 2 or len(set(self.ops)) != len(self.ops):
            raise InputError(f"shared parameters need two or more distinct ops, got {list(self.ops)!r}")
        if not (math.isfinite(self.bytes) and self.bytes >= 0):
            raise InputError(f"shared parameters of {list(self.ops)!r}: bytes must be finite and >= 0, got {self.bytes!r}")


@dataclass(frozen=True, slots=True)
class OpGraph:
    """A frozen DAG of ops whose ids are a topological order.

    Build one with :meth:`OpGraph.build` (names, any order); the constructor
    itself requires ``src < dst`` on every edge and checks the invariants.
    """

    name: str
    ops: tuple[Op, ...]
    edges: tuple[Edge, ...]
    shared: tuple[SharedParams, ...] = ()
    """Tied parameters (capture finds them); graphs rebuilt by contraction (:mod:`graphpipe.sp`) drop them."""
    lengths: tuple[int, ...] = ()
    """The example's size of every input dim that may vary per step (a sequence length), when the graph was
    captured from a module: its costs are per sample at these lengths (``graphpipe plan --max-shape``)."""
    _succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)
    _edge_bytes: Mapping[tuple[int, int], float] = field(init=False, repr=False, compare=False)
    _saved_edges: tuple[Edge, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        for op_id, op in enumerate(self.ops):
            if op.name in index:
                raise InputError(f"duplicate op name {op.name!r} (ops {index[op.name]} and {op_id})")
            index[op.name] = op_id
        n = len(self.ops)
        succs: list[list[int]] = [[] for _ in range(n)]
        preds: list[list[int]] = [[] for _ in range(n)]
        edge_bytes: dict[tuple[int, int], float] = {}
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise InputError(f"edge {e.src}->{e.dst} refers to a missing op (graph has {n})")
            if e.src >= e.dst:
                raise InputError(f"edge {self.ops[e.src].name}->{self.ops[e.dst].name} is not in topological order; use OpGraph.build")
            if (e.src, e.dst) in edge_bytes:
                raise InputError(f"duplicate edge {self.ops[e.src].name}->{self.ops[e.dst].name}")
            edge_bytes[(e.src, e.dst)] = e.bytes
            succs[e.src].append(e.dst)
            preds[e.dst].append(e.src)
        object.__setattr__(self, "_succs", tuple(tuple(sorted(s)) for s in succs))
        object.__setattr__(self, "_preds", tuple(tuple(sorted(p)) for p in preds))
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_edge_bytes", edge_bytes)
        object.__setattr__(self, "_saved_edges", tuple(e for e in self.edges if e.saved))
        for group in self.shared:
            unknown = [name for name in group.ops if name not in index]
            if unknown:
                raise InputError(f"shared parameters name op(s) the graph lacks: {', '.join(unknown)}")

    # ----------------------------------------------------------------- build
    @classmethod
    def build(cls, name: str, ops: Sequence[Op], edges: Iterable[tuple[str, str, float] | tuple[str, str, float, float]],
              shared: Sequence[SharedParams] = (), lengths: Sequence[int] = ()) -> "OpGraph":
        """Build from ops in any order and ``(src_name, dst_name, bytes[, saved])`` edges (:class:`Edge`).

        Ops are renumbered in a deterministic topological order (Kahn's
        algorithm, ties broken by input position). A cycle raises
        :class:`GraphCycleError` naming the ops on it.
        """
        position: dict[str, int] = {}
        for i, op in enumerate(ops):
            if op.name in position:
                raise InputError(f"duplicate op name {op.name!r}")
            position[op.name] = i
        raw: list[tuple[int, int, float, float]] = []
        seen: set[tuple[int, int]] = set()
        for src, dst, nbytes, *saved in edges:
            for end in (src, dst):
                if end not in position:
                    raise InputError(f"edge {src}->{dst} names unknown op {end!r}")
            key = (position[src], position[dst])
            if key[0] == key[1]:
                raise GraphCycleError([src])
            if key in seen:
                raise InputError(f"duplicate edge {src}->{dst}")
            seen.add(key)
            raw.append((key[0], key[1], float(nbytes), float(saved[0]) if saved else 0.0))
        n = len(ops)
        succs: list[list[int]] = [[] for _ in range(n)]
        indeg = [0] * n
        for s, d, _, _ in raw:
            succs[s].append(d)
            indeg[d] += 1
        ready = [i for i in range(n) if indeg[i] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for j in succs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) < n:
            raise GraphCycleError([ops[i].name for i in _find_cycle(succs, {i for i in range(n) if indeg[i] > 0})])
        new_id = {old: new for new, old in enumerate(order)}
        new_ops = tuple(ops[old] for old in order)
        new_edges = tuple(sorted((Edge(new_id[s], new_id[d], b, v) for s, d, b, v in raw), key=lambda e: (e.src, e.dst)))
        return cls(name, new_ops, new_edges, tuple(shared), tuple(int(n) for n in lengths))

    # ---------------------------------------------------------------- access
    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    def op_id(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise InputError(f"graph {self.name!r} has no op named {name!r}") from None

    def succs(self, op_id: int) -> tuple[int, ...]:
        return self._succs[op_id]

    def preds(self, op_id: int) -> tuple[int, ...]:
        return self._preds[op_id]

    def edge_bytes(self, src: int, dst: int) -> float:
        """Bytes per sample on edge src->dst."""
        return self._edge_bytes[(src, dst)]

    @property
    def saved_edges(self) -> tuple[Edge, ...]:
        """The edges with :attr:`Edge.saved` > 0 (few: scanning them is cheap in every cost lookup)."""
        return self._saved_edges

    def has_edge(self, src: int, dst: int) -> bool:
        return (src, dst) in self._edge_bytes

    def sources(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_ops) if not self._preds[i])

    def sinks(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_ops) if not self._succs[i])

    @property
    def param_bytes(self) -> float:
        return sum(op.param_bytes for op in self.ops)

    def fwd_time(self, op_ids: Iterable[int], b: float) -> float:
        """Forward seconds of running ``op_ids`` once at micro-batch size ``b``."""
        return sum(self.ops[i].fwd(b) for i in op_ids)

    def bwd_time(self, op_ids: Iterable[int], b: float) -> float:
        return sum(self.ops[i].bwd(b) for i in op_ids)

    def to_networkx(self):
        """A ``networkx.DiGraph`` with op ids as nodes; node attr ``op``, edge attr ``bytes``."""
        import networkx as nx

        g = nx.DiGraph(name=self.name)
        for op_id, op in enumerate(self.ops):
            g.add_node(op_id, op=op, name=op.name)
        for e in self.edges:
            g.add_edge(e.src, e.dst, bytes=e.bytes)
        return g

    def with_ops(self, ops: Sequence[Op]) -> "OpGraph":
        """Same structure, new op annotations (same names, same order)."""
        if [o.name for o in ops] != [o.name for o in self.ops]:
            raise InputError("with_ops needs the same op names in the same order")
        return OpGraph(self.name, tuple(ops), self.edges, self.shared)


def _find_cycle(succs: list[list[int]], remaining: set[int]) -> list[int]:
    """A cycle among ``remaining`` nodes (all of which lie on or after one)."""
    start = min(remaining)
    seen_at: dict[int, int] = {}
    path: list[int] = []
    node = start
    while node not in seen_at:
        seen_at[node] = len(path)
        path.append(node)
        node = next(j for j in succs[node] if j in remaining)
    return path[seen_at[node]:]


# ------------------------------------------------------------------- JSON I/O
def graph_to_dict(graph: OpGraph) -> dict[str, Any]:
    """The ``graphpipe.graph/1`` document of ``graph``."""
    return {
        "format": GRAPH_FORMAT,
        "name": graph.name,
        "ops": [
            {
                "name": op.name,
                "kind": op.kind,
                "fwd_s": [op.fwd.alpha, op.fwd.beta],
                "bwd_s": [op.bwd.alpha, op.bwd.beta],
                "param_bytes": op.param_bytes,
                "act_bytes": op.act_bytes,
                "out_bytes": op.out_bytes,
                **({"wgrad_s": [op.wgrad.alpha, op.wgrad.beta]} if op.wgrad is not None else {}),  # only when measured
                **({"batchnorm": True} if op.batchnorm else {}),  # only when it holds one
                **({"dropout": True} if op.dropout else {}),
            }
            for op in graph.ops
        ],
        "edges": [
            {"src": graph.ops[e.src].name, "dst": graph.ops[e.dst].name, "bytes": e.bytes,
             **({"saved_bytes": e.saved} if e.saved else {})}  # optional: older documents lack it
            for e in graph.edges
        ],
        **({"shared_params": [{"ops": list(g.ops), "bytes": g.bytes} for g in graph.shared]} if graph.shared else {}),
        **({"lengths": list(graph.lengths)} if graph.lengths else {}),
    }


def graph_from_dict(doc: Any, where: str = "graph") -> OpGraph:
    """Parse a ``graphpipe.graph/1`` document; other formats are refused, every field is type-checked."""
    from graphpipe import files as f

    f.mapping(doc, where)
    fmt = doc.get("format")
    if fmt != GRAPH_FORMAT:
        raise FormatError(f"{where}: unsupported format {fmt!r}; expected {GRAPH_FORMAT!r}")
    for key in ("ops", "edges"):
        if key not in doc:
            raise FormatError(f"{where}: missing key {key!r}")
    raw_ops, raw_edges = f.array(doc["ops"], f"{where}.ops"), f.array(doc["edges"], f"{where}.edges")
    if len(raw_ops) > MAX_OPS:
        raise InputError(f"{where}: {len(raw_ops)} ops is more than the {MAX_OPS} a plan search finishes with")
    ops = []
    for i, o in enumerate(raw_ops):
        at = f"{where}.ops[{i}]"
        f.mapping(o, at)
        if "name" not in o or "fwd_s" not in o or "bwd_s" not in o:
            raise FormatError(f"{where}: malformed graph document: ops[{i}] needs name, fwd_s and bwd_s")
        costs = []
        for key in ("fwd_s", "bwd_s"):
            pair = f.array(o[key], f"{at}.{key}")
            if len(pair) != 2:
                raise FormatError(f"{where}: op {i}: fwd_s and bwd_s must be [alpha, beta]")
            costs.append(Affine(*(f.number(v, f"{at}.{key}[{k}]", 0) for k, v in enumerate(pair))))
        # optional: only measured weight gradients are written, and older graphs have none
        wgrad = affine_field(o["wgrad_s"], f"{at}.wgrad_s") if "wgrad_s" in o else None
        batchnorm, dropout = o.get("batchnorm", False), o.get("dropout", False)
        for key, value in (("batchnorm", batchnorm), ("dropout", dropout)):
            if not isinstance(value, bool):
                raise FormatError(f"{at}.{key} must be true or false, got {value!r}")
        ops.append(Op(name=f.string(o["name"], f"{at}.name"), kind=f.string(o.get("kind", "op"), f"{at}.kind"),
                      fwd=costs[0], bwd=costs[1], wgrad=wgrad, batchnorm=batchnorm, dropout=dropout,
                      **{key: _num(f.number(o.get(key, 0), f"{at}.{key}", 0))
                         for key in ("param_bytes", "act_bytes", "out_bytes")}))
    edges = []
    for i, e in enumerate(raw_edges):
        at = f"{where}.edges[{i}]"
        f.mapping(e, at)
        if "src" not in e or "dst" not in e:
            raise FormatError(f"{at}: needs src and dst (op names)")
        edges.append((f.string(e["src"], f"{at}.src"), f.string(e["dst"], f"{at}.dst"),
                      float(f.number(e.get("bytes", 0), f"{at}.bytes", 0)),
                      float(f.number(e.get("saved_bytes", 0), f"{at}.saved_bytes", 0))))
    name = f.string(doc.get("name", "graph"), f"{where}.name")
    shared = []
    for i, g in enumerate(f.array(doc.get("shared_params", []), f"{where}.shared_params")):
        at = f"{where}.shared_params[{i}]"
        f.mapping(g, at)
        shared.append(SharedParams(tuple(f.string(n, f"{at}.ops[{k}]") for k, n in enumerate(f.array(g.get("ops", []), f"{at}.ops"))),
                                   float(f.number(g.get("bytes", 0), f"{at}.bytes", 0))))
    lengths = tuple(int(f.number(v, f"{where}.lengths[{k}]", 1))
                    for k, v in enumerate(f.array(doc.get("lengths", []), f"{where}.lengths")))
    return OpGraph.build(name, ops, edges, shared, lengths)


def affine_field(value: Any, where: str) -> Affine:
    """A time model written as ``[alpha, beta]`` (seconds), both numbers >= 0.

    >>> affine_field([1e-3, 2e-4], "op.wgrad_s")
    Affine(alpha=0.001, beta=0.0002)
    """
    from graphpipe import files as f

    pair = f.array(value, where)
    if len(pair) != 2:
        raise FormatError(f"{where} must be [alpha, beta], got {len(pair)} number(s)")
    return Affine(*(float(f.number(v, f"{where}[{k}]", 0)) for k, v in enumerate(pair)))


def _num(value: Any) -> float:
    number = float(value)
    return int(number) if number.is_integer() else number


def read_graph_json(path: str) -> OpGraph:
    """Read a graph JSON file (clear :class:`FormatError` on any problem)."""
    return graph_from_dict(read_json_file(path, "file"), where=path)
