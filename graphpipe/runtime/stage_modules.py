"""Cut a captured fx graph into one module per pipeline stage (DESIGN §8).

The capture (:mod:`graphpipe.capture`) maps every op of the
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
every stage that reads them (a trainable parameter read by two stages is
refused: its gradient would live on two ranks); any other node joins the
earliest stage that reads it; nodes nobody reads are dropped.

A *sequential* stage graph (``StageGraph.sequential``: SPP baselines) has
only chain edges; a value produced by stage ``p`` and read by stage
``c > p + 1`` is then relayed: every stage in between takes it as an input
and returns it unchanged (its gradient flows back the same way).

Every value crossing a stage boundary must be a tensor whose dim 0 is the
batch (it is sliced and concatenated along dim 0 when producer and consumer
micro-batch sizes or replica counts differ); :func:`boundary_meta` checks
that by running the model at two batch sizes.

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

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from graphpipe.errors import PlanError
from graphpipe.stages import StageGraph

__all__ = ["StageProgram", "ModelSplit", "ValueMeta", "split_model", "boundary_meta", "check_op_names"]

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


@dataclass(frozen=True, slots=True)
class ValueMeta:
    """A batch-major tensor crossing a stage boundary: shape without dim 0, and dtype."""

    sample_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def needs_grad(self) -> bool:
        """Gradients flow back only through floating-point values."""
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True, slots=True, eq=False)
class ModelSplit:
    programs: tuple[StageProgram, ...]
    sink_stage: int
    boundary_values: tuple[str, ...]
    """Every fx value some stage sends to another, in graph order."""


def check_op_names(plan_ops: Sequence[str], captured_ops: Sequence[str], model: str) -> None:
    """Refuse a plan whose op names are not exactly the capture's (before anything is launched)."""
    plan_set, cap_set = set(plan_ops), set(captured_ops)
    unknown = sorted(plan_set - cap_set)
    missing = sorted(cap_set - plan_set)
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} op(s) the model does not have: {', '.join(unknown[:6])}{' ...' if len(unknown) > 6 else ''}")
        if missing:
            parts.append(f"{len(missing)} op(s) of the model missing from the plan: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
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
    placeholders = [n for n in nodes if n.op == "placeholder"]
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
            if arg.op == "get_attr" and arg in attr_stages:
                continue
            if arg.op == "placeholder":
                needed[s][arg] = None
                continue
            p = node_stage.get(arg)
            if p is None or p == s:
                continue
            if getattr(sg, "sequential", False):
                # SPP: every stage between producer and consumer relays the value (DESIGN §6).
                for i in range(p, s):
                    sends.setdefault((i, i + 1), {})[arg] = None
                    needed[i + 1][arg] = None
                continue
            if (p, s) not in sg.edges:
                raise PlanError(f"fx value {arg.name!r} flows from stage {p} to stage {s}, but the plan has no stage edge "
                                f"{p}->{s}; the plan's graph and the captured model disagree (re-plan the model)")
            needed[s][arg] = None
            sends.setdefault((p, s), {})[arg] = None
    for node, stages in attr_stages.items():
        attr = _resolve_attr(gm, node.target)
        if isinstance(attr, torch.nn.Parameter) and attr.requires_grad and len(stages) > 1:
            raise PlanError(f"parameter {node.target!r} is read by stages {sorted(stages)}: a parameter shared between "
                            "stages is not supported; put its users in one stage")

    order = {n: i for i, n in enumerate(nodes)}
    programs = []
    for s in range(sg.num_stages):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs = sorted(needed[s], key=order.__getitem__)
        for arg in inputs:
            env[arg] = graph.placeholder(arg.name)
        for node in nodes:
            if node_stage.get(node) == s or (node in attr_stages and s in attr_stages[node]):
                env[node] = graph.node_copy(node, lambda a: env[a])
        consumers = sorted(c for (p, c) in sends if p == s)
        send_values = tuple((c, tuple(n.name for n in sorted(sends[(s, c)], key=order.__getitem__))) for c in consumers)
        sent_nodes = sorted({n for c in consumers for n in sends[(s, c)]}, key=order.__getitem__)
        model_out = torch.fx.node.map_arg(output_node.args[0], lambda a: env[a]) if s == sink else None
        graph.output((tuple(env[n] for n in sent_nodes), model_out))
        graph.lint()
        module = torch.fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        producers = sorted(p for (p, c) in sends if c == s)
        recv_values = tuple((p, tuple(n.name for n in sorted(sends[(p, s)], key=order.__getitem__))) for p in producers)
        programs.append(StageProgram(
            stage_id=s, module=module, input_names=tuple(a.name for a in inputs),
            model_inputs=tuple((a.name, input_index[a]) for a in inputs if a.op == "placeholder"),
            recv_values=recv_values, send_values=send_values, output_names=tuple(n.name for n in sent_nodes),
            is_sink=(s == sink)))
    _check_disjoint_parameters(programs)
    boundary = tuple(n.name for n in sorted({n for v in sends.values() for n in v}, key=order.__getitem__))
    return ModelSplit(tuple(programs), sink, boundary)


def _resolve_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _check_disjoint_parameters(programs: Sequence[StageProgram]) -> None:
    owner: dict[int, tuple[int, str]] = {}
    for prog in programs:
        for name, param in prog.module.named_parameters():
            if id(param) in owner and owner[id(param)][0] != prog.stage_id:
                s0, n0 = owner[id(param)]
                raise PlanError(f"parameter {n0!r} is used by stages {s0} and {prog.stage_id} (tied weights); "
                                "a parameter shared between stages is not supported: keep its users in one stage")
            owner[id(param)] = (prog.stage_id, name)


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
                  make_inputs: Callable[[int, int], tuple]) -> dict[str, ValueMeta]:
    """Per-sample shape and dtype of every boundary value.

    Runs the captured graph (no grad) at batch sizes 2 and 3: a value is
    batch-major when its dim 0 follows the batch size and its other dims do
    not change. The executor relies on this to size receive buffers up front,
    so no shape message ever travels with the data.
    """
    keep = set(values)
    runs = []
    with torch.no_grad():
        for n in (2, 3):
            rec = _Recorder(gm, keep)
            rec.run(*make_inputs(n, 0))
            runs.append((n, rec.values))
    meta = {}
    for name in values:
        shapes = []
        for n, vals in runs:
            value = vals.get(name)
            if not isinstance(value, torch.Tensor):
                raise PlanError(f"fx value {name!r} crosses a stage boundary but is a {type(value).__name__}, not a tensor; "
                                "keep the op that produces it in the same stage as its users")
            if value.dim() == 0 or value.shape[0] != n:
                raise PlanError(f"fx value {name!r} crosses a stage boundary but has no batch dimension "
                                f"(shape {tuple(value.shape)} at batch size {n}); keep its producer and users in one stage")
            shapes.append(tuple(value.shape[1:]))
        if shapes[0] != shapes[1]:
            raise PlanError(f"fx value {name!r}: per-sample shape changes with the batch size ({shapes[0]} vs {shapes[1]})")
        meta[name] = ValueMeta(shapes[0], runs[0][1][name].dtype)
    return meta
