"""Parallelism inside a stage, run on torch's own parts (docs/design.md, "Parallelism inside a stage").

A plan's stage may be parallel inside itself (:attr:`graphpipe.stages.Stage.tp`,
:attr:`~graphpipe.stages.Stage.shard`): its devices are ``num_replicas`` groups of
``tp`` consecutive ranks. This module executes such stages with torch's
well-kept pieces instead of hand-written collectives:

* **Meshes.** Every rank creates, in stage order, the process groups of every
  parallel stage (``new_group`` is collective over the world): one per
  tensor-parallel group (a row of the stage's ``replicas x tp`` grid) and one
  per data-parallel column; a rank of the stage wraps its two in 1-D
  :class:`~torch.distributed.device_mesh.DeviceMesh` objects, or in one 2-D
  mesh when the stage is both TP and FSDP (:meth:`DeviceMesh.from_group`),
  so no mesh creates groups of its own.
* **FSDP** (``shard: fsdp``), as the plan's ``reshard_after_forward``
  says. Resharding after forward (ZeRO-3): the stage's graph is cut into one
  piece per op, each an FSDP unit (:func:`_fsdp_units`, :class:`_Unit`) over
  the replica mesh, so FSDP's own hooks gather one op's weights at a time and
  reduce-scatter every micro-batch's gradients into the shards. Gathering once
  per step: the stage is one unit and, as :mod:`torch.distributed.pipelining`'s
  stage does, every backward of a step runs without gradient synchronisation
  (gradients accumulate unsharded, parameters stay gathered until the step's
  last backward) and the stage's reduce-scatter is started by hand after its
  last B. Gradients are summed (divide factor 1), like graphpipe's own replica
  all-reduce, because each replica's loss term is already scaled by its share
  of the mini-batch. Schedules splitting the backward run the per-step
  layout; resharding after forward under them is refused
  (:mod:`graphpipe.runtime.layouts`).
* **Eager gather.** A stage gathered for the step starts its all-gather at the
  step's start (:meth:`IntraStage.before_iteration`, FSDP's
  ``unshard(async_op=True)``), as the cost model has it: at time 0, overlapping
  the pipeline's fill, rather than when the stage's first micro-batch arrives.
  Its first forward's pre-forward hook finds the gather pending and waits for it
  (the replica group's timeout) instead of issuing another; every replica calls
  it at the same point, so the collective matches.
* **Round-robin FSDP.** A round-robin stage (replicas, or groups of ``split``
  replicas, taking whole micro-batches in turn) may be FSDP-sharded gathered for
  the step, tp 1 or 2-D: one unit over all its replicas, exactly as above.
  Its replicas run different micro-batches at different times but start and
  end the step together: each gathers at the step's start and reduce-scatters
  after its own last B or W (where the executor calls
  :meth:`IntraStage.after_last_backward`, as a whole-copy replica issues its
  all-reduce), the sum of every replica's gradients, each already scaled by its
  micro-batches' share. Unlike that all-reduce, FSDP's reduce-scatter holds the
  replica (a gloo rank's host, a CUDA rank's stream) until the last replica gets
  there; with nothing else after the stage's last backward on a device, that
  only delays the step's end, and a plan where another stage's action follows
  it is refused (:mod:`graphpipe.runtime.layouts`). Round-robin stages have at
  least one micro-batch per replica (:class:`~graphpipe.stages.StageGraph`),
  so every replica reaches the reduce-scatter.
* **Tensor parallelism** (tp > 1, shard none). The stage's parameters become
  :class:`~torch.distributed.tensor.DTensor` on the TP mesh (``Shard(0)`` for
  column-wise linear weights and biases, ``Shard(1)`` for row-wise weights,
  the other dimension of a transposed layer's ``(in, out)`` weight (GPT-2's
  ``Conv1D``), ``Replicate`` otherwise, :func:`tp_placements`); the stage's inputs enter as
  ``Replicate`` DTensors and its outputs leave as plain tensors
  (``full_tensor``). DTensor's sharding propagation runs every captured op
  on global shapes, so a captured graph's literal shapes stay right and an op
  that cannot split runs replicated; a row-wise layer's Partial output is
  all-reduced right after it (:func:`replicated`, Megatron's place for it). Replicas' gradients are all-reduced over
  the mesh's replica dimension (local shards, one collective per parameter).
  With ``sequence_parallel`` (Korthikanti et al. 2022) that all-reduce is a reduce-scatter along the tokens
  (:func:`token_sharded`), the residual stream is split where it enters whole (:func:`token_split`), each
  column-wise layer's input is all-gathered (:func:`gathered`) and kept as this device's piece for backward
  (:class:`Regather`), so the norms and adds between them keep a tp-th of the tokens.

* **Both** (tp > 1, shard fsdp: 2-D inside the stage, torchtitan's dp x tp
  layout per stage). The TP parameters above, then the stage as one FSDP unit
  over the replica columns of one 2-D mesh (FSDP shards a DTensor parameter
  only over a mesh sharing its TP mesh's parent); its gradients are fixed to
  their parameters' TP layout before FSDP's reduce-scatter after the last B.

A parameter tied across stages (a GPT's embedding and output head) may sit on
a parallel stage: its copies' gradients are summed whole across the stages
(:func:`whole_gradient`, :func:`as_local_like`), each device keeping its piece.
Refused in one line, before a step: a TP degree that does not divide a model's
attention heads (naming the projection); the rest in
:mod:`graphpipe.runtime.layouts`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import logging
import re
import warnings
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from graphpipe.errors import PlanError
from graphpipe.runtime.dtensors import like, local_pair
from graphpipe.stages import Stage, StageGraph

__all__ = ["StageMeshes", "build_stage_meshes", "tp_placements", "parallelize_stage",
           "IntraStage", "full_value", "local_pair", "attach", "like", "counts_here", "eval_ranks", "replica_lead", "replica_ranks"]

log = logging.getLogger(__name__)


def replica_ranks(stage: Stage, replica: int) -> tuple[int, ...]:
    """The ranks of ``stage``'s replica ``replica``: its tensor-parallel group (one rank when tp is 1)."""
    return stage.tp_groups[replica]


def replica_lead(stage: Stage, replica: int) -> int:
    """The rank that sends replica ``replica``'s messages (its TP group's first)."""
    return stage.tp_groups[replica][0]


def eval_ranks(stage: Stage) -> tuple[int, ...]:
    """The ranks that run ``stage`` in an evaluation forward (once, whole batch): its first rank, its first
    TP group for a TP stage, every rank of an FSDP stage (each holds a shard the gather needs)."""
    return stage.devices if stage.shard == "fsdp" else stage.tp_groups[0]


@dataclass(frozen=True, slots=True)
class StageMeshes:
    """One parallel stage's meshes on a rank of it: ``tp`` (its TP group) and ``dp`` (its replica column)."""

    stage_id: int
    tp: Any
    """1-D DeviceMesh over this rank's TP group (None when the stage's tp is 1)."""
    dp: Any
    """1-D DeviceMesh over the ranks at this rank's TP position in every replica (None with one replica)."""
    dp_group: Any = None


def build_stage_meshes(sg: StageGraph, rank: int, device_type: str, timeout_s: float) -> dict[int, StageMeshes]:
    """Stage -> :class:`StageMeshes` of every parallel stage ``rank`` hosts.

    Collective: every rank of the world calls it with the same stage graph, and creates every group of every
    parallel stage in the same order (TP rows, then replica columns, stage by stage).
    """
    from torch.distributed.device_mesh import DeviceMesh

    timeout = timedelta(seconds=timeout_s)
    out: dict[int, StageMeshes] = {}
    for stage in sg.stages:
        if not stage.parallel:
            continue
        rows = stage.tp_groups
        tp_group = dp_group = None
        if stage.tp > 1:
            for row in rows:
                g = dist.new_group(list(row), timeout=timeout)
                if rank in row:
                    tp_group = g
        if stage.num_replicas > 1:
            for j in range(stage.tp):
                column = [row[j] for row in rows]
                g = dist.new_group(column, timeout=timeout)
                if rank in column:
                    dp_group = g
        if rank not in stage.devices:
            continue
        if tp_group is not None and dp_group is not None and stage.shard == "fsdp":
            # 2-D (TP rows, FSDP over the replica columns): one mesh of both, as FSDP requires of a DTensor
            # parameter's TP mesh and its own (torchtitan's dp x tp mesh, per stage here)
            grid = DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=torch.tensor([list(r) for r in rows]),
                                         mesh_dim_names=("dp", "tp"))
            out[stage.id] = StageMeshes(stage.id, grid["tp"], grid["dp"], dp_group)
            continue
        out[stage.id] = StageMeshes(
            stage.id,
            DeviceMesh.from_group(tp_group, device_type) if tp_group is not None else None,
            DeviceMesh.from_group(dp_group, device_type) if dp_group is not None else None,
            dp_group)
    return out


# ---------------------------------------------------------------- tensor-parallel placements
def _target(node) -> str:
    return str(node.target) if node.op == "call_function" else ""


_LAYERS = {"aten.linear.default": (1, 0, 2), "aten.addmm.default": (2, 1, 0)}
"""Linear layers in a captured graph: target -> (weight, input, bias) argument positions. ``aten.linear(x, w, b)``
is ``nn.Linear`` (weight ``(out, in)``); ``aten.addmm(b, x, w)`` with ``w`` read straight from a parameter is a
transposed layer (weight ``(in, out)``: Hugging Face's ``Conv1D`` in GPT-2), whose styles end in ``T``."""


def _weight_of(node) -> str | None:
    """The ``get_attr`` target of a linear layer's weight (:data:`_LAYERS`), or None."""
    at = _LAYERS.get(_target(node))
    if at is None or len(node.args) <= at[0]:
        return None
    w = node.args[at[0]]
    return w.target if getattr(w, "op", None) == "get_attr" else None


def _input_of(node):
    return node.args[_LAYERS[_target(node)][1]]


def _transposed(node) -> bool:
    return _target(node) == "aten.addmm.default"


def _out_dim(node) -> int:
    """The weight dimension of a layer's output features (what a column-wise split cuts)."""
    return 1 if _transposed(node) else 0


def _bias_of(node) -> str | None:
    at = _LAYERS[_target(node)][2]
    b = node.args[at] if len(node.args) > at else node.kwargs.get("bias")
    return b.target if getattr(b, "op", None) == "get_attr" else None


_SPLIT_DIM = {"col": 0, "row": 1, "colT": 1, "rowT": 0}
"""Style -> the weight dimension it splits (a 1-D bias: its only one)."""


def _hf_model(model: nn.Module | None) -> tuple[str, nn.Module] | None:
    """``(path, module)`` of the first Hugging Face model inside ``model`` whose config has a TP plan."""
    if model is None:
        return None
    for path, module in model.named_modules():
        if getattr(getattr(module, "config", None), "base_model_tp_plan", None):
            return path, module
    return None


def _hf_rules(model: nn.Module | None) -> list[tuple[str, str]]:
    """``(module pattern in the whole model's names, style)`` of a Hugging Face model's ``base_model_tp_plan``,
    or ``[]``: its patterns are relative to the base model (``layers.*.self_attn.q_proj``)."""
    found = _hf_model(model)
    if found is None:
        return []
    path, hf = found
    prefix = ".".join(p for p in (path, getattr(hf, "base_model_prefix", "") or "") if p)
    if prefix and not any(n == prefix or n.startswith(prefix + ".") for n, _ in model.named_modules()):
        prefix = path  # the model found is the base model itself
    return [(f"{prefix}.{pattern}" if prefix else pattern, style)
            for pattern, style in hf.config.base_model_tp_plan.items()]


def _heads(model: nn.Module | None) -> dict[str, int]:
    found = _hf_model(model)
    config = found[1].config if found is not None else getattr(model, "config", None)
    out = {}
    for key in ("num_attention_heads", "num_key_value_heads"):
        v = getattr(config, key, None)
        if isinstance(v, int):
            out[key] = v
    return out


def tp_placements(gm: torch.fx.GraphModule, param_names: dict[str, str], tp: int, stage_id: int,
                  model: nn.Module | None = None) -> dict[str, str]:
    """Stage parameter name -> ``"col"`` (Shard(0)), ``"row"`` (Shard(1) weight), ``"colT"``/``"rowT"`` (the same
    splits of a transposed layer's ``(in, out)`` weight: Shard(1)/Shard(0)) or ``"rep"`` (Replicate).

    With a Hugging Face model whose config carries ``base_model_tp_plan``,
    its ``colwise``/``rowwise`` layers are the split ones. Otherwise the
    captured graph decides (Megatron's pairing): a linear whose output
    reaches another linear without passing a third is column-wise, the one it
    reaches row-wise, so the pair needs one all-reduce (DTensor inserts it). A
    linear whose output features ``tp`` does not divide stays replicated.
    Refuses (:class:`PlanError`) a ``tp`` that does not divide a model's
    attention or key/value heads, naming the projection it would split.
    """
    names = {n: param_names.get(n, n) for n, _ in gm.named_parameters()}
    params = dict(gm.named_parameters())
    styles: dict[str, str] = {n: "rep" for n in names}
    linears = [n for n in gm.graph.nodes if _weight_of(n) is not None]
    rules = _hf_rules(model)
    heads = _heads(model)
    if rules:
        for node in linears:
            w = _weight_of(node)
            module = names[w].rpartition(".")[0]
            style = next((s for pat, s in rules if fnmatch.fnmatchcase(module, pat)), None)
            if style in ("colwise", "rowwise"):
                _assign(styles, node, "col" if style == "colwise" else "row")
    else:
        users: dict[Any, list] = {}
        for node in gm.graph.nodes:
            for a in node.all_input_nodes:
                users.setdefault(a, []).append(node)
        row_of: dict[Any, list] = {}
        for node in linears:  # the first linears its output reaches
            seen, frontier, reached = set(), list(users.get(node, ())), []
            while frontier:
                n = frontier.pop()
                if n in seen:
                    continue
                seen.add(n)
                if _weight_of(n) is not None:
                    if _input_of(n) in seen or _input_of(n) is node:
                        reached.append(n)
                    continue
                if n.op == "output":
                    continue
                frontier.extend(users.get(n, ()))
            row_of[node] = reached
        assigned: set = set()
        for node in linears:
            if node in assigned:
                continue
            for row in row_of[node]:
                if row in assigned:
                    continue
                cols = [c for c in linears if row in row_of[c] and c not in assigned]
                if all(_splits(params[_weight_of(c)], _out_dim(c), tp) for c in cols) and \
                        _splits(params[_weight_of(row)], 1 - _out_dim(row), tp):
                    for c in cols:
                        _assign(styles, c, "col")
                        assigned.add(c)
                    _assign(styles, row, "row")
                    assigned.add(row)
                break
    for n, style in styles.items():  # the split must be one the weights (and the model's heads) can take
        if style == "rep" or n not in params:
            continue
        dim = _SPLIT_DIM[style]
        if params[n].dim() >= 1 and not _splits(params[n], dim if params[n].dim() > 1 else 0, tp):
            raise PlanError(f"stage {stage_id} with tp {tp}: op {names[n].rpartition('.')[0]} cannot split "
                            f"{tuple(params[n].shape)} by {tp} ({'column' if style.startswith('col') else 'row'}-wise); "
                            f"choose a tp that divides it")
        for key, count in heads.items():  # query heads split with q/o, key/value heads (GQA groups) with k/v
            which = r"(k|v|key|value)" if key == "num_key_value_heads" else r"(q|o|qkv|query)"
            if count % tp and re.search(rf"(^|\.){which}(_proj)?\.", names[n]):
                raise PlanError(f"stage {stage_id} with tp {tp}: op {names[n].rpartition('.')[0]} splits attention "
                                f"by heads, but {key} is {count}, which {tp} does not divide; choose a tp that "
                                "divides it")
    return styles


def replicated(x):
    """``x`` all-reduced where it is a Partial DTensor (a row-wise layer's output: Megatron's all-reduce),
    anything else as is."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, DTensor) and any(p.is_partial() for p in x.placements):
        return x.redistribute(placements=[Replicate()] * len(x.placements))
    return x


def token_sharded(x):
    """Sequence parallelism's reduce-scatter (Korthikanti et al. 2022 §4.2.2): ``x``, a Partial DTensor (a row-wise
    layer's output), summed and split over the tp group along its token dimension (:func:`_token_dim`), or
    all-reduced where none divides; anything else as is. The norms, residual adds and dropout after it then keep
    a tp-th of the tokens each."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not (isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)):
        return x
    dim = _token_dim(x)
    return x.redistribute(placements=[Replicate() if dim is None else Shard(dim)] * len(x.placements))


def _token_dim(x) -> int | None:
    """The dimension sequence parallelism splits ``x`` along: the last but one (a ``(batch, seq, hidden)``
    tensor's sequence) where the group divides it evenly, else the nearest one before it that it divides; None
    where none does."""
    size = x.device_mesh.size()
    return next((d for d in range(x.dim() - 2, -1, -1) if x.shape[d] % size == 0 and x.shape[d] >= size), None)


def token_split(x):
    """The residual stream entering sequence parallelism whole (a TP stage's input, an embedding's output):
    ``x``, a Replicate floating-point DTensor, split along its token dimension on each device (no
    communication: every device keeps its piece), so that the norms and residual adds on it keep a tp-th as
    they do after a row-wise layer; anything else as is."""
    from torch.distributed.tensor import DTensor, Shard

    if not (isinstance(x, DTensor) and x.dtype.is_floating_point and x.dim() >= 2
            and all(p.is_replicate() for p in x.placements)):
        return x
    dim = _token_dim(x)
    return x if dim is None else x.redistribute(placements=[Shard(dim)] * len(x.placements))


def gathered(x):
    """Sequence parallelism's all-gather before a column-wise layer: ``x`` whole on every device of the group
    where it is a token-sharded DTensor (its backward: the input gradient's reduce-scatter); anything else as
    is. Inside :class:`Regather` (a TP stage's forward) the layer saves the whole tensor as ``x``'s shard."""
    from torch.distributed.tensor import DTensor, Replicate

    if not (isinstance(x, DTensor) and any(p.is_shard() for p in x.placements)):
        return x
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.dtype == torch.float32:
        # autocast would cast the gathered input for the layer into new memory, which autograd then saves whole
        # (out of Regather's sight): cast the piece first, as Megatron gathers in the compute precision
        x = x.to(torch.get_autocast_dtype(kind))
    whole = x.redistribute(placements=[Replicate()] * len(x.placements))
    if Regather.active is not None:
        Regather.active.note(x, whole)
    return whole


@dataclass
class _Gathered:
    whole: Any  # weakref to the gathered local tensor: the entry stands while it lives
    shard: torch.Tensor  # this device's piece, kept instead
    dim: int
    mesh: Any
    saves: int = 0  # views of it autograd saved (q, k and v each save the one input)
    unpacked: int = 0  # unpacks so far; every ``saves`` of them share one gather
    again: Any = None  # the input gathered again, while a pass's unpacks of it are pending


@dataclass
class _Regathered:
    """What autograd keeps for a view of a gathered tensor: its entry and the view's layout (local and global)."""
    entry: _Gathered
    size: tuple
    stride: tuple
    offset: int
    placements: Any = None  # None: the saved tensor was the local tensor itself, not a DTensor
    shape: Any = None
    global_stride: Any = None


class Regather:
    """Sequence parallelism's memory half (Korthikanti et al. 2022 §4.2.3): a column-wise layer saves its input
    for the weight gradient, and under sequence parallelism that input is all-gathered (:func:`gathered`); kept
    whole, it would cost every device the tokens the split saved. While a TP stage's forward runs inside this
    context, autograd saves any view of a gathered tensor as this device's shard, and the backward gathers it
    again when it needs it (one more all-gather per column-wise input, as in Megatron-LM). The TP ranks of a
    group run the same graph, so their extra all-gathers come in the same order. Used where
    :attr:`Stage.regathers <graphpipe.stages.Stage.regathers>`: not on a re-materializing stage (torch's
    checkpoint takes the saved tensors itself, and its rebuild inside backward keeps the gathered inputs whole)
    nor on one keeping them whole (``keep_gathered``), both charged so (:data:`graphpipe.costs.TP_REBUILT_INPUTS`)."""

    active: "Regather | None" = None

    def __init__(self):
        self.entries: dict[int, _Gathered] = {}

    def note(self, shard_dt, whole_dt) -> None:
        import weakref

        local, mesh = whole_dt._local_tensor, shard_dt.device_mesh
        if (mesh.ndim != 1 or local.device.type == "meta" or not local.is_contiguous() or local.storage_offset()
                or not local.untyped_storage().data_ptr()):
            return
        dim = next(p.dim for p in shard_dt.placements if p.is_shard())
        if shard_dt._local_tensor.shape[dim] * mesh.size() != local.shape[dim]:
            return  # uneven pieces: unpack gathers equal ones
        self.entries[local.untyped_storage().data_ptr()] = _Gathered(weakref.ref(local),
                                                                     shard_dt._local_tensor.detach(), dim, mesh)

    def pack(self, t):
        from torch.distributed.tensor import DTensor

        local = t._local_tensor if isinstance(t, DTensor) else t
        if (not isinstance(local, torch.Tensor) or not local.numel() or local.layout != torch.strided
                or local.device.type == "meta"):
            return t
        ptr = local.untyped_storage().data_ptr()
        entry = self.entries.get(ptr)
        whole = entry.whole() if entry is not None else None
        if whole is None or whole.untyped_storage().data_ptr() != ptr:
            return t
        entry.saves += 1
        if isinstance(t, DTensor):
            return _Regathered(entry, local.size(), local.stride(), local.storage_offset(), t.placements, t.shape,
                               t.stride())
        return _Regathered(entry, local.size(), local.stride(), local.storage_offset())

    @staticmethod
    def unpack(saved):
        """The saved view, from its input gathered again: once for all the layers that saved the one input (a
        backward pass unpacks each of them once; the gathered tensor is dropped after the last), so backward
        gathers once per column-wise input, as forward did."""
        if not isinstance(saved, _Regathered):
            return saved
        from torch.distributed.tensor import DTensor

        e = saved.entry
        if e.again is None:
            group = e.mesh.get_group()
            pieces = [torch.empty_like(e.shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, e.shard.contiguous(), group=group)
            e.again = torch.cat(pieces, dim=e.dim)
        whole = e.again
        e.unpacked += 1
        if e.unpacked % e.saves == 0:
            e.again = None
        local = whole.as_strided(saved.size, saved.stride, saved.offset)
        if saved.placements is None:
            return local
        return DTensor.from_local(local, e.mesh, saved.placements, run_check=False, shape=saved.shape,
                                  stride=saved.global_stride)

    def __enter__(self):
        self.previous, Regather.active = Regather.active, self
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        Regather.active = self.previous
        self.entries = {}


def _reduce_after_rows(gm: torch.fx.GraphModule, styles: dict[str, str], sequence_parallel: bool = False) -> bool:
    """Put :func:`replicated` (:func:`token_sharded` with ``sequence_parallel``) after every row-wise linear of
    ``gm``, and with ``sequence_parallel`` :func:`token_split` where the residual stream enters whole and one
    :func:`gathered` before each distinct input of the column-wise layers (in place); whether it changed ``gm``.

    Without it DTensor's sharding propagation, choosing op by op, lets a row-wise layer's Partial output flow
    on (a residual add stays Partial, the next column-wise layer then gathers its weights instead of splitting
    its output), and a later reshape of a head-split attention output fails ("view size is not compatible")
    where its local layout differs from the global one. Megatron all-reduces right there; so does this, and
    the layers that follow see Replicate inputs, as the cost model prices them. Under sequence parallelism they
    see token-sharded inputs up to the next column-wise layers, which gather them whole again: once for all
    the layers reading one input (attention's q, k and v; the MLP's gate and up), as Megatron does. A row-wise
    layer whose output is reshaped back (GPT-2's ``Conv1D``: ``addmm`` on the flattened tokens, then a view
    to ``(batch, seq, hidden)``) reduce-scatters after the reshape, so that it splits the same dimension as
    the stream it is added to."""
    rows = [n for n in gm.graph.nodes if styles.get(_weight_of(n) or "") in ("row", "rowT")]
    for node in rows:
        last = node
        while sequence_parallel and len(last.users) == 1 and _target(next(iter(last.users))) in _FLATTENS:
            last = next(iter(last.users))
        with gm.graph.inserting_after(last):
            reduced = gm.graph.call_function(token_sharded if sequence_parallel else replicated, (last,))
        reduced.meta = dict(last.meta)
        last.replace_all_uses_with(reduced, delete_user_cb=lambda user, r=reduced: user is not r)
    streams = []  # the residual stream where it is whole: what a row-wise layer's split output is added to
    for node in gm.graph.nodes if sequence_parallel else ():
        if node.target is not token_sharded:
            continue
        chain, users = {node}, list(node.users)  # through dropout (GPT-2's resid_dropout) and reshapes
        while any(_passes(gm, u) for u in users):
            chain |= {u for u in users if _passes(gm, u)}
            users = [v for u in users for v in (u.users if _passes(gm, u) else (u,))]
        streams += [a for user in users if _target(user) in _ADDS for a in user.args
                    if isinstance(a, torch.fx.Node) and a not in chain]
    for source in dict.fromkeys(streams):
        with gm.graph.inserting_after(source):
            split = gm.graph.call_function(token_split, (source,))
        split.meta = dict(source.meta)
        source.replace_all_uses_with(split, delete_user_cb=lambda user, n=split: user is not n)
    cols = ([n for n in gm.graph.nodes if styles.get(_weight_of(n) or "") in ("col", "colT")]
            if sequence_parallel else [])
    readers: dict = {}  # input -> the nodes reading it for a column-wise layer: one gather per distinct input
    for node in cols:
        at = _LAYERS[_target(node)][1]
        user, source = node, node.args[at]
        while _target(source) in _FLATTENS and len(source.users) == 1:  # GPT-2's Conv1D: view(x, (-1, in))
            user, source = source, source.args[0]
        readers.setdefault(source, []).append(user)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for source, users in readers.items():
        with gm.graph.inserting_before(min(users, key=order.__getitem__)):  # after any in-place write before it
            whole = gm.graph.call_function(gathered, (source,))
        whole.meta = dict(getattr(source, "meta", {}))
        for user in users:
            user.replace_input_with(source, whole)
    if rows or cols or streams:
        gm.recompile()
    return bool(rows or cols or streams)


_ADDS = ("aten.add.Tensor", "aten.add_.Tensor")
"""Residual adds: where a row-wise layer's output meets the stream it came from (:func:`token_split`)."""

_FLATTENS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
"""Reshapes between a column-wise layer and its input that :func:`gathered` goes before: a token-split tensor
reshaped first would be gathered inside DTensor's reshape, out of reach of :class:`Regather`."""


def _passes(gm: torch.fx.GraphModule, node) -> bool:
    """Whether ``node`` hands a row-wise layer's output on to the residual add unchanged in layout: a reshape
    (:data:`_FLATTENS`) or a dropout (:func:`graphpipe.frontend.capture.dropout_p`: a module, or the function
    the runtime puts in a functional dropout's place)."""
    from graphpipe.frontend.capture import dropout_p

    return _target(node) in _FLATTENS or dropout_p(gm, node) is not None


def _splits(p: torch.Tensor, dim: int, tp: int) -> bool:
    return p.dim() > dim and p.shape[dim] % tp == 0 and p.shape[dim] >= tp


def _assign(styles: dict[str, str], node, style: str) -> None:
    styles[_weight_of(node)] = style + ("T" if _transposed(node) else "")
    bias = _bias_of(node)
    if bias is not None:
        styles[bias] = "col" if style == "col" else "rep"


# ---------------------------------------------------------------- stage wrappers
class _TPForward:
    """A TP stage's forward: inputs as Replicate DTensors on the TP mesh, outputs back as plain tensors."""

    def __init__(self, inner, mesh, regather: bool = False):
        self.inner, self.mesh, self.regather = inner, mesh, regather

    def __call__(self, *xs):
        from torch.distributed.tensor import DTensor, Replicate

        args = [DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in xs]
        # constants and buffers made inside the graph are the same on every rank of the group: plain tensors are
        # Replicate, in this forward and in the backward (which reads the flag where it runs; torch's
        # ``implicit_replication()`` context would reset it before the backward)
        torch._C._set_dtensor_allow_implicit_replication(True)
        with Regather() if self.regather else contextlib.nullcontext():
            sent, out = self.inner(*args)
        return tuple(full_value(t) for t in sent), torch.utils._pytree.tree_map(full_value, out)


def counts_here(stage: Stage, rank: int, params) -> list:
    """The parameters of parallel stage ``stage`` this rank counts once in global sums (a gradient norm, a
    checkpoint): FSDP, every rank's shard; TP, the first replica's shards, a replicated one on its first rank."""
    if stage.shard == "fsdp" and stage.tp == 1:
        return list(params)
    if stage.shard == "fsdp" and stage.num_replicas > 1:
        # 2-D: every rank's FSDP shard counts, a TP-replicated parameter's on the first rank of each TP group only
        lead = any(rank == row[0] for row in stage.tp_groups)
        return [p for p in params if lead or not _tp_replicated(p)]
    if rank not in stage.tp_groups[0]:
        return []
    lead = rank == stage.tp_groups[0][0]
    return [p for p in params if lead or not _tp_replicated(p)]


def _tp_replicated(p) -> bool:
    """Whether DTensor ``p`` is whole on its TP mesh dimension (the last of its mesh); plain tensors are."""
    from torch.distributed.tensor import DTensor, Replicate

    return not isinstance(p, DTensor) or isinstance(p.placements[-1], Replicate)


def full_value(t):
    """A DTensor as the plain (replicated) tensor it stands for, differentiably; anything else as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class _ShardedCall(nn.Module):
    """The module ``fully_shard`` wraps: the stage module as its child, its bound forward as its forward (so
    FSDP's hooks run around graphpipe's parameter-passing call)."""

    def __init__(self, module: nn.Module, forward):
        super().__init__()
        self.stage = module
        object.__setattr__(self, "_call", forward)

    def forward(self, *xs):
        return self._call(*xs)


@dataclass(eq=False)
class _Parallel:
    stage: Stage
    meshes: StageMeshes
    hosted: Any
    fsdp: nn.Module | None = None
    per_op: bool = False
    """FSDP with one unit per op (ZeRO-3, reshard after forward): gathered, resharded and reduce-scattered per
    micro-batch by FSDP's own hooks; nothing for :class:`IntraStage`'s step hooks to do."""
    pending: Any = None
    """The last step's early all-gather (FSDP's ``UnshardHandle``), gathered for the step only."""

    @property
    def gathered_for_step(self) -> bool:
        """One FSDP unit kept gathered from the step's start to its last backward (reshard_after_forward
        false): :meth:`IntraStage.before_iteration` gathers it early."""
        return self.fsdp is not None and not self.per_op and not self.stage.reshard_after_forward


class _Unit(nn.Module):
    """One FSDP unit of an FSDP stage cut per op: the stage sub-modules owning the unit's parameters as its
    children (the same module objects the stage module holds, so FSDP swaps the parameters everyone reads),
    a bound piece of the stage's graph (:class:`~graphpipe.runtime.stage_modules.BoundForward` over the
    stage module) as its forward."""

    def __init__(self, owners: list[nn.Module], run):
        super().__init__()
        self.owners = nn.ModuleList(owners)
        object.__setattr__(self, "_run", run)

    def forward(self, *xs):
        return self._run(*xs)


class _UnitChain(nn.Module):
    """An FSDP stage's forward as its per-op pieces called in order (the root FSDP module; every piece that
    reads parameters is a :class:`_Unit`, whose hooks gather them just before it runs)."""

    def __init__(self, segments, calls, assemble, gathers, input_names):
        super().__init__()
        self.units = nn.ModuleList([c for c in calls if isinstance(c, nn.Module)])
        # the values no later piece (nor the assembly) reads, dropped after each piece as fx's code would
        kept = set(gathers)
        drop = []
        for seg in reversed(segments):
            drop.append(tuple(n for n in seg.input_names if n not in kept))
            kept.update(seg.input_names)
        steps = tuple(zip(segments, calls, reversed(drop)))
        object.__setattr__(self, "_plan", (steps, assemble, tuple(gathers), tuple(input_names)))

    def forward(self, *xs):
        steps, assemble, gathers, input_names = self._plan
        env = dict(zip(input_names, xs))
        ctx = xs[len(input_names)] if len(xs) > len(input_names) else None  # an evaluation passes none
        for seg, call, done in steps:
            got = call(*(env[n] for n in seg.input_names), ctx)
            for n in done:
                env.pop(n, None)
            env.update(zip(seg.output_names, got))
        return assemble(*(env[n] for n in gathers))


def _fsdp_units(module: torch.fx.GraphModule, op_of) -> list | None:
    """An FSDP stage module cut into per-op units: ``[(segment, bound forward, owner modules)]`` plus the
    assembly, or None where it cannot be (one op, a graph reading ``self.training``).

    One segment per op (:func:`~graphpipe.runtime.stage_modules.segment_stage`), consecutive segments merged
    where they read parameters of one module (its parameters shard as one unit): so a rank gathers one op's
    weights at a time, the memory the planner charges (:func:`graphpipe.costs.layout_state_bytes`)."""
    from graphpipe.runtime.stage_modules import BoundForward, clone_mutated_inputs, segment_stage, view_root

    def param_owner(target: str) -> str | None:
        """The path of the module owning parameter ``target`` (None: ``target`` is no parameter)."""
        path, _, name = target.rpartition(".")
        return path if name in module.get_submodule(path)._parameters else None

    def owner_paths(seg) -> set[str]:
        return {path for n in seg.module.graph.nodes if n.op == "get_attr"
                for path in [param_owner(n.target)] if path is not None}

    ops = sorted({op_of[n.name] for n in module.graph.nodes
                  if n.op not in ("placeholder", "get_attr", "output") and n.name in op_of})
    if len(ops) < 2:
        return None
    owned = [owner_paths(seg) for seg in segment_stage(module, op_of, ops[1:])["segments"]]
    last = {path: j for j, paths in enumerate(owned) for path in paths}  # owner -> last piece reading it
    cuts, reach = [], -1
    for j, paths in enumerate(owned):
        if j > 0 and j > reach:
            cuts.append(ops[j])
        reach = max([reach, j, *(last[p] for p in paths)])
    cut = segment_stage(module, op_of, cuts)
    units = []
    for seg in cut["segments"]:
        # a piece writing in place into a value an earlier piece made (or a view of one) would write through the
        # earlier unit's output, dropping its backward hook, and a clone would not reach the value's other
        # readers: such a stage stays one unit
        if clone_mutated_inputs(seg.module.graph):
            return None
        out = next(n for n in seg.module.graph.nodes if n.op == "output")
        roots = [view_root(a) for a in out.args[0] if isinstance(a, torch.fx.Node)]
        if any(r.op == "get_attr" and param_owner(r.target) is not None for r in roots):
            return None  # a piece handing on its weights or a view of them: one unit for the stage
        bound = BoundForward(seg.module, owners=module)
        if bound.bound is None:
            return None
        owners = [module.get_submodule(p) for p in sorted(owner_paths(seg))]
        # the piece's own module holds references to the stage's whole tensors as they were when it was cut:
        # kept, they would keep every unsharded parameter alive beside its shards; only the bound copy stays
        bound.module = bound.bound
        units.append((replace(seg, module=bound.bound), bound, owners))
    return [units, cut["assemble"], cut["gathers"]]


def _shard_per_op(hosted, meshes: StageMeshes, op_of) -> nn.Module | None:
    """FSDP stage ``hosted`` wrapped as :class:`_UnitChain` of :func:`_fsdp_units`, each unit and the chain
    ``fully_shard``-ed over the replica mesh (reshard after forward); None where it cannot be cut."""
    from torch.distributed.fsdp import fully_shard

    module = hosted.module
    cut = _fsdp_units(module, op_of)
    if cut is None:
        return None
    units, assemble, gathers = cut

    def direct(owners) -> set[int]:  # the parameters the owner modules hold themselves, not their sub-modules'
        return {id(p) for o in owners for p in o._parameters.values() if p is not None}

    covered = direct(o for _, _, owners in units for o in owners)
    if any(id(p) not in covered for p in module.parameters()):
        return None  # a parameter no piece reads through get_attr (a module call's own): one unit for the stage
    calls, mine = [], []
    for seg, bound, owners in units:
        if not owners:
            calls.append(bound)
            continue
        unit = _Unit(owners, bound)
        own = direct(owners)
        others = {p for p in unit.parameters() if id(p) not in own}  # sub-modules' parameters: other units'
        fully_shard(unit, mesh=meshes.dp, reshard_after_forward=True, ignored_params=others or None)
        calls.append(unit)
        mine.append(unit)
    # FSDP warns of every unit returning a view (an in-place op on it would skip the hook); no piece writes into
    # another's output nor returns a view of its weights (both kept one unit above), so the warning says nothing
    # here; the filter matches graphpipe's own unit classes only
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP_Unit", category=UserWarning)
    chain = _UnitChain([u[0] for u in units], calls, assemble, gathers, hosted.program.input_names)
    fully_shard(chain, mesh=meshes.dp, reshard_after_forward=True)
    for before, unit in zip([None, *mine], mine):
        # backward runs the units in reverse: each prefetches the one before it (FSDP's implicit order is the
        # last forward's, another micro-batch's under a pipeline schedule)
        unit.set_modules_to_backward_prefetch([before] if before is not None else [])
    for unit in (*mine, chain):
        unit.set_gradient_divide_factor(1.0)  # replicas' loss terms are scaled already: sum, as all-reduce
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), factor 1: exact
    chain.set_requires_gradient_sync(True)  # every backward reduce-scatters its gradients into the shards
    chain.set_reshard_after_backward(True)
    chain.set_is_last_backward(True)
    gc.collect()  # the cut pieces (fx modules: reference cycles) held the whole tensors FSDP has just replaced
    return chain


def parallelize_stage(hosted, meshes: StageMeshes, model: nn.Module | None = None, op_of=None) -> _Parallel:
    """Make hosted stage ``hosted`` (a :class:`~graphpipe.runtime.hosted.HostedStage` whose weights are
    materialized) FSDP-sharded, tensor-parallel or both (2-D: TP inside each replica, FSDP over the replicas'
    matching ranks) as its plan says; its forward is wrapped accordingly.
    ``op_of`` (fx node name -> op id): a TP-free FSDP stage resharding after forward is cut into per-op units."""
    stage = hosted.stage
    hosted.leave_grads_to_autograd()
    if stage.tp > 1:
        _tensor_parallel(hosted, meshes, model)
    if stage.shard != "fsdp" or meshes.dp is None:  # TP only, or one replica: nothing to shard over
        return _Parallel(stage, meshes, hosted)
    from torch.distributed.fsdp import fully_shard

    if stage.tp == 1 and stage.reshard_after_forward and not stage.recompute and op_of:
        chain = _shard_per_op(hosted, meshes, op_of)
        if chain is not None:
            hosted.forward = chain
            return _Parallel(stage, meshes, hosted, fsdp=chain, per_op=True)
    wrapper = _ShardedCall(hosted.module, hosted.forward)
    if not stage.reshard_after_forward:
        # FSDP warns once per rank that the stage returns a view (an in-place op on it would skip the pre-backward
        # all-gather); gathered for the step, that all-gather has nothing to do, and the runtime clones a value a
        # stage mutates in place (stage_modules.clone_mutated_inputs): nothing to say to the user
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP_ShardedCall\) returned a view",
                                category=UserWarning)
    fully_shard(wrapper, mesh=meshes.dp, reshard_after_forward=stage.reshard_after_forward)
    wrapper.set_gradient_divide_factor(1.0)  # replicas' loss terms are scaled already: sum, as all-reduce
    wrapper.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), factor 1: exact
    hosted.forward = wrapper
    return _Parallel(stage, meshes, hosted, fsdp=wrapper)


def _tensor_parallel(hosted, meshes: StageMeshes, model: nn.Module | None) -> None:
    """Stage ``hosted``'s parameters as DTensors on its TP mesh (:func:`tp_placements`), its forward wrapped in
    :class:`_TPForward`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stage, module = hosted.stage, hosted.module
    styles = tp_placements(module, dict(hosted.program.param_names), stage.tp, stage.id, model)
    if _reduce_after_rows(module, styles, stage.sequence_parallel):
        from graphpipe.runtime.stage_modules import BoundForward

        hosted.forward = BoundForward(module)  # the bound copy of the graph, now with the all-reduces
    with torch.no_grad():
        for name, p in list(module.named_parameters()):
            owner_path, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            style = styles.get(name, "rep")
            pl = Replicate() if style == "rep" or (style.startswith("row") and p.dim() < 2) else \
                Shard(_SPLIT_DIM[style] if p.dim() > 1 else 0)
            d = DTensor.from_local(_local_chunk(p.detach(), pl, meshes.tp), meshes.tp, [pl], run_check=False,
                                   shape=p.shape, stride=p.stride())
            owner._parameters[attr] = nn.Parameter(d, requires_grad=p.requires_grad)
    _register_attention_rules()
    hosted.forward = _TPForward(hosted.forward, meshes.tp, stage.regathers)
    # the backward of a TP stage mixes DTensor gradients with plain tensors the forward saved (constants,
    # index tables): those are replicated, so the whole rank treats plain tensors as Replicate
    torch._C._set_dtensor_allow_implicit_replication(True)


_ATTENTION_RULES = []


def _register_attention_rules() -> None:
    """DTensor rules for CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and its
    backward), which DTensor has none for: it would derive one through the op's decomposition, which takes
    minutes. Attention is independent per head, so heads sharded on dim 1 (or everything replicated) in, the
    same out; once per process."""
    if _ATTENTION_RULES:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return
    rep, heads = Replicate(), Shard(1)

    def mask(kwargs) -> list:  # a mask broadcast over heads ((batch, 1, q, k)) is the same for every head
        return [rep] if kwargs.get("attn_mask") is not None else []

    @register_sharding(forward.default)
    def _forward(query, key, value, *args, **kwargs):
        rest = [None] * len(args)
        return [([rep, rep], [rep, rep, rep, *rest, *mask(kwargs)]),
                ([heads, heads], [heads, heads, heads, *rest, *mask(kwargs)])]

    @register_sharding(backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, *args, **kwargs):
        rest = [None] * len(args)
        return [([rep, rep, rep], [rep] * 6 + rest + mask(kwargs)),
                ([heads, heads, heads], [heads] * 6 + rest + mask(kwargs))]

    _ATTENTION_RULES.append(True)


def _local_chunk(t: torch.Tensor, placement, mesh) -> torch.Tensor:
    """This rank's piece of ``t`` (every rank holds the same whole ``t``): no communication."""
    from torch.distributed.tensor import Shard

    if not isinstance(placement, Shard):
        return t.clone()
    n, i = mesh.size(), mesh.get_local_rank()
    return t.chunk(n, dim=placement.dim)[i].clone()


def whole_gradient(param) -> torch.Tensor | None:
    """``param``'s gradient as one plain tensor: gathered over its mesh where it is a DTensor (a collective:
    every device of the stage calls it), else as is; None without a gradient on a plain parameter."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.grad
    grad = param.grad if param.grad is not None else torch.zeros_like(param)
    return grad.full_tensor()


def as_local_like(whole: torch.Tensor, param):
    """``whole`` (the same plain tensor on every device of ``param``'s stage) laid out as ``param`` is: a DTensor
    of its mesh and placements, this device's piece cut locally (no communication), or ``whole`` itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


class IntraStage:
    """The parallel stages a rank hosts, and what its executor calls around a step (hooks in
    :meth:`graphpipe.runtime.executor.RankExecutor.run_iteration`)."""

    def __init__(self, parallel: dict[int, _Parallel], timeout_s: float):
        self.parallel = parallel
        self.timeout = timedelta(seconds=timeout_s)

    def __bool__(self) -> bool:
        return bool(self.parallel)

    def before_iteration(self) -> None:
        """The step's start on this rank. FSDP stages: no gradient synchronisation and no resharding in any
        backward of the step (torch's pipelining does the same); the reduce-scatter is
        :meth:`after_last_backward`'s. A stage gathered for the step starts its all-gather now
        (:meth:`_gather_early`)."""
        for p in self.parallel.values():
            if p.fsdp is not None and not p.per_op:
                p.fsdp.set_is_last_backward(False)
                p.fsdp.set_reshard_after_backward(False)
                p.fsdp.set_requires_gradient_sync(False)
                if p.gathered_for_step:
                    self._gather_early(p)

    @staticmethod
    def _gather_early(p: "_Parallel") -> None:
        """Start FSDP stage ``p``'s all-gather of the step without waiting for it: the cost model's gather at
        time 0, overlapping the pipeline's fill instead of holding up the stage's first forward.

        Every replica of the stage calls it here, at its step's start, so the collective matches (round-robin
        replicas too: they start the step together). FSDP's pre-forward hook finds the gather pending and waits
        for it rather than issuing another (``FSDPParamGroup.unshard`` returns while a result is pending); that
        wait is the replica group's, under the runtime's timeout. Parameters already gathered (an evaluation
        left them so) are not gathered again. The handle is kept (:attr:`_Parallel.pending`) for tests and
        debugging; the hook, not this, waits."""
        from torch.distributed.fsdp import fully_shard

        fully_shard.state(p.fsdp)._lazy_init()  # what the root's first pre-forward would do first
        p.pending = p.fsdp.unshard(async_op=True)

    def after_last_backward(self, stage_id: int) -> None:
        """Stage ``stage_id`` ran its step's last B or W: reduce its gradients over its replicas."""
        p = self.parallel.get(stage_id)
        if p is None or p.per_op:  # per-op FSDP units reduce-scattered in every backward already
            return
        if p.fsdp is not None:
            from torch.distributed.fsdp import fully_shard

            p.fsdp.set_is_last_backward(True)
            p.fsdp.set_reshard_after_backward(True)
            p.fsdp.set_requires_gradient_sync(True)
            state = fully_shard.state(p.fsdp)
            for s in state._state_ctx.all_states:
                for group in s._fsdp_param_groups:
                    if p.stage.tp > 1:  # 2-D: a gradient DTensor's rules left Partial or replicated: its layout
                        for fp in group.fsdp_params:
                            _fix_grad_layout(fp.unsharded_param)
                    group.post_backward()
            state._root_post_backward_final_callback()
            return
        from torch.distributed.tensor import DTensor

        params = p.hosted.trainable()
        for param in params:  # a gradient left Partial or replicated by DTensor's rules: the parameter's layout
            _fix_grad_layout(param)
        if p.meshes.dp_group is None:
            return
        works = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            g = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            works.append(dist.all_reduce(g, group=p.meshes.dp_group, async_op=True))
        for w in works:
            w.wait(self.timeout)


def _fix_grad_layout(param) -> None:
    """``param.grad`` (a DTensor that DTensor's rules left Partial or replicated) in ``param``'s own layout."""
    from torch.distributed.tensor import DTensor

    g = param.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(param.placements):
        param.grad = g.redistribute(placements=param.placements)


def attach(executor, sg: StageGraph, split, rank: int, device: torch.device, timeout_s: float,
           model: nn.Module | None = None) -> None:
    """Build every parallel stage's meshes (collective) and make ``executor``'s hosted parallel stages FSDP or
    tensor-parallel; sets ``executor.intra_stage``. The one hook :func:`graphpipe.runtime.setup.setup_rank` calls."""
    for s, hosted in executor.hosted.items():
        if sg.stages[s].parallel and hosted.batchnorms:
            raise PlanError(f"stage {s} is FSDP-sharded or tensor-parallel and holds BatchNorm: its statistics "
                            "merge over whole-copy replicas only; give that stage tp 1 and shard none")
    meshes = build_stage_meshes(sg, rank, device.type, timeout_s)
    parallel = {}
    for s, hosted in executor.hosted.items():
        if s in meshes:
            parallel[s] = parallelize_stage(hosted, meshes[s], model, split.op_of)
    executor._autograd_grads = tuple(h for h in executor.hosted.values() if not h.persistent_grads)
    if parallel and executor.measure:
        # the saved-activation meter reads each saved tensor's storage, which a DTensor (a wrapper) has none of:
        # a rank with a parallel stage reports no activation peak
        from graphpipe.runtime.measure import NoMeter

        executor.saved_meter = executor.services.saved_meter = NoMeter()  # the stages read the services' one
    executor.intra_stage = IntraStage(parallel, timeout_s)
