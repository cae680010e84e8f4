"""Cut a captured fx graph into one module per pipeline stage (docs/design.md, "The runtime").

The capture (:mod:`graphpipe.frontend.capture`) maps every op of the
:class:`~graphpipe.graph.OpGraph` to the fx nodes that compute it
(``op_nodes``); the plan's :class:`~graphpipe.stages.StageGraph` maps every
op to a stage. Together they give every fx node a stage, and this module
rebuilds, for each stage, a small :class:`torch.fx.GraphModule` whose

* placeholders are the stage's *inputs*: values produced by other stages
  (named after the producing fx node) and model inputs (placeholders of the
  captured graph) the stage reads directly;
* output is ``(sent, model_output)``: ``sent`` is a tuple of every value some
  other stage reads, ``model_output`` the captured graph's output structure
  on the one stage that produces it (``None`` elsewhere).

We do our own graph surgery rather than ``torch.fx.passes.split_module``
because the executor needs, per stage *edge*, the exact list of values that
cross it (a stage with fan-out sends different values to different
consumers), and because non-adjacent stage edges are normal in a graph
pipeline.

Rules for fx nodes that belong to no op (the capture contract says there are
none, but user factories may produce them): ``get_attr`` nodes are copied into
every stage that reads them; any other node joins the earliest stage that
reads it; nodes nobody reads are dropped.

Tied parameters (one ``nn.Parameter`` read by several stages: a GPT's
embedding and output head, a layer called from two branches): the first
stage (in stage order) keeps the parameter, every other stage gets a copy
of its own (:attr:`ModelSplit.tied` lists them), and the executor sums the
copies' gradients across the owning stages before the optimizer step, as
Megatron does for tied embeddings, so the copies stay equal. Buffers that a
forward mutates (BatchNorm running statistics) must live in exactly one
stage; a BatchNorm called from two stages is refused.

Semantics (docs/semantics.md, :func:`instrument`): before the split, every dropout
and BatchNorm call of the captured graph is rewritten to take a context,
the ``rng_ctx`` placeholder every stage module gets as its *last* argument
(default ``None``: plain PyTorch semantics). The executor passes a
:class:`~graphpipe.runtime.rng.ShardContext` naming the rows the call holds;
dropout masks then depend only on (seed, step, op, rows) and BatchNorm
normalises per micro-batch (:mod:`graphpipe.runtime.rng`,
:mod:`graphpipe.runtime.batchnorm`). A wrapper that recomputes the forward
(``torch.utils.checkpoint``) must pass the same context again: it is an
argument, so checkpoint does.

A *sequential* stage graph (``StageGraph.sequential``: SPP baselines) has
only chain edges; a value produced by stage ``p`` and read by stage
``c > p + 1`` is then relayed: every stage in between takes it as an input
and returns it unchanged (its gradient flows back the same way).

Every value crossing a stage boundary must be a tensor whose dim 0 is the
batch (it is sliced and concatenated along dim 0 when producer and consumer
micro-batch sizes or replica counts differ) or whose shape does not change
with the batch (an *unbatched* value such as a position table, carried
whole with every micro-batch, :class:`ValueMeta`); :func:`boundary_meta`
tells them apart by running the model at two batch sizes.

Example
-------
>>> import torch
>>> from graphpipe.graph import Op, OpGraph
>>> from graphpipe.stages import Stage, StageGraph
>>> class Two(torch.nn.Module):
...     def __init__(self):
...         super().__init__(); self.a = torch.nn.Linear(3, 3); self.b = torch.nn.Linear(3, 2)
...     def forward(self, x):
...         return self.b(self.a(x))
>>> gm = torch.fx.symbolic_trace(Two())
>>> g = OpGraph.build("two", [Op("a", "linear"), Op("b", "linear")], [("a", "b", 12.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 2), Stage(1, (1,), (1,), 2)], 4, 2)
>>> split = split_model(gm, {"a": ("a",), "b": ("b",)}, sg)
>>> split.programs[0].send_values, split.programs[1].recv_values, split.sink_stage
(((1, ('a',)),), ((0, ('a',)),), 1)
"""

from __future__ import annotations

import copy
import logging
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from graphpipe.errors import PlanError, some
from graphpipe.stages import StageGraph
from graphpipe.runtime.numerics import ROW_KERNELS

__all__ = ["StageProgram", "BoundForward", "Segment", "ModelSplit", "ValueMeta", "TiedParameter", "split_model", "boundary_meta", "check_op_names",
           "check_unbatched_edges", "check_data_sized_edges",
           "instrument", "CTX_NAME", "clone_mutated_inputs"]

CTX_NAME = "rng_ctx"
"""Name of the context placeholder :func:`instrument` adds (the last argument of every stage module)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class StageProgram:
    """One stage's module and its communication interface."""

    stage_id: int
    module: torch.fx.GraphModule
    """Called with the values named in :attr:`input_names`, in that order; returns ``(sent, model_output)``."""
    input_names: tuple[str, ...]
    """Placeholder names: produced values (fx node names) and model-input placeholder names."""
    model_inputs: tuple[tuple[str, int], ...]
    """``(placeholder name, position in the model's positional inputs)`` read straight from the data."""
    recv_values: tuple[tuple[int, tuple[str, ...]], ...]
    """``(producer stage, values received from it)`` for every producer, in stage order."""
    send_values: tuple[tuple[int, tuple[str, ...]], ...]
    """``(consumer stage, values sent to it)`` for every consumer, in stage order."""
    output_names: tuple[str, ...]
    """Values in the ``sent`` tuple the module returns (the union of :attr:`send_values`)."""
    is_sink: bool
    """True on the stage that produces the model output (and computes the loss)."""
    param_names: Mapping[str, str] = field(default_factory=dict)
    """Parameter name in :attr:`module` -> its name in the whole model (differs for tied copies)."""
    segments: tuple["Segment", ...] = ()
    """A re-materializing stage with checkpoints: :attr:`module` cut at them, in order (:func:`segment_stage`)."""
    assemble: torch.fx.GraphModule | None = None
    """With segments: called with the values :attr:`gathers` names, returns ``(sent, model_output)``."""
    gathers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    """A piece of a stage module between two checkpoints; it shares the stage module's parameters."""

    module: torch.fx.GraphModule
    """Called with the values named in :attr:`input_names`, then the context; returns the values named in
    :attr:`output_names` (a tuple)."""
    input_names: tuple[str, ...]
    """Stage inputs and values of earlier segments it reads."""
    output_names: tuple[str, ...]
    """Values later segments read, and the stage's outputs it computes."""
    handed: tuple[str, ...]
    """The outputs only later segments keep (not sent on, not the model output): the tensors a checkpoint
    holds beyond the stage's inputs (:func:`graphpipe.costs.segment_bytes`' hand-over)."""


@dataclass(frozen=True, slots=True)
class ValueMeta:
    """A tensor crossing a stage boundary: its shape without dim 0 (batch-major) or whole (unbatched), and dtype.

    An *unbatched* value has the same shape at every batch size (a learned
    position table of shape ``(1, seq, d)``, a relative position bias
    ``(1, heads, q, k)``, a scalar). It travels whole with every micro-batch
    (one copy per message, never sliced by rows); the gradients its consumers
    send back are summed on the producer. A *constant* one is also equal at
    every batch (computed from parameters alone), so a consumer shard fed by
    several producer shards may take any copy; an unbatched value that
    depends on the rows needs producer and consumer shards to match one to
    one (:func:`check_unbatched_edges`).
    """

    sample_shape: tuple[int, ...]
    dtype: torch.dtype
    batched: bool = True
    constant: bool = False
    """Unbatched and equal at two batch sizes: it does not depend on the rows."""
    batch_dim: int = 0
    """Where the batch is in the value as the stages compute it: 1 for ``(seq, batch, dim)``, as
    ``nn.Transformer`` takes its inputs by default. Messages always carry it batch-major (the batch moved to
    dim 0, :meth:`to_wire`), so rows are sliced and stitched the same way for every value."""
    dims: tuple | None = None
    """:attr:`sample_shape` as the program's expressions (a sequence length's symbol) where a dim other than
    the batch varies between steps; None where the sample shape is fixed. :meth:`at` evaluates it."""
    sized_by_data: bool = False
    """A dim depends on the values, not on the inputs' sizes (export's unbacked ``u0``: what a ``nonzero``
    kept): each message's shape travels ahead of it (:func:`~graphpipe.runtime.comm.send_header`)."""

    def at(self, bindings: Mapping[str, int]) -> "ValueMeta":
        """This value at a step's sizes (:class:`~graphpipe.frontend.shapes.StepShape`): its sample shape
        evaluated (-1 for a dim the data sizes); itself when no dim varies."""
        if self.dims is None:
            return self
        from dataclasses import replace

        from graphpipe.frontend.shapes import evaluate

        return replace(self, sample_shape=evaluate(self.dims, bindings, unknown=-1 if self.sized_by_data else None))

    @property
    def needs_grad(self) -> bool:
        """Gradients flow back only through floating-point values."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def shape(self, rows: int) -> tuple[int, ...]:
        """The shape of one message carrying ``rows`` samples of this value."""
        return (rows, *self.sample_shape) if self.batched else self.sample_shape

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """The value (or its gradient) as a message carries it: batch at dim 0 (a view)."""
        return t.movedim(self.batch_dim, 0) if self.batch_dim else t

    def from_wire(self, t: torch.Tensor) -> torch.Tensor:
        """A message's rows in the layout the stage computes with, contiguous (a stage's ``view`` needs it)."""
        return t.movedim(0, self.batch_dim).contiguous() if self.batch_dim else t


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """One parameter read by several stages: its model name and ``(stage, name in that stage's module)`` per copy."""

    name: str
    copies: tuple[tuple[int, str], ...]
    """First entry: the stage that keeps the original; the others hold copies."""

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.copies)


@dataclass(frozen=True, slots=True, eq=False)
class ModelSplit:
    programs: tuple[StageProgram, ...]
    sink_stage: int
    boundary_values: tuple[str, ...]
    """Every fx value some stage sends to another, in graph order."""
    tied: tuple[TiedParameter, ...] = ()
    """Parameters read by more than one stage (their gradients are summed across the copies)."""
    node_stages: Mapping[str, int] = field(default_factory=dict)
    """Stage of every fx node that takes the context (dropout, BatchNorm) or is a row kernel
    (:data:`~graphpipe.runtime.numerics.ROW_KERNELS`): the reference cuts its input the same way."""
    op_of: Mapping[str, int] = field(default_factory=dict)
    """fx node name -> the plan's op id it belongs to (an FSDP stage's per-op units, :func:`segment_stage`)."""


def check_op_names(plan_ops: Sequence[str], captured_ops: Sequence[str], model: str) -> None:
    """Refuse a plan whose op names are not exactly the capture's (before anything is launched)."""
    plan_set, cap_set = set(plan_ops), set(captured_ops)
    unknown = sorted(plan_set - cap_set)
    missing = sorted(cap_set - plan_set)
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} op(s) the model does not have: {some(unknown)}")
        if missing:
            parts.append(f"{len(missing)} op(s) of the model missing from the plan: {some(missing)}")
        raise PlanError(f"plan does not match model {model!r}: " + "; ".join(parts)
                        + f". Re-plan with `graphpipe plan {model} ...` so the op names come from the same capture")


def _assign_stages(gm: torch.fx.GraphModule, op_nodes: Mapping[str, Sequence[str]],
                   sg: StageGraph) -> tuple[dict[torch.fx.Node, int], dict[torch.fx.Node, set[int]]]:
    """Stage of every compute node, and the stages each shared ``get_attr`` node is copied into."""
    by_name = {n.name: n for n in gm.graph.nodes}
    node_stage: dict[torch.fx.Node, int] = {}
    for op_name, names in op_nodes.items():
        try:
            op_id = sg.graph.op_id(op_name)
        except Exception:  # noqa: BLE001 - the graph's own error names the op; we want the runtime's wording
            raise PlanError(f"captured op {op_name!r} is not in the plan's graph; re-plan the model") from None
        for name in names:
            node = by_name.get(name)
            if node is None:
                raise PlanError(f"op {op_name!r} names fx node {name!r}, which the captured graph lacks")
            if node in node_stage:
                raise PlanError(f"fx node {name!r} belongs to two ops; the capture must map each node to one op")
            node_stage[node] = sg.stage_of(op_id)
    attr_stages: dict[torch.fx.Node, set[int]] = {}
    # Reverse topological order so that every user is placed before the node itself.
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "output") or node in node_stage:
            continue
        user_stages = set()
        for user in node.users:
            if user.op == "output":
                continue
            if user in node_stage:
                user_stages.add(node_stage[user])
            elif user in attr_stages:
                user_stages |= attr_stages[user]
        if node.op == "get_attr":
            if user_stages:
                attr_stages[node] = user_stages
            continue
        if not user_stages:
            if any(u.op == "output" for u in node.users):
                producers = [node_stage[a] for a in node.all_input_nodes if a in node_stage]
                node_stage[node] = max(producers) if producers else sg.num_stages - 1
            else:
                log.info("dropping fx node %s: no op reads it", node.name)
            continue
        node_stage[node] = min(user_stages)
    return node_stage, attr_stages


def split_model(gm: torch.fx.GraphModule, op_nodes: Mapping[str, Sequence[str]], sg: StageGraph) -> ModelSplit:
    """Build every stage's module from the captured ``gm`` (see the module docstring)."""
    node_stage, attr_stages = _assign_stages(gm, op_nodes, sg)
    nodes = list(gm.graph.nodes)
    ctx_node = next((n for n in nodes if n.op == "placeholder" and n.name == CTX_NAME), None)
    placeholders = [n for n in nodes if n.op == "placeholder" and n is not ctx_node]
    input_index = {n: i for i, n in enumerate(placeholders)}
    output_node = next(n for n in nodes if n.op == "output")
    out_nodes = output_node.all_input_nodes
    out_stages = {node_stage[n] for n in out_nodes if n in node_stage}
    if any(n.op == "placeholder" for n in out_nodes) or len(out_stages) != 1:
        raise PlanError(f"the model output must be computed by exactly one stage, but it comes from stages "
                        f"{sorted(out_stages)}{' and the model inputs' if any(n.op == 'placeholder' for n in out_nodes) else ''}; "
                        "merge the output ops into one stage (one loss per iteration)")
    sink = out_stages.pop()

    # Which values cross which stage edge.
    needed: list[dict[torch.fx.Node, None]] = [dict() for _ in range(sg.num_stages)]
    sends: dict[tuple[int, int], dict[torch.fx.Node, None]] = {}
    for node in nodes:
        s = node_stage.get(node)
        if s is None:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg in attr_stages or arg is ctx_node:
                continue
            if arg.op == "placeholder":
                needed[s][arg] = None
                continue
            p = node_stage.get(arg)
            if p is None or p == s:
                continue
            if getattr(sg, "sequential", False):
                # SPP: every stage between producer and consumer relays the value (docs/design.md, "Partitioners").
                for i in range(p, s):
                    sends.setdefault((i, i + 1), {})[arg] = None
                    needed[i + 1][arg] = None
                continue
            if (p, s) not in sg.edges:
                raise PlanError(f"fx value {arg.name!r} flows from stage {p} to stage {s}, but the plan has no stage edge "
                                f"{p}->{s}; the plan's graph and the captured model disagree (re-plan the model)")
            needed[s][arg] = None
            sends.setdefault((p, s), {})[arg] = None
    order = {n: i for i, n in enumerate(nodes)}
    programs = []
    for s in range(sg.num_stages):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs = sorted(needed[s], key=order.__getitem__)
        for arg in inputs:
            env[arg] = graph.placeholder(arg.name)
        if ctx_node is not None:
            env[ctx_node] = graph.placeholder(CTX_NAME, default_value=None)
        for node in nodes:
            if node_stage.get(node) == s or (node in attr_stages and s in attr_stages[node]):
                env[node] = graph.node_copy(node, lambda a: env[a])
        consumers = sorted(c for (p, c) in sends if p == s)
        send_values = tuple((c, tuple(n.name for n in sorted(sends[(s, c)], key=order.__getitem__))) for c in consumers)
        sent_nodes = sorted({n for c in consumers for n in sends[(s, c)]}, key=order.__getitem__)
        model_out = torch.fx.node.map_arg(output_node.args[0], lambda a: env[a]) if s == sink else None
        graph.output((tuple(env[n] for n in sent_nodes), model_out))
        clone_mutated_inputs(graph)
        graph.lint()
        module = torch.fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        producers = sorted(p for (p, c) in sends if c == s)
        recv_values = tuple((p, tuple(n.name for n in sorted(sends[(p, s)], key=order.__getitem__))) for p in producers)
        programs.append(StageProgram(
            stage_id=s, module=module, input_names=tuple(a.name for a in inputs),
            model_inputs=tuple((a.name, input_index[a]) for a in inputs if a.op == "placeholder"),
            recv_values=recv_values, send_values=send_values, output_names=tuple(n.name for n in sent_nodes),
            is_sink=(s == sink)))
    tied = _untie_parameters(gm, programs)
    _check_buffers_owned_once(programs)
    op_of = {name: sg.graph.op_id(op) for op, names in op_nodes.items() for name in names}
    programs = [replace(prog, **segment_stage(prog.module, op_of, sg.stages[prog.stage_id].checkpoints))
                if sg.stages[prog.stage_id].checkpoints else prog for prog in programs]
    boundary = tuple(n.name for n in sorted({n for v in sends.values() for n in v}, key=order.__getitem__))
    node_stages = {n.name: node_stage[n] for n in nodes if n in node_stage and (
        (ctx_node is not None and ctx_node in n.all_input_nodes) or (n.op == "call_function" and n.target in ROW_KERNELS))}
    return ModelSplit(tuple(programs), sink, boundary, tied, node_stages, op_of)


def view_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node ``node`` is a view of, through any chain of aten view ops (``node`` itself if it is none)."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        returns = schema.returns if schema is not None else ()
        alias = returns[0].alias_info if len(returns) == 1 else None
        if alias is None or alias.is_write or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return node
        node = node.args[0]  # a view (``slice``, ``view``, ``select``, ...) of its first argument
    return node


def _mutated_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder ``node`` is (or is a view of, through any chain of aten view ops), else None."""
    root = view_root(node)
    return root if root.op == "placeholder" else None


def clone_mutated_inputs(graph: torch.fx.Graph) -> tuple[str, ...]:
    """Read every stage input an op of ``graph`` mutates in place (``add_``, ``masked_fill_``, ``copy_`` into a
    slice of it) through a clone, placed right after the inputs; returns their names.

    Eagerly such a value is an intermediate (BLIP's ``embeddings += position_embeddings``); in a stage it is
    a received tensor (a leaf that requires grad, which autograd refuses to mutate) or a slice of the
    user's mini-batch (which the step must not change). ``clone``'s gradient is the identity, so the
    received value's gradient stays exact, and every later reader in the stage, the values sent on
    included, reads the mutated clone, as eagerly.
    """
    mutated: dict[torch.fx.Node, None] = {}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            base = _mutated_base(value) if isinstance(value, torch.fx.Node) else None
            if base is not None and base.name != CTX_NAME:
                mutated[base] = None
    if not mutated:
        return ()
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for ph in reversed(list(mutated)):
        with graph.inserting_after(last):
            copy = graph.call_function(torch.ops.aten.clone.default, (ph,))
        copy.name = f"{ph.name}_clone"
        ph.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
    return tuple(ph.name for ph in mutated)


def segment_stage(module: torch.fx.GraphModule, op_of: Mapping[str, int], checkpoints: Sequence[int]
                  ) -> dict[str, Any]:
    """Cut a stage module at ``checkpoints`` (op ids starting segments 2..k): the :class:`StageProgram`
    fields ``segments``, ``assemble`` and ``gathers``.

    An fx node joins its op's segment (``op_of``: node name -> op id); a node
    of no op joins the earliest segment reading it, and ``get_attr`` nodes are
    copied into every segment reading them. Each segment returns what later
    segments read and the stage outputs it computes; ``assemble`` builds the
    stage's ``(sent, model_output)`` from those, so no checkpoint takes (and
    saves) a value only because the stage sends it on. Op ids are
    topological, so every segment reads only stage inputs and earlier segments.
    """
    cuts = sorted(checkpoints)
    nodes = list(module.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    last = len(cuts)
    seg: dict[torch.fx.Node, int] = {n: bisect_right(cuts, op_of[n.name]) for n in nodes  # inputs bear their
                                     if n.op not in ("placeholder", "get_attr") and n.name in op_of}  # producer's name
    for node in reversed(nodes):
        if node.op in ("placeholder", "output", "get_attr") or node in seg:
            continue
        users = [seg.get(u, last) for u in node.users if u.op != "get_attr"]
        seg[node] = min(users, default=last)
    for node, j in seg.items():
        early = [a.name for a in node.all_input_nodes if seg.get(a, -1) > j]
        if early:
            raise PlanError(f"checkpoint segments out of order: fx node {node.name!r} (segment {j}) reads {early} "
                            "from a later segment; the plan's op order and the captured graph disagree")
    ctx = next((n for n in nodes if n.op == "placeholder" and n.name == CTX_NAME), None)
    stage_out = set(output.all_input_nodes)
    segments = []
    for j in range(last + 1):
        members = [n for n in nodes if seg.get(n) == j]
        outside = {a: None for n in members for a in n.all_input_nodes
                   if a is not ctx and a.op != "get_attr" and seg.get(a) != j}
        graph = torch.fx.Graph()
        env = {a: graph.placeholder(a.name) for a in outside}
        if ctx is not None:
            env[ctx] = graph.placeholder(CTX_NAME, default_value=None)

        def value(a, env=env, graph=graph):
            if a not in env:  # a get_attr: copied where read
                env[a] = graph.node_copy(a)
            return env[a]

        for node in members:
            for a in node.all_input_nodes:
                value(a)
            env[node] = graph.node_copy(node, value)
        exported = [n for n in members if n in stage_out or any(seg.get(u, last) > j for u in n.users
                                                                 if u.op != "output")]
        graph.output(tuple(env[n] for n in exported))
        graph.lint()
        segments.append(Segment(torch.fx.GraphModule(module, graph, class_name=f"Segment{j}"),
                                tuple(a.name for a in outside), tuple(n.name for n in exported),
                                tuple(n.name for n in exported if n not in stage_out)))
    graph = torch.fx.Graph()
    gathered = sorted(stage_out, key=nodes.index)
    env = {a: graph.placeholder(a.name) for a in gathered}
    graph.output(torch.fx.node.map_arg(output.args[0], env.__getitem__))
    return {"segments": tuple(segments), "assemble": torch.fx.GraphModule(module, graph, class_name="Assemble"),
            "gathers": tuple(a.name for a in gathered)}


def _resolve_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _untie_parameters(gm: torch.fx.GraphModule, programs: list[StageProgram]) -> tuple[TiedParameter, ...]:
    """Give every stage but the first its own copy of each parameter several stages read (in place).

    Stage modules share submodule objects with ``gm`` (``GraphModule``
    copies attribute references), so a module reached from another stage is
    shallow-copied along the path before its parameter is replaced: the
    other stages keep theirs. Fills each program's ``param_names``.
    """
    model_name = {id(p): name for name, p in gm.named_parameters()}
    users: dict[int, list[tuple[int, str]]] = {}
    for prog in programs:
        seen: set[int] = set()
        for name, p in prog.module.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                users.setdefault(id(p), []).append((prog.stage_id, name))
            prog.param_names[name] = model_name.get(id(p), name)  # type: ignore[index]
    shared = {pid: copies for pid, copies in users.items() if len(copies) > 1}
    if not shared:
        return ()
    for prog in programs:
        mine = {pid for pid, copies in shared.items() if any(s == prog.stage_id for s, _ in copies[1:])}
        if not mine:
            continue
        others = {id(m) for other in programs if other is not prog for m in other.module.modules()}
        clones: dict[int, torch.nn.Parameter] = {}
        for path, holder in list(prog.module.named_modules(remove_duplicate=False)):
            names = [n for n, p in holder._parameters.items() if p is not None and id(p) in mine]
            if not names:
                continue
            holder = _private(prog.module, path, others)
            for n in names:
                p = holder._parameters[n]
                holder._parameters[n] = clones.setdefault(id(p), torch.nn.Parameter(p.detach().clone(),
                                                                                     requires_grad=p.requires_grad))
    return tuple(TiedParameter(model_name.get(pid, copies[0][1]), tuple(copies)) for pid, copies in shared.items())


def _private(root: torch.nn.Module, path: str, others: set[int]) -> torch.nn.Module:
    """The module at ``path`` of ``root``, shallow-copied (with its parents) where another stage reaches it."""
    module = root
    for part in path.split(".") if path else ():
        child = module._modules[part]
        if id(child) in others:
            child = copy.copy(child)
            for attr in ("_parameters", "_buffers", "_modules"):
                object.__setattr__(child, attr, dict(getattr(child, attr)))
            module._modules[part] = child
        module = child
    return module


def _check_buffers_owned_once(programs: Sequence[StageProgram]) -> None:
    """A BatchNorm's running statistics change in its forward: they must live in one stage."""
    from graphpipe.runtime.batchnorm import ShardedBatchNorm

    owner: dict[int, tuple[int, str]] = {}
    for prog in programs:
        for name, m in prog.module.named_modules():
            if not isinstance(m, (ShardedBatchNorm, torch.nn.modules.batchnorm._BatchNorm)):
                continue
            if id(m) in owner and owner[id(m)][0] != prog.stage_id:
                s0, n0 = owner[id(m)]
                raise PlanError(f"BatchNorm {n0!r} is called by stages {s0} and {prog.stage_id}: its running statistics "
                                "must live in one stage; keep the ops that call it in one stage")
            owner[id(m)] = (prog.stage_id, name)


def instrument(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> torch.fx.GraphModule:
    """Add the ``rng_ctx`` placeholder and route every dropout and BatchNorm call through it (in place).

    With ``example_inputs`` the graph also runs once to find every other
    call drawing from the global generator, which then runs seeded per shard
    (:func:`~graphpipe.runtime.rng.instrument_random`). See the module
    docstring; returns ``gm``. Idempotent.
    """
    from graphpipe.runtime.batchnorm import instrument_batchnorm
    from graphpipe.runtime.rng import instrument_dropout, instrument_random

    nodes = list(gm.graph.nodes)
    if any(n.op == "placeholder" and n.name == CTX_NAME for n in nodes):
        return gm
    last = [n for n in nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(last[-1]) if last else gm.graph.inserting_before(nodes[0]):
        ctx = gm.graph.placeholder(CTX_NAME, default_value=None)
    instrument_dropout(gm, ctx)
    instrument_batchnorm(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    if example_inputs is not None and instrument_random(gm, ctx, example_inputs):
        gm.graph.lint()
        gm.recompile()
    return gm


class _Recorder(torch.fx.Interpreter):
    """Runs the whole captured graph and keeps the values named in ``keep``."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set[str]):
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = result
        return result


def boundary_meta(gm: torch.fx.GraphModule, values: Sequence[str],
                  make_inputs: Callable[[int, int], tuple], precision: str = "fp32") -> dict[str, ValueMeta]:
    """Per-sample shape and dtype of every boundary value.

    Runs the captured graph (no grad) at batch sizes 2 and 3: a value is
    batched when one dim follows the batch size and its other dims do not
    change (dim 0, or another: a sequence-first ``(seq, batch, dim)``, whose
    messages carry it batch-major); a value of the same shape at both sizes is unbatched
    (:class:`ValueMeta`). The executor relies on this to size receive buffers up front,
    so no shape message ever travels with the data. At ``bf16`` the graph
    runs under autocast, as the run does: a value's dtype is the one sent.
    Autocast does not act on meta tensors, so a graph on the meta device (a
    model materialized per stage) runs on fake CPU tensors there, its device
    literals moved to the CPU (:func:`~graphpipe.runtime.materialize.fake_cpu`).
    """
    import contextlib

    from graphpipe.runtime.materialize import fake_cpu, meta_nonzero

    keep = set(values)
    runs = []
    training = gm.training
    on_meta = any(t.device.type == "meta" for t in (*gm.parameters(), *gm.buffers()))
    gm.eval()  # shapes only: BatchNorm must not move its running statistics, dropout must not draw
    try:
        with (fake_cpu(gm) if on_meta and precision == "bf16" else contextlib.nullcontext(lambda x: x)) as convert, \
                torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), \
                meta_nonzero():
            for n in (2, 3):
                rec = _Recorder(gm, keep)
                rec.run(*[convert(x) for x in make_inputs(n, 0)])
                runs.append((n, rec.values))
    finally:
        gm.train(training)
    nodes = {n.name: n for n in gm.graph.nodes}
    from_inputs: set[str] = set()  # values that depend on a graph input (meta tensors cannot be compared)
    sizes_only = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in sizes_only:
            continue  # an input's size (a sequence length) is the same for every micro-batch of a step: not its rows
        if node.op == "placeholder" or any(str(a) in from_inputs for a in node.all_input_nodes):
            from_inputs.add(node.name)
    from graphpipe.frontend.shapes import data_dims

    by_data = data_dims(gm, values)  # dims sized by the values (a nonzero's count): they may differ anywhere
    meta = {}
    for name in values:
        got = [(n, vals.get(name)) for n, vals in runs]
        for n, value in got:
            if not isinstance(value, torch.Tensor):
                raise PlanError(f"fx value {name!r} crosses a stage boundary but is a {type(value).__name__}, not a "
                                "tensor; keep the op that produces it in the same stage as its users")
        (n0, v0), (n1, v1) = got
        loose = by_data.get(name, ())
        s0, s1 = tuple(v0.shape), tuple(v1.shape)
        if loose and len(s0) == len(s1):  # compare the dims the sizes give; a dim the data sizes may differ anyway
            s1 = tuple(s0[k] if k in loose else s1[k] for k in range(len(s1)))
        sized = {"sized_by_data": True} if loose else {}
        if s0 == s1:  # the same shape at two batch sizes: unbatched, carried whole
            # constant: computed from no input (parameters, buffers, literals); on real tensors it must also be
            # equal at both sizes (a value the graph builds from the inputs' shapes alone is not, say)
            from torch._subclasses.fake_tensor import FakeTensor

            shapes_only = v0.device.type == "meta" or isinstance(v0, FakeTensor)  # fake_cpu's run holds no values
            constant = name not in from_inputs and (shapes_only or (v0.shape == v1.shape and bool(torch.equal(v0, v1))))
            meta[name] = ValueMeta(s0, v0.dtype, batched=False, constant=constant,
                                   dims=_varying_dims(nodes.get(name), None), **sized)
            continue
        moved = [k for k in range(len(s0)) if s0[k] != s1[k]] if len(s0) == len(s1) else []
        k = moved[0] if len(moved) == 1 else None
        if k is None or s0[k] != n0 or s1[k] != n1:
            raise PlanError(f"fx value {name!r} crosses a stage boundary but no dim of it is the batch (shape "
                            f"{s0} at batch size {n0}, {tuple(v1.shape)} at {n1}); keep its producer "
                            "and users in one stage")
        meta[name] = ValueMeta(s0[:k] + s0[k + 1:], v0.dtype, batch_dim=k,
                               dims=_varying_dims(nodes.get(name), k), **sized)
    return meta


def _varying_dims(node: torch.fx.Node | None, batch_dim: int | None) -> tuple | None:
    """A boundary value's sample dims as the program's expressions (the batch dim dropped), when one of them
    varies between steps (a sequence length); None when all are fixed or the capture recorded no shape."""
    from graphpipe.frontend.shapes import node_shape

    rec = node_shape(node) if node is not None else None
    dims = rec[1] if rec is not None and rec[0] == "tensor" else None
    if dims is None:
        return None
    if batch_dim is not None:
        if batch_dim >= len(dims):
            return None
        dims = dims[:batch_dim] + dims[batch_dim + 1:]
    return dims if any(not isinstance(d, int) for d in dims) else None


def check_unbatched_edges(routing, meta: Mapping[str, ValueMeta]) -> None:
    """Refuse a row-dependent unbatched value on a stage edge whose shards do not match one to one, and a value
    sized by the data on an edge where a consumer shard joins rows of several producer shards.

    A constant unbatched value (a position table) is the same in every
    micro-batch, so a consumer shard may take it from any producer shard. One
    that depends on the rows (a mean over the micro-batch) is the value of one
    producer shard: it crosses only where every consumer shard is exactly
    one producer shard. A value sized by the data (the positions a shard kept) may have another size in each
    producer shard, so rows of two shards cannot be joined.
    """
    check_data_sized_edges(routing, [v for v, m in meta.items() if m.sized_by_data])
    for (p, c), values in routing.edge_values.items():
        loose = [v for v in values if not meta[v].batched and not meta[v].constant]
        if not loose:
            continue
        from graphpipe.runtime.routing import shard_size

        rows_p, rows_c = shard_size(routing.sg.stages[p]), shard_size(routing.sg.stages[c])
        if rows_p != rows_c or any(len(pieces) != 1 for (pp, cc, _, _), pieces in routing.by_consumer.items()
                                   if (pp, cc) == (p, c)):
            raise PlanError(f"fx value {loose[0]!r} (shape {meta[loose[0]].sample_shape}) crosses stage edge "
                            f"{p}->{c} without a batch dimension and depends on the rows, but the producer's shards "
                            f"hold {rows_p} rows and the consumer's {rows_c}: give both stages one micro-batch size "
                            "and replica layout, or keep its producer and users in one stage")


def check_data_sized_edges(routing, names) -> None:
    """Refuse a value of ``names`` (sized by the data, :func:`~graphpipe.frontend.shapes.data_dims`) on a stage
    edge where a consumer shard joins the rows of more than one producer shard: each shard's size of it is its
    own (the positions its rows kept), so the rows do not stack."""
    names = set(names)
    if not names:
        return
    for (p, c), values in routing.edge_values.items():
        sized = [v for v in values if v in names]
        if not sized:
            continue
        if any(len(pieces) != 1 for (pp, cc, _, _), pieces in routing.by_consumer.items() if (pp, cc) == (p, c)):
            sp, sc = routing.sg.stages[p], routing.sg.stages[c]
            raise PlanError(f"fx value {sized[0]!r} crosses stage edge {p}->{c} with a size that depends on the "
                            f"data (each producer shard's own), but a shard of stage {c} (micro-batch "
                            f"{sc.micro_batch_size} on {sc.num_replicas} device(s)) joins rows of several shards of "
                            f"stage {p} (micro-batch {sp.micro_batch_size} on {sp.num_replicas}): give the consumer "
                            "shards no more rows than the producer's, or keep its producer and users in one stage")


class BoundForward:
    """A stage module's forward with its tensors passed in, not looked up: ``BoundForward(gm)(*xs)`` computes
    ``gm(*xs)``.

    An exported graph reads every parameter with a ``get_attr`` node, which
    generated code turns into a chain of ``nn.Module.__getattr__`` calls
    (``self.branch0.layer3.fc1.weight``: four Python calls per tensor), on
    every forward of every micro-batch, and the call goes through
    ``nn.Module.__call__``. On a host-bound step (small kernels, a fast GPU)
    that is a visible share of the step. Here the graph is copied with those
    ``get_attr`` nodes turned into leading placeholders; each call reads the
    tensors from their owners' ``_parameters``/``_buffers`` dicts (one
    dictionary lookup each, so a parameter replaced later, by a checkpoint
    load or a device move, is still the one used) and calls the copy's
    ``forward``. Sub-module calls in the graph (BatchNorm, dropout kept as
    modules) run the same shared modules, so train/eval mode and running
    statistics are the stage module's. A graph whose code reads
    ``self.training`` or whose ``get_attr`` names something other than a tensor
    is not bound: :meth:`__call__` then calls the module itself.

    ``owners``: look the tensors up in this module instead of ``gm`` (a piece of a stage module, whose own
    attributes are copies of the references the stage module held when it was cut: an FSDP unit's parameters
    are swapped on the stage module's sub-modules, gathered and resharded, so they must be read there). Then
    every ``get_attr`` is bound, a plain attribute (a constant, a sub-graph) as the value it has now, and
    :attr:`bound` is None only for a graph that reads ``self.training``.
    """

    def __init__(self, gm: torch.fx.GraphModule, owners: torch.nn.Module | None = None):
        self.module = gm
        self.slots: list[tuple[dict, str]] = []
        self.bound: torch.fx.GraphModule | None = None
        root = gm if owners is None else owners
        reads = [n for n in gm.graph.nodes if n.op == "get_attr"]
        slots = []
        for node in reads:
            path, _, name = node.target.rpartition(".")
            try:
                owner = root.get_submodule(path) if path else root
            except AttributeError:
                return
            table = owner._parameters if name in owner._parameters else owner._buffers if name in owner._buffers \
                else None
            if table is None and owners is not None and hasattr(owner, name):
                table = {name: getattr(owner, name)}
            if table is None:  # a plain tensor attribute (a constant) or a sub-graph: keep the module call
                return
            slots.append((table, name))
        if "self.training" in gm.code:
            return
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, node in enumerate(reads):
            env[node] = graph.placeholder(f"_bound_{i}")
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                env[node] = graph.node_copy(node, lambda n: env[n])
        self.bound = torch.fx.GraphModule(gm, graph)
        self.slots = slots

    def __call__(self, *xs, **kwargs):
        if self.bound is None:
            return self.module(*xs, **kwargs)
        return self.bound.forward(*[table[name] for table, name in self.slots], *xs, **kwargs)
