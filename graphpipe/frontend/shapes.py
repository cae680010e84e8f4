"""The shape of every step: which input dims may vary, and the shape of every value crossing a cut at each step.

Capture keeps the batch (dim 0 of every input) symbolic, and every other dim
of an integer input (token ids, masks, labels: a sequence length) as
``torch.export``'s ``Dim.AUTO`` leaves it: a symbol where the model accepts
any size, a number where it pins one (a reshape to a constant). Float inputs
keep their other dims fixed unless the factory declares them
(``dynamic_shapes``). The captured program's ``meta["val"]`` gives each node's
shape as an expression of those symbols.

The runtime hands every rank the step's whole mini-batch, so each rank binds the
symbols from the inputs' sizes and evaluates the shape of every boundary
value itself (:meth:`~graphpipe.runtime.stage_modules.ValueMeta.at`): receive buffers are sized without
a message saying how big they are. Before anything runs, :meth:`ShapeRules.bind`
refuses, in one line naming the input and dim, a step whose size the
program cannot take: a dim the model pins, a size outside the range export
proved, or a length past a position table (an embedding indexed by
``arange(length)``, which export cannot see as a bound). Every rank checks the
same inputs, so all of them refuse together and none waits on a peer.

Example
-------
>>> import torch
>>> from graphpipe.frontend.exporting import export_model
>>> m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
>>> ex = export_model(m, (torch.randint(0, 10, (3, 5)),))
>>> rules = ShapeRules(ex.gm, ex.ranges)
>>> rules.bind((torch.zeros(2, 7, dtype=torch.long),)).rows
2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from graphpipe.errors import InputError

__all__ = ["StepShape", "ShapeRules", "ShapeDraw", "symbolic_dims", "evaluate", "resized", "data_dims"]


@dataclass(frozen=True)
class StepShape:
    """One step's sizes: its rows (the mini-batch) and the value of every symbol of the program."""

    rows: int
    symbols: tuple[tuple[str, int], ...]

    @property
    def bindings(self) -> dict[str, int]:
        return dict(self.symbols)


RANGES_KEY = "graphpipe_ranges"
"""``gm.meta`` key of the sizes export proved each symbol may take
(:attr:`~graphpipe.frontend.exporting.Exported.ranges`)."""

SHAPE_KEY = "graphpipe_shape"
"""``node.meta`` key of a shipped capture's shapes (:func:`shape_record`), where export's ``val`` does not travel."""


def node_shape(node: fx.Node) -> tuple[str, Any] | None:
    """``("tensor", dims)`` or ``("size", expression)`` of a node's value (export's ``meta["val"]``, or what a
    shipped capture brought, :func:`shape_record`); None for anything else."""
    if SHAPE_KEY in node.meta:
        return node.meta[SHAPE_KEY]
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return ("tensor", symbolic_dims(v))
    if isinstance(v, torch.SymInt):
        return ("size", int(v) if v.node.expr.is_number else v.node.expr)
    return None


def shape_records(gm: fx.GraphModule) -> dict[str, tuple]:
    """Node name -> its :func:`node_shape` in plain text (expressions as strings), to ship with a capture."""
    out = {}
    for node in gm.graph.nodes:
        rec = node_shape(node)
        if rec is None:
            continue
        kind, value = rec
        out[node.name] = (kind, tuple(d if isinstance(d, int) else str(d) for d in value) if kind == "tensor"
                          else value if isinstance(value, int) else str(value))
    return out


def apply_shape_records(gm: fx.GraphModule, records: Mapping[str, tuple]) -> None:
    """Put :func:`shape_records` back on a rebuilt capture's nodes."""
    import sympy

    def expr(d: Any) -> Any:
        return d if isinstance(d, int) else sympy.sympify(d)

    for node in gm.graph.nodes:
        rec = records.get(node.name)
        if rec is not None:
            kind, value = rec
            node.meta[SHAPE_KEY] = (kind, tuple(expr(d) for d in value) if kind == "tensor" else expr(value))


def _tensor_dims(node: fx.Node) -> tuple | None:
    rec = node_shape(node)
    return rec[1] if rec is not None and rec[0] == "tensor" else None


def symbolic_dims(value: Any) -> tuple | None:
    """A tensor's shape as ``int`` or sympy expression per dim; None for a value that is not a tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(d.node.expr if isinstance(d, torch.SymInt) and not d.node.expr.is_number else int(d)
                 for d in value.shape)


def evaluate(dims: Sequence[Any], bindings: Mapping[str, int], unknown: int | None = None) -> tuple[int, ...]:
    """Each dim's size with the symbols bound; a dim with a symbol not bound (data-dependent) is ``unknown``, or
    raises ``KeyError`` when that is None."""
    out = []
    for d in dims:
        if isinstance(d, int):
            out.append(d)
            continue
        free = {str(s): s for s in d.free_symbols}
        missing = [name for name in free if name not in bindings]
        if missing:
            if unknown is not None:
                out.append(unknown)
                continue
            raise KeyError(missing[0])
        out.append(int(d.xreplace({s: bindings[name] for name, s in free.items()})))
    return tuple(out)


class ShapeRules:
    """What the captured program ``gm`` accepts per input dim, and the boundary shapes at a step's sizes.

    ``ranges``: :attr:`~graphpipe.frontend.exporting.Exported.ranges`.
    ``names``: a readable name per graph input (``input_ids``), in placeholder order.
    """

    def __init__(self, gm: fx.GraphModule, ranges: Mapping[str, tuple[int, int | None]] | None = None,
                 names: Sequence[str] | None = None):
        ranges = gm.meta.get(RANGES_KEY, {}) if ranges is None else ranges
        # the graph's inputs: the model's, then the target's; one with a default value (the random-op context
        # the runtime adds, :func:`~graphpipe.runtime.stage_modules.instrument`) is not the step's
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.args]
        self.names = tuple(names) if names is not None else tuple(n.name for n in placeholders)
        self.inputs = tuple(_tensor_dims(n) for n in placeholders)
        self.targets = frozenset(i for i, n in enumerate(placeholders) if n.name.startswith("target"))
        """Graph inputs that are the loss's target: their dims follow the inputs' by a guess from the example
        (:func:`~graphpipe.frontend.exporting._target_shape`), good for cutting synthetic data, so a step's
        target is never refused by them (the loss checks it)."""
        """Per graph input: its dims (a number where the program pins it, an expression where it varies)."""
        self.ranges = dict(ranges)
        self.batch = next((str(dims[0]) for dims in self.inputs if dims and not isinstance(dims[0], int)), None)
        """The batch's symbol."""
        self.tables = _position_tables(gm)
        """``(length expression, rows of the table, module)`` of every embedding indexed by positions."""
        self.varying = any(not isinstance(d, int) for dims in self.inputs if dims for d in dims[1:])
        """Whether a dim other than the batch may vary between steps."""

    def bind(self, flat: Sequence[Any], model_inputs: int | None = None) -> StepShape:
        """The step's :class:`StepShape` from its flat inputs, or one :class:`InputError` naming the dim the
        program cannot take at that size. ``model_inputs``: check only the first so many (an evaluation's:
        its target is a stand-in)."""
        if len(flat) != len(self.inputs):
            raise InputError(f"the program takes {len(self.inputs)} inputs, the step gives {len(flat)}")
        bindings: dict[str, int] = {}
        pending = []
        count = len(flat) if model_inputs is None else model_inputs
        for i, (name, dims, x) in enumerate(list(zip(self.names, self.inputs, flat))[:count]):
            if dims is None or not isinstance(x, torch.Tensor) or i in self.targets:
                continue
            if x.dim() != len(dims):
                raise InputError(f"input {name!r} has {x.dim()} dims, the captured model takes {len(dims)}")
            for k, (d, size) in enumerate(zip(dims, x.shape)):
                size = int(size)
                if isinstance(d, int):
                    if d != size:
                        raise InputError(
                            f"input {name!r} dim {k} is {size}, but the captured model fixes it at {d} ("
                            + ("its code pins that size, e.g. a reshape to a constant" if not x.is_floating_point()
                               else "a float input's dims other than the batch are fixed unless the factory "
                               "declares them in dynamic_shapes") + f"); give batches with dim {k} = {d}")
                    continue
                if len(d.free_symbols) == 1 and d.is_Symbol:
                    key = str(d)
                    if key in bindings and bindings[key] != size:
                        other = next(n for n, ds, t in zip(self.names, self.inputs, flat)
                                     if ds and isinstance(t, torch.Tensor)
                                     and any(str(e) == key for e in ds))
                        raise InputError(f"input {name!r} dim {k} is {size}, but the model needs it equal to a dim "
                                         f"of {other!r}, which is {bindings[key]} in this step")
                    bindings[key] = size
                else:
                    pending.append((name, k, d, size))
        for name, k, d, size in pending:  # a dim that is an expression of others (rare): it must agree
            try:
                want = evaluate((d,), bindings)[0]
            except KeyError:
                continue
            if want != size:
                raise InputError(f"input {name!r} dim {k} is {size}, but the model needs {want} there ({d})")
        return self.at(bindings, flat)

    def at(self, bindings: Mapping[str, int], flat: Sequence[Any] | None = None) -> StepShape:
        """The :class:`StepShape` of symbol sizes ``bindings`` (a rank that reads no input knows them from the
        step's draw, ``graphpipe run --vary-shapes``); refuses a length past a position table or outside
        export's range."""
        bindings = dict(bindings)
        for key, size in bindings.items():
            lo, hi = self.ranges.get(key, (0, None))
            if key != self.batch and (size < lo or (hi is not None and size > hi)):
                raise InputError(f"a length of {size} is outside the sizes {lo}..{hi if hi is not None else 'any'} "
                                 "the model runs at there (torch.export's range)")
        for length, table_rows, module in self.tables:
            try:
                need = evaluate((length,), bindings)[0]
            except KeyError:
                continue
            if need > table_rows:
                raise InputError(f"a length of {need} exceeds {module}'s position table of {table_rows} rows: the "
                                 f"model takes at most {table_rows} positions")
        rows = bindings.get(self.batch) if self.batch else None
        if rows is None and flat is not None:
            rows = next(int(x.shape[0]) for x in flat if isinstance(x, torch.Tensor) and x.dim())
        return StepShape(int(rows or 0), tuple(sorted(bindings.items())))

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbols of the input dims that may vary, other than the batch, in first-seen order."""
        seen: dict[str, None] = {}
        for dims in self.inputs:
            for d in (dims or ())[1:]:
                if not isinstance(d, int) and d.is_Symbol and str(d) != self.batch:
                    seen.setdefault(str(d))
        return tuple(seen)

    def input_shapes(self, bindings: Mapping[str, int]) -> list[tuple[int, ...] | None]:
        """Every graph input's shape at ``bindings`` (None: not a tensor)."""
        return [evaluate(dims, bindings) if dims is not None else None for dims in self.inputs]


def data_dims(gm: fx.GraphModule, values: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Of ``values`` (crossing a cut), each one the step's input sizes do not size, with the indices of its dims
    that carry a symbol no input carries (a data-dependent size, export's unbacked ``u0``). Such a value's
    messages carry their shape ahead of them (:func:`~graphpipe.runtime.comm.send_header`)."""
    rules = ShapeRules(gm)
    known = {str(s) for dims in rules.inputs if dims for d in dims if not isinstance(d, int)
             for s in d.free_symbols}
    by_name = {n.name: n for n in gm.graph.nodes}
    out = {}
    for name in values:
        node = by_name.get(name)
        dims = _tensor_dims(node) if node is not None else None
        loose = tuple(i for i, d in enumerate(dims or ()) if not isinstance(d, int)
                      and any(str(s) not in known for s in d.free_symbols))
        if loose:
            out[name] = loose
    return out


def _position_tables(gm: fx.GraphModule) -> list[tuple[Any, int, str]]:
    """Embeddings indexed by positions computed from sizes alone (``wpe(arange(seq))``): each bounds a length.

    Export cannot see such a bound (an index is data), so a longer step would fail inside a stage; naming it
    up front lets every rank refuse the step before any sends.
    """
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        weight, index = node.args[0], node.args[1]
        w = _tensor_dims(weight) if isinstance(weight, fx.Node) else None
        if not w or not isinstance(w[0], int) or not isinstance(index, fx.Node):
            continue
        end = _arange_end(index, depth=0)
        if end is None:
            continue
        # the table's module, from the weight it reads (a shipped capture keeps no module stacks)
        module = weight.target.rsplit(".", 1)[0] if weight.op == "get_attr" else node.name
        out.append((end, w[0], module))
    return out


def _arange_end(node: fx.Node, depth: int) -> Any:
    """The symbolic end of the ``arange`` an index is computed from without reading any input's values; None
    when the index reads data (a placeholder's values) or no such ``arange`` is found."""
    if depth > 8:
        return None
    if node.op == "placeholder":
        return None
    aranges = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)
    if node.op == "call_function" and node.target in aranges:
        end = node.args[0] if node.target is torch.ops.aten.arange.default else node.args[1]
        rec = node_shape(end) if isinstance(end, fx.Node) else None
        return rec[1] if rec is not None and rec[0] == "size" and not isinstance(rec[1], int) else None
    if node.op != "call_function":
        return None
    found = None
    for a in node.all_input_nodes:
        if a.op == "call_function" and a.target in (torch.ops.aten.sym_size.int,):
            continue
        end = _arange_end(a, depth + 1)
        if end is None and not _sizes_only(a, depth + 1):
            return None
        found = end if end is not None else found
    return found


def _sizes_only(node: fx.Node, depth: int) -> bool:
    """Whether a node is computed from sizes and constants alone (reads no input's values)."""
    if depth > 8 or node.op == "placeholder":
        return False
    if node.op == "get_attr":
        return False
    return all(_sizes_only(a, depth + 1) for a in node.all_input_nodes
               if not (a.op == "call_function" and a.target is torch.ops.aten.sym_size.int))


def resized(flat: Sequence[Any], shapes: Sequence[tuple[int, ...] | None]) -> tuple:
    """``flat`` with each tensor cut (or tiled, then cut) to its shape in ``shapes``: a synthetic batch at another
    length and fewer rows (``graphpipe run --vary-shapes``), the same on every rank and in ``--check``'s
    reference."""
    out = []
    for x, shape in zip(flat, shapes):
        if isinstance(x, torch.Tensor) and shape is not None and tuple(x.shape) != tuple(shape):
            for k, size in enumerate(shape):
                if x.shape[k] < size:
                    x = x.repeat(*[-(-size // x.shape[k]) if j == k else 1 for j in range(x.dim())])
                x = x.narrow(k, 0, size)
            x = x.contiguous()
        out.append(x)
    return tuple(out)


@dataclass(frozen=True)
class ShapeDraw:
    """``graphpipe run --vary-shapes LO:HI[,ROWS_LO:ROWS_HI]``: each step draws every varying length in
    ``[LO, HI]`` and its rows in ``[ROWS_LO, ROWS_HI]`` (default: the plan's batch), from the seed and the step
    alone, so every rank and the ``--check`` reference draw the same."""

    lengths: tuple[int, int]
    rows: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> "ShapeDraw":
        """``"8:24"`` or ``"8:24,5:8"``; one :class:`InputError` for anything else."""
        def pair(part: str, what: str) -> tuple[int, int]:
            try:
                lo, hi = (int(v) for v in part.split(":"))
            except ValueError:
                raise InputError(f"--vary-shapes: {what} must be LO:HI (two integers), got {part!r}") from None
            if not 1 <= lo <= hi:
                raise InputError(f"--vary-shapes: {what} {part!r} needs 1 <= LO <= HI")
            return lo, hi

        parts = str(text).split(",")
        if len(parts) > 2:
            raise InputError(f"--vary-shapes takes LEN_LO:LEN_HI[,ROWS_LO:ROWS_HI], got {text!r}")
        return cls(pair(parts[0], "the length range"), pair(parts[1], "the rows range") if len(parts) > 1 else None)

    def sizes(self, seed: int, step: int, batch_symbol: str | None, symbols: Sequence[str],
              batch_size: int) -> dict[str, int]:
        """Step ``step``'s sizes: each symbol of ``symbols`` a length of its own, the batch its rows."""
        import random

        rng = random.Random(seed * 1_000_003 + step)
        out = {sym: rng.randint(*self.lengths) for sym in symbols}
        if batch_symbol is not None:
            out[batch_symbol] = rng.randint(*self.rows) if self.rows is not None else batch_size
        return out
