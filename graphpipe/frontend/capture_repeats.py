"""Capture a long stack of repeating blocks once: export a few of them and unroll the op graph.

``torch.export`` traces every decoder layer of a large language model one
by one, so capturing an 80-layer model costs 80 times one layer although
the layers are copies of each other. For planning only the op graph
matters, and the op graph of a stack of identical blocks is periodic: the
first block, then the same op (same costs, same edges of the same bytes)
again and again, then the last one. :func:`capture_graph` captures the
module with each such stack cut to its first :data:`KEPT` blocks, reads the
period off the blocks it kept, and writes the op graph the whole stack would
have given.

Which stacks are cut (:func:`repeated_stacks`): an ``nn.ModuleList`` or
``nn.Sequential`` whose children, after a prefix of any others, repeat to
the last one in units of ``period`` consecutive children (a :class:`Stack`),
at least ``2 * KEPT`` units. Children one period apart must be the same
(:func:`block_signature`: the same module classes nested the same way,
parameters and buffers of the same names, shapes, dtypes and
``requires_grad``, the same plain attributes apart from a block's own
index) and share no parameter with one another or with the rest of the
model. The shortest period is taken, then the shortest prefix: a stack of
identical decoder layers is a period of 1 from child 0; DeepSeek-V3's
three dense layers before its mixture-of-experts ones a prefix of 3;
Gemma-2's sliding and global attention layers a period of 2, Gemma-3's
five local to one global a period of 6 after a prefix that makes the run
end in a whole unit; T5's first block, which alone holds the relative
position table, a prefix of 1. The cut keeps the prefix and the first
:data:`KEPT` units. The rest is checked on what the cut capture gives
(:func:`unroll`): the kept units' ops come one unit after another, the
middle units' ops, edges and costs are identical, a unit only feeds the
next one (and is fed by ops before the run, the prefix's included); a
glue op after the run is named after its fx node, numbered per base name,
and is renamed by the nodes the left-out units would have made (the two
middle units must have made the same). Anything else, including a forward that
fails on the cut stack (one indexing ``layers[i]`` for ``i`` in
``range(config.num_layers)``), captures the whole module as before.

Every unit's ops are identical to a middle unit's except the first and
the last (the first reads the embedding or the prefix, the last may absorb
a final norm), so the unrolled graph equals the fully captured one, names
included (tests compare them on Hugging Face Llama, Gemma-2, Llama-4,
DeepSeek-V3, T5 and other architectures at small widths, and on zoo
transformers).
The runtime still captures the whole module: it needs the runnable graph.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch.nn as nn

from graphpipe.frontend.capture_refusals import MetaValueError
from graphpipe.graph import OpGraph

if TYPE_CHECKING:
    from graphpipe.frontend.capture import Granularity
    from graphpipe.cluster import DeviceSpec

__all__ = ["KEPT", "Stack", "block_signature", "same_blocks", "repeated_stacks", "unroll", "unrolled_capture",
           "capture_graph", "graph_from_factory"]

log = logging.getLogger(__name__)

KEPT = 4
"""Blocks of a stack the cut capture keeps: the first, two middle ones (compared with each other) and the last."""

_PLAIN = (str, float, bool, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) or isinstance(v, int) for v in value)
    return isinstance(value, _PLAIN)


def block_signature(block: nn.Module) -> tuple[tuple, dict[tuple[str, str], int]]:
    """What must be equal for two blocks of a stack to give the same ops (names and ids left out), and its integers.

    The first part, per submodule (in order): its relative path and class,
    its parameters' and buffers' names, shapes, dtypes and
    ``requires_grad``, its training flag and its plain attributes (strings,
    floats, booleans, None, tuples of them). The second: its integer
    attributes, ``(submodule path, name) -> value``; along a stack each must
    be the same in every block or count the blocks (a ``layer_idx``), see
    :func:`same_blocks`.

    >>> a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    >>> block_signature(a) == block_signature(b), block_signature(a) == block_signature(nn.Linear(4, 5))
    (True, False)
    """
    parts, ints = [], {}
    for path, m in block.named_modules():
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False))
        attrs = []
        for key, value in sorted(vars(m).items()):
            if key.startswith("_"):
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                ints[(path, key)] = value
            elif _plain(value):
                attrs.append((key, value if not isinstance(value, list) else tuple(value)))
        parts.append((path, type(m).__module__, type(m).__qualname__, params, buffers, m.training, tuple(attrs)))
    return tuple(parts), ints


def same_blocks(blocks: Sequence[nn.Module], stride: int = 1) -> bool:
    """Whether ``blocks`` are copies of one block: equal :func:`block_signature`, each integer constant or a counter.

    A counter (``layer_idx``: block ``i`` holds ``stride * i + c``; the
    blocks of a stack taken every ``stride``-th) names a block; it is
    allowed because a block's ops cannot be told apart by it unless the
    forward branches on it, which the periodicity check of :func:`unroll`
    then sees.
    """
    return _same(tuple(block_signature(b) for b in blocks), stride)


def _same(signatures: Sequence[tuple[tuple, dict[tuple[str, str], int]]], stride: int) -> bool:
    if any(s[0] != signatures[0][0] or s[1].keys() != signatures[0][1].keys() for s in signatures):
        return False
    for key, value in signatures[0][1].items():
        values = [s[1][key] for s in signatures]
        if len(set(values)) > 1 and len({v - stride * i for i, v in enumerate(values)}) > 1:
            return False
    return True


@dataclass(frozen=True)
class Stack:
    """A run of repeating blocks at the end of a ``ModuleList``/``Sequential``: what :func:`unroll` grows.

    ``keys``: the names of all the holder's children in order; the first
    ``start`` of them are a prefix of other blocks (DeepSeek's dense layers
    before its mixture-of-experts ones, T5's first block holding the
    relative position table), captured as they are; from ``start`` on the
    children repeat with ``period`` (1: identical blocks; 2: Gemma-2's
    sliding and global attention layers in turn), in units of ``period``
    consecutive children, at least ``2 * KEPT`` units, to the last child.
    """

    path: str
    keys: tuple[str, ...]
    start: int = 0
    period: int = 1

    @property
    def units(self) -> int:
        """How many units of ``period`` children the run has."""
        return (len(self.keys) - self.start) // self.period

    @property
    def kept(self) -> int:
        """Children the cut capture keeps: the prefix and the first :data:`KEPT` units."""
        return self.start + KEPT * self.period

    def child(self, unit: int, offset: int) -> str:
        """The module path of child ``offset`` of unit ``unit``."""
        return _block_path(self.path, self.keys[self.start + unit * self.period + offset])


def _periodic_run(signatures: Sequence[tuple[tuple, dict[tuple[str, str], int]]]) -> tuple[int, int] | None:
    """``(start, period)`` of the shortest period, then the shortest prefix, after which ``signatures`` repeat.

    The run must reach the last child in whole units, of at least
    ``2 * KEPT`` units; its children ``period`` apart must be
    :func:`same_blocks` (integers constant or counting). None when no
    period up to an eighth of the stack fits.
    """
    n = len(signatures)
    for period in range(1, n // (2 * KEPT) + 1):
        for start in range(n % period, n - 2 * KEPT * period + 1, period):
            if all(_same(signatures[start + offset::period], period) for offset in range(period)):
                return start, period
    return None


def repeated_stacks(module: nn.Module) -> list[Stack]:
    """Every run of repeating blocks worth cutting (:class:`Stack`; module docstring), outermost first.

    A stack inside another chosen one is left whole.
    """
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    found: list[Stack] = []
    for path, m in module.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2 * KEPT:
            continue
        if any(path == s.path or path.startswith(s.path + ".") for s in found if s.path) or \
                any(s.path == "" for s in found):
            continue
        children = list(m._modules.values())
        if any(c is None for c in children) or len({id(c) for c in children}) != len(children):
            continue
        run = _periodic_run([block_signature(c) for c in children])
        if run is None or next(children[run[0]].parameters(), None) is None:
            continue
        if any(uses[id(p)] != 1 for c in children[run[0]:] for _, p in c.named_parameters(remove_duplicate=False)):
            continue  # a parameter tied between blocks or to the rest of the model: its ops share it
        found.append(Stack(path, tuple(m._modules), *run))
    return found


@contextmanager
def _cut(module: nn.Module, stacks: Sequence[Stack]) -> Iterator[None]:
    """Keep each stack's prefix and first :data:`KEPT` units while the block runs; restore them after."""
    saved = []
    try:
        for stack in stacks:
            holder = module.get_submodule(stack.path) if stack.path else module
            saved.append((holder, holder._modules))
            holder._modules = type(holder._modules)(list(holder._modules.items())[:stack.kept])
        yield
    finally:
        for holder, modules in saved:
            holder._modules = modules


def _block_path(stack: str, key: str) -> str:
    return f"{stack}.{key}" if stack else key


def unroll(graph: OpGraph, paths: dict[str, str], stack: Stack,
           op_nodes: dict[str, Sequence[str]] | None = None) -> tuple[OpGraph, dict[str, str]] | None:
    """The op graph with ``stack`` (captured with its prefix and first :data:`KEPT` units) grown to all its units.

    ``paths``: op name -> module path of its unit ("" for glue). Returns the
    new graph and paths, or None when the captured graph is not periodic as
    the module docstring requires (the caller then captures everything).
    ``op_nodes`` (op name -> its fx node names) lets glue ops after the
    stack be renamed as the whole capture names them (:func:`_glue_names`).
    """
    prefix = f"{stack.path}." if stack.path else ""
    where = {stack.keys[stack.start + i]: divmod(i, stack.period) for i in range(KEPT * stack.period)}
    member: list[tuple[int, int] | None] = []  # (unit, offset in it) of each op of a kept unit
    for op in graph.ops:
        path = paths.get(op.name, "")
        member.append(where.get(path[len(prefix):].split(".", 1)[0]) if path.startswith(prefix) else None)
    ids = [[v for v, m in enumerate(member) if m is not None and m[0] == k] for k in range(KEPT)]
    if any(not block or not _contiguous(block) for block in ids) or len({len(b) for b in ids}) != 1:
        return None
    if any(ids[k][-1] + 1 != ids[k + 1][0] for k in range(KEPT - 1)):
        return None
    first, last = ids[0][0], ids[-1][-1]
    renamed: dict[str, str] = {}
    if any(paths.get(graph.ops[v].name, "") == "" for v in range(last + 1, graph.num_ops)):
        # a glue op after the stack is named after its fx node, whose number grows with the stack
        glue = [graph.ops[v].name for v in range(last + 1, graph.num_ops) if paths.get(graph.ops[v].name, "") == ""]
        renamed = _glue_names(glue, [[graph.ops[v].name for v in block] for block in ids], op_nodes,
                              stack.units - KEPT)
        if renamed is None:
            return None
    if any(any(member[graph.op_id(name)] is not None for name in s.ops) for s in graph.shared):
        return None
    local = {v: (k, i) for k, block in enumerate(ids) for i, v in enumerate(block)}

    def rel(v: int) -> str:
        unit, offset = member[v]
        return graph.ops[v].name[len(stack.child(unit, offset)):]

    def body(k: int) -> tuple:
        if any(not graph.ops[v].name.startswith(stack.child(*member[v])) for v in ids[k]):
            return ()
        return tuple((member[v][1], rel(v), graph.ops[v].kind, graph.ops[v].fwd, graph.ops[v].bwd,
                      graph.ops[v].param_bytes, graph.ops[v].act_bytes, graph.ops[v].out_bytes, graph.ops[v].wgrad)
                     for v in ids[k])

    into: list[set] = [set() for _ in range(KEPT)]  # edges from ops before the stack, per unit
    out_of: list[set] = [set() for _ in range(KEPT)]  # edges to ops after the stack, per unit
    link: list[set] = [set() for _ in range(KEPT)]  # edges unit k -> unit k + 1
    inner: list[set] = [set() for _ in range(KEPT)]  # edges inside unit k
    outside = []
    for e in graph.edges:
        s, d = local.get(e.src), local.get(e.dst)
        if s is None and d is None:
            outside.append((graph.ops[e.src].name, graph.ops[e.dst].name, e.bytes, e.saved))
        elif s is None:
            into[d[0]].add((graph.ops[e.src].name, d[1], e.bytes, e.saved))
        elif d is None:
            out_of[s[0]].add((s[1], graph.ops[e.dst].name, e.bytes, e.saved))
        elif s[0] == d[0]:
            inner[s[0]].add((s[1], d[1], e.bytes, e.saved))
        elif d[0] == s[0] + 1:
            link[s[0]].add((s[1], d[1], e.bytes, e.saved))
        else:
            return None  # a unit feeding one further on: not a chain of units
    middle = body(1)
    if not middle or middle != body(2) or not body(0) or not body(KEPT - 1):
        return None
    if inner[1] != inner[2] or into[1] != into[2] or out_of[1] != out_of[2]:
        return None
    # unit j of the whole run is kept unit role(j): the first, a middle one, or the last
    num_units = stack.units
    role = [0] + [1] * (num_units - 2) + [KEPT - 1]

    def names(j: int, k: int) -> dict[int, str]:
        return {i: stack.child(j, member[v][1]) + rel(v) for i, v in enumerate(ids[k])}

    ops, new_paths, edges = [], {}, list(outside)
    for v in range(first):
        ops.append(graph.ops[v])
    for j, k in enumerate(role):
        name_of = names(j, k)
        for i, v in enumerate(ids[k]):
            op = graph.ops[v]
            ops.append(replace(op, name=name_of[i]))
            new_paths[name_of[i]] = stack.child(j, member[v][1]) + paths[op.name][len(stack.child(*member[v])):]
        edges += [(src, name_of[i], b, sv) for src, i, b, sv in sorted(into[k], key=repr)]
        edges += [(name_of[i], dst, b, sv) for i, dst, b, sv in sorted(out_of[k], key=repr)]
        edges += [(name_of[i], name_of[t], b, sv) for i, t, b, sv in sorted(inner[k], key=repr)]
        if j + 1 < num_units:
            nxt = role[j + 1]
            pattern = link[0] if j == 0 else (link[KEPT - 2] if nxt == KEPT - 1 else link[1])
            following = names(j + 1, nxt)
            edges += [(name_of[i], following[t], b, sv) for i, t, b, sv in sorted(pattern, key=repr)]
    for v in range(last + 1, graph.num_ops):
        op = graph.ops[v]
        ops.append(replace(op, name=renamed[op.name]) if op.name in renamed else op)
        if op.name in renamed:
            new_paths[renamed[op.name]] = ""
    new_paths.update({op.name: paths.get(op.name, "") for op in ops if op.name not in new_paths})
    edges = [(renamed.get(src, src), renamed.get(dst, dst), b, sv) for src, dst, b, sv in edges]
    return OpGraph.build(graph.name, ops, edges, graph.shared, graph.lengths), new_paths


def _glue_names(glue: Sequence[str], units: Sequence[Sequence[str]], op_nodes: dict[str, Sequence[str]] | None,
                extra: int) -> dict[str, str] | None:
    """The names the whole capture gives the glue ops ``glue`` after a stack grown by ``extra`` units.

    A glue op is named after its first fx node, and fx numbers nodes per
    base name in the order it makes them (``mul``, ``mul_1``, ...): each of
    the ``extra`` units the cut capture left out would have made as many
    nodes of each base name as a middle unit did, so ``mul_26`` after the
    stack is ``mul_{26 + extra * (mul nodes a unit makes)}`` in the whole
    capture (Pegasus-X's decoder positions come after its encoder stack). None
    when the two middle units (``units[1]``, ``units[2]``: their op names)
    made different nodes, or the nodes are not known.
    """
    if op_nodes is None:
        return None
    made = [Counter(_base(node)[0] for op in unit for node in op_nodes.get(op, ())) for unit in units[1:3]]
    if made[0] != made[1] or not made[0]:
        return None
    renamed = {}
    for name in glue:
        base, number = _base(name)
        if made[0][base]:
            number += extra * made[0][base]
            renamed[name] = f"{base}_{number}" if number else base
    return renamed


def _base(node: str) -> tuple[str, int]:
    """fx's base name and number of a node name: ``mul_26`` -> ``("mul", 26)``, ``sin`` -> ``("sin", 0)``."""
    base, _, number = node.rpartition("_")
    return (base, int(number)) if base and number.isdigit() else (node, 0)


def _contiguous(op_ids: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(op_ids, op_ids[1:]))


def unrolled_capture(module: nn.Module, example_inputs: Any, **kwargs: Any) -> OpGraph | None:
    """The op graph of ``module`` captured with each stack of identical blocks cut and unrolled; None if it cannot be.

    Takes :func:`~graphpipe.frontend.capture.capture`'s arguments. None when no stack
    qualifies (:func:`repeated_stacks`), the forward fails on the cut stacks,
    or a cut stack's graph is not periodic (:func:`unroll`).
    """
    from graphpipe.frontend.capture import capture

    stacks = repeated_stacks(module)
    if not stacks:
        log.info("no stack of at least %d repeating blocks; capturing the whole module", 2 * KEPT)
        return None
    try:
        with _cut(module, stacks):
            cut = capture(module, example_inputs, **kwargs)
    except MetaValueError:
        raise  # no depth captures a value the meta device does not have: refuse now, not after a whole capture
    except Exception as exc:  # the forward needs every block (it indexes them by a count of its own)
        log.info("capturing with stacks cut to %d blocks failed (%s); capturing the whole module", KEPT, exc)
        return None
    graph, paths, op_nodes = cut.graph, dict(cut.paths or {}), dict(cut.op_nodes)
    for stack in stacks:
        grown = unroll(graph, paths, stack, op_nodes)
        if grown is None:
            log.info("stack %r is not periodic once captured; capturing the whole module", stack.path)
            return None
        graph, paths = grown
    log.info("unrolled %s", ", ".join(f"{s.path!r} ({s.units} units of {s.period} after {s.start})" for s in stacks))
    return graph


def capture_graph(module: nn.Module, example_inputs: Any, **kwargs: Any) -> OpGraph:
    """:func:`graphpipe.frontend.capture.capture`'s op graph, capturing each stack of identical blocks once.

    Takes :func:`~graphpipe.frontend.capture.capture`'s arguments:
    :func:`unrolled_capture` where it applies, else the whole capture.
    """
    from graphpipe.frontend.capture import capture

    graph = unrolled_capture(module, example_inputs, **kwargs)
    return graph if graph is not None else capture(module, example_inputs, **kwargs).graph


def graph_from_factory(spec: str, device: DeviceSpec | None = None, granularity: Granularity | None = None,
                       precision: str = "fp32") -> OpGraph:
    """The op graph of a ``file.py:factory`` spec's module (see :func:`graphpipe.frontend.capture.load_factory`).

    What :func:`graphpipe.frontend.capture.captured_from_factory` gives, with each stack of identical
    blocks captured once (:func:`capture_graph`):
    planning needs the graph only, not the runnable module.
    """
    from graphpipe.frontend.capture import load_factory

    made = load_factory(spec)
    name = os.path.splitext(os.path.basename(spec.rpartition(":")[0]))[0]
    return capture_graph(made.module, made.example_inputs, name=name, device=device,
                         user_file=spec.rpartition(":")[0], loss_fn=made.loss_fn, example_target=made.example_target,
                         granularity=granularity, precision=precision)
