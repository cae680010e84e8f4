"""Train your own model on your own data through a plan: :class:`Pipeline`, used in your script under torchrun.

::

    pipe = graphpipe.Pipeline("plan.json", model, loss_fn)   # this rank's stages, on this rank's device
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)      # this rank's parameters
    for inputs, target in loader:                            # the whole mini-batch on every rank
        loss = pipe.step(inputs, target)                     # forward + backward over the plan's micro-batches
        pipe.clip_grad_norm_(1.0)                            # global norm over every stage and replica
        opt.step(); opt.zero_grad()
    pipe.save("ckpt", optimizer=opt)                         # torch.distributed.checkpoint, keyed by parameter name
    out = pipe.forward(inputs)                               # no-grad evaluation, the output on every rank
    pipe.close()                                             # every rank meets, then the process group goes

Every rank builds the same model (``Pipeline`` broadcasts rank 0's weights
so they agree), captures it on the example inputs of the plan's model spec
(or ``example_inputs=``) exactly as the planner did
(:func:`graphpipe.frontend.capture.trace_ops`, at the plan's granularity), cuts it by
stage and keeps its own stages' programs. Training semantics are those
``graphpipe run --check`` verifies (docs/semantics.md): dropout masks per
(seed, step, op, rows), BatchNorm per micro-batch or synchronised, tied
weights summed across their copies, the loss scaled by each micro-batch's
share of the mini-batch. PipeDream's asynchronous schedules keep weight
versions inside the runtime; the API refuses them.

``torch.distributed`` is initialised from torchrun's environment when it is
not already (gloo on CPU, NCCL when every rank has a GPU), with a timeout on
every collective, so a failing rank ends the job instead of hanging it.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from graphpipe.errors import GraphpipeError, InputError, PlanError, UserCodeError
from graphpipe.frontend.exporting import normalize_inputs
from graphpipe.plan import Plan
from graphpipe.runtime.resume import StepCheckpoints
from graphpipe.runtime.step_checkpoints import replace_dir
from graphpipe.runtime.teardown import before_init, collect_groups

__all__ = ["Pipeline", "JobModel"]


@dataclass(frozen=True, slots=True, eq=False)
class JobModel:
    """``graphpipe run``'s model for :class:`Pipeline` (its ``_job`` argument): built from the plan's spec and
    captured once per process, and what the job measures.

    A job (:mod:`graphpipe.runtime.worker`) has already built and captured
    the model (:func:`~graphpipe.runtime.runnable.load_runnable`, a
    :class:`~graphpipe.runtime.runnable.Runnable`, on meta parameters) in a
    process group that is already up; the Pipeline cuts that capture instead
    of capturing the model again, and every rank materializes its own stages
    from the seed (no weights from rank 0).
    """

    runnable: Any
    measure: bool = True
    """Time every action (synchronising the device) and meter saved activations (``graphpipe run --measure``)."""
    fault: Any = None
    """The test hook (:class:`~graphpipe.runtime.options.FaultInjection`), for the executor's F/B/hang points."""


def _init_distributed(timeout_s: float) -> tuple[int, int, str, bool]:
    """``(rank, world size, backend, whether it initialised)``, initialising the default process group from
    torchrun's environment unless the caller did."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.get_backend(), False
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise InputError("graphpipe.Pipeline runs under torchrun (RANK and WORLD_SIZE are not set); "
                         "start the script with `torchrun --nproc-per-node N script.py`")
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local)
    timeout = timedelta(seconds=timeout_s)
    before_init()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # Under torchrun the rendezvous store outlives a restart, and with it the addresses the last attempt's
        # ranks published: a restarted rank would dial a dead peer's port ("Connection refused"). Each attempt
        # gets keys of its own.
        from torch.distributed.rendezvous import rendezvous

        store, rank, size = next(rendezvous("env://", timeout=timeout))
        dist.init_process_group(backend, store=dist.PrefixStore(f"graphpipe/attempt-{attempt}", store), rank=rank,
                                world_size=size, timeout=timeout)
    return dist.get_rank(), world, backend, True


def _check_same_model(plan: Plan, gm, op_nodes) -> None:
    """Refuse a model whose ops are not the plan's: other op names, or an op whose parameters differ in size
    (a layer of another width captures under the same name)."""
    from graphpipe.frontend.capture import op_param_bytes
    from graphpipe.runtime.stage_modules import check_op_names

    check_op_names([op.name for op in plan.graph.ops], tuple(op_nodes), plan.model)
    captured = op_param_bytes(gm, op_nodes)
    for op in plan.graph.ops:
        got = captured.get(op.name)
        if got is not None and op.param_bytes > 0 and got != op.param_bytes:
            raise PlanError(f"the model given to Pipeline is not the plan's ({plan.model}): op {op.name!r} has "
                            f"{got:,} parameter bytes, the plan's {int(op.param_bytes):,}; give Pipeline the model "
                            "the plan was made from, or plan this one")


def _check_world_size(plan: Plan, path: Any, idle_ranks: bool = False) -> None:
    """Refuse, on every rank and before any collective, a job of another size than the plan's
    :attr:`~graphpipe.plan.Plan.num_ranks`: a missing rank would leave its peers waiting, and an extra one
    would hold no stage (no parameters for its optimizer). ``idle_ranks``: extra ranks are the caller's intent
    (an elastic job whose plan for this world size uses fewer devices); only too few are refused."""
    import sys

    from graphpipe.errors import LaunchError
    from graphpipe.plan import torchrun_flags

    if dist.is_available() and dist.is_initialized():
        world, launcher = dist.get_world_size(), "the process group has"
    elif "WORLD_SIZE" in os.environ:
        world, launcher = int(os.environ["WORLD_SIZE"]), "torchrun started"
    else:
        return  # _init_distributed says how to start it
    if world == plan.num_ranks or (idle_ranks and world > plan.num_ranks):
        return
    name = f"{os.fspath(path)} " if path is not None else "the plan "
    used = plan.stage_graph.devices_used()
    on = f"device {used[0]}" if len(used) == 1 else f"devices {used[0]}-{used[-1]}" \
        if used == tuple(range(used[0], used[-1] + 1)) else f"devices {list(used)}"
    message = (f"{name}runs on {plan.num_ranks} rank{'s' if plan.num_ranks != 1 else ''} (its stages are on "
               f"{on}), {launcher} {world}: start it with `torchrun {torchrun_flags(plan)}`")
    rank = os.environ.get("RANK", "?") if not dist.is_initialized() else dist.get_rank()
    sys.stderr.write(f"graphpipe: error: rank {rank}: {message}\n")
    sys.stderr.flush()
    raise LaunchError(message)


class Pipeline:
    """This rank's part of a model trained by a graphpipe plan (module docstring).

    ``plan``: a :class:`~graphpipe.plan.Plan` or a plan JSON path. ``model``
    and ``loss_fn``: the module and ``loss_fn(output)`` or
    ``loss_fn(output, target)``; when omitted they come from the plan's
    model spec (a zoo spec or ``file.py:factory``). ``precision``: ``fp32``
    or ``bf16`` (``torch.autocast``, weights kept in fp32). ``compile``: every
    stage this rank hosts runs its forward and backward compiled by
    ``torch.compile`` (inductor; refused for split-backward schedules).
    ``idle_ranks``: a job may start more ranks than the plan's
    :attr:`~graphpipe.plan.Plan.num_ranks`; the extra ones host no stage,
    have no parameters (build their optimizer only when
    ``pipe.parameters()`` is not empty) and only join collectives. Without
    it, any other number of ranks is refused on every rank, before any
    collective, in one line with the torchrun flag to use.

    The model is captured on ``example_inputs`` and ``example_target``
    (either may be left out: the spec's are used, the target only with a
    loss that can take it). A loss that takes a target on a model captured
    without one is captured again at the first ``step(inputs, target)``,
    keeping the parameter tensors an optimizer already holds. Frozen
    parameters (``requires_grad=False``) get no gradient, so optimizers over
    :meth:`parameters` keep no state for them.

    ``_job`` is ``graphpipe run``'s own way in (a :class:`JobModel`: the
    model it captured once per process, its timing and fault hook); scripts
    leave it out.
    """

    def __init__(self, plan: Plan | str | os.PathLike, model: nn.Module | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *, example_inputs: Any = None,
                 example_target: Any = None, precision: str = "fp32", seed: int = 0, timeout_s: float = 300.0,
                 batchnorm: str | None = None, compile: bool = False, idle_ranks: bool = False,
                 _job: JobModel | None = None) -> None:
        from graphpipe.sched.async_pipe import plan_spec

        from graphpipe.sched.complete import read_plan_completed

        self.plan = (read_plan_completed(os.fspath(plan), say=lambda line: print(f"graphpipe: {line}", file=sys.stderr))
                     if not isinstance(plan, Plan) else plan)
        if plan_spec(self.plan) is not None:
            raise PlanError(f"the plan's schedule {self.plan.schedule.name!r} is asynchronous (PipeDream's weight "
                            "versions); Pipeline trains synchronous schedules: re-plan with another --schedule")
        from graphpipe.runtime.layouts import layout_refusal

        refusal = layout_refusal(self.plan, compile=compile)
        if refusal is not None:
            raise PlanError(refusal)
        if precision not in ("fp32", "bf16"):
            raise InputError(f"precision must be fp32 or bf16, got {precision!r}")
        if compile:
            from graphpipe.runtime.compiled import compile_refusal

            refusal = compile_refusal((a for actions in self.plan.schedule.device_actions for a in actions),
                                      "compile=True")
            if refusal is not None:
                raise PlanError(refusal)
        self._compile = bool(compile)
        self.precision, self.seed, self.timeout_s = precision, seed, timeout_s
        # graphpipe run (``_job``) starts a rank per device of the cluster: its idle ranks only join collectives
        _check_world_size(self.plan, plan if not isinstance(plan, Plan) else None, idle_ranks or _job is not None)
        self.rank, self.world_size, self.backend, self._owns_group = _init_distributed(timeout_s)
        sg = self.plan.stage_graph
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}") if self.backend == "nccl" else torch.device("cpu")
        self._batchnorm = batchnorm or getattr(self.plan, "batchnorm", None) or "per-micro-batch"
        self._steps = 0
        self._checkpoints = StepCheckpoints()
        self._closed = False
        if _job is not None:
            self._measure = _job.measure
            self._model = self._loss_fn = None  # the job's module is dropped: only this rank's stages stay
            self._from_rank0 = False  # every rank built (or materializes) the same weights from the seed
            r = _job.runnable
            self._assemble(r.module, r.gm, r.op_nodes, r.io, r.loss_fn, r.shape_inputs, fault=_job.fault,
                           measure=_job.measure, initial=r.initial)
            return
        if model is not None and loss_fn is None:
            raise InputError("Pipeline(plan, model, loss_fn): a model needs its loss_fn")
        # the plan's model for its example inputs: with the user's model given, its weights are never allocated
        # (all of it on meta beside a meta model, whose capture runs on meta inputs anyway)
        from graphpipe.runtime.materialize import on_meta

        build = "weights" if model is None else "meta" if on_meta(model) else "params_on_meta"
        spec_model, spec_inputs, spec_loss, spec_target = (None, None, None, None) if (
            model is not None and example_inputs is not None) else self._from_spec(build)
        self._model = model if model is not None else spec_model
        self._given_model = model is not None and example_inputs is None  # captured on the plan's inputs
        if model is not None and spec_model is not None:  # the dims the plan's factory declares vary for it too
            from graphpipe.frontend.exporting import DYNAMIC_ATTR

            declared = getattr(spec_model, DYNAMIC_ATTR, None)
            if declared is not None and getattr(model, DYNAMIC_ATTR, None) is None:
                object.__setattr__(model, DYNAMIC_ATTR, declared)
        self._loss_fn = loss_fn if loss_fn is not None else spec_loss
        if example_inputs is None:
            example_inputs = spec_inputs
            # the factory's target goes with its loss, or with a loss of the user's that takes one (an
            # example_target given alone is the user's and kept)
            if example_target is None and (loss_fn is None or _takes_target(loss_fn) is not False):
                example_target = spec_target
        self._meta = on_meta(self._model)
        # a real model's stages take rank 0's weights before the first step, unless a checkpoint fills them
        self._from_rank0 = not self._meta and self.world_size > 1
        self._measure = False  # the API times nothing (graphpipe run measures)
        self._build(example_inputs, example_target)
        if not self._setup.programs:
            import logging

            logging.getLogger(__name__).warning(
                "rank %d hosts no stage of the plan (it uses %d of the job's %d ranks): it has no parameters and "
                "only joins collectives", self.rank, len(sg.devices_used()), self.world_size)

    # ------------------------------------------------------------------ set-up
    def _from_spec(self, build: str = "weights"):
        """``(module, example inputs, loss_fn, example target)`` of the plan's model spec. ``build``: ``weights``
        (a real module), ``params_on_meta`` (real example inputs, parameters on meta) or ``meta`` (everything on
        the meta device): only the example inputs are wanted then."""
        import contextlib

        from graphpipe.frontend.capture import load_factory
        from graphpipe.runtime.materialize import params_on_meta

        building = {"weights": contextlib.nullcontext, "params_on_meta": params_on_meta,
                    "meta": lambda: torch.device("meta")}[build]()

        spec = self.plan.model
        if spec.endswith((".json", ".txt")):
            raise PlanError(f"the plan's model {spec!r} is a graph file: plan the module (a zoo spec or "
                            "file.py:factory) to train it")
        if ".py:" in spec:
            with torch.random.fork_rng(devices=[]), building:
                torch.manual_seed(self.seed)
                made = load_factory(spec)
            return made.module, made.example_inputs, made.loss_fn, made.example_target
        from graphpipe.frontend import zoo
        with building if build != "meta" else contextlib.nullcontext():  # the zoo builds on meta itself
            built = zoo.build(spec, device="meta" if build == "meta" else "cpu", seed=self.seed)
        return built.module, built.example_inputs, built.loss_fn, None

    def _receive_rank0_weights(self) -> None:
        """Rank 0's parameters and buffers of every stage, sent to that stage's replicas only (ranks that built
        the model with other seeds agree); once, before the first step, and never after a checkpoint was loaded.

        Rank 0 holds the whole (real) model; each other rank receives only
        the tensors of the stages it hosts, point to point, in stage order.
        """
        if not self._from_rank0:
            return
        self._from_rank0 = False
        sources, self._stage_sources = self._stage_sources, {}
        with torch.no_grad():
            for stage in self.plan.stage_graph.stages:
                targets = [d for d in stage.devices if d != 0]
                if not targets or (self.rank != 0 and self.rank not in targets):
                    continue
                module = sources[stage.id].module
                for t in (*module.parameters(), *module.buffers()):
                    if self.rank == 0:
                        buf = t.detach().to(self.device).contiguous()
                        for d in targets:
                            dist.send(buf, d)
                    else:
                        buf = torch.empty_like(t.detach())
                        dist.recv(buf, 0)
                        t.copy_(buf)

    def _build(self, example: Any, target: Any, keep: dict | None = None) -> None:
        """Capture the model on ``example`` (a whole mini-batch), cut it and build this rank's executor."""
        from graphpipe.frontend.capture import Granularity, trace_ops
        from graphpipe.runtime.runnable import plan_granularity

        if self._meta:  # captured and cut on the meta device: each rank materializes its own stages only
            from graphpipe.runtime.materialize import meta_copy

            model, example, target = self._model, meta_copy(example), meta_copy(target)
        else:
            model = self._model.cpu() if self.backend != "nccl" else self._model
        try:
            exported, op_nodes, _ = trace_ops(model, example, self._loss_fn, target,
                                              Granularity.parse(plan_granularity(self.plan)), precision=self.precision)
        except Exception as exc:
            ours = isinstance(exc, GraphpipeError) and not isinstance(exc, UserCodeError)
            if not self._given_model or keep is not None or ours:
                raise
            # the plan's model captured on these inputs when it was planned: the model given is another
            text = str(exc) if isinstance(exc, UserCodeError) else \
                f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            raise PlanError(f"the model given to Pipeline is not the plan's ({self.plan.model}): capturing it on "
                            f"the plan's example inputs failed ({text}); give Pipeline the "
                            "model the plan was made from, or plan this one") from exc
        _check_same_model(self.plan, exported.gm, op_nodes)
        args, kwargs = normalize_inputs(example)
        flat = exported.io.flat_inputs(args, kwargs, target)

        def rows(n: int, _seed: int = 0) -> tuple:  # n rows of the example (repeated when it has fewer)
            return tuple(x[torch.arange(n, device=x.device) % x.shape[0]] if isinstance(x, torch.Tensor) and x.dim() else x
                         for x in flat)

        from graphpipe.runtime.stage_modules import instrument

        self._assemble(model, instrument(exported.gm, rows(2)), op_nodes, exported.io,
                       exported.io.wrap_loss(self._loss_fn), rows, fault=None, measure=self._measure, keep=keep,
                       ranges=exported.ranges)

    def _assemble(self, model, gm, op_nodes, io, loss_fn, make_rows, *, fault, measure: bool,
                  initial=None, keep=None, ranges=None) -> None:
        """Cut the captured graph by the plan's stages, materialize this rank's stages when the model is on the
        meta device, and build this rank's executor (:func:`setup_rank`).

        ``keep``: ``(stage, name) -> parameter`` of an earlier build of this
        rank; its tensors are put back in the new stage modules, so an
        optimizer built on :meth:`parameters` goes on stepping the ones that train.
        """
        from graphpipe.runtime.checkpoint import unused_state
        from graphpipe.runtime.materialize import materialize_stages, materialize_unused
        from graphpipe.runtime.stage_modules import boundary_meta, check_op_names, split_model
        from graphpipe.runtime.setup import setup_rank

        sg = self.plan.stage_graph
        check_op_names([op.name for op in sg.graph.ops], tuple(op_nodes), self.plan.model)
        self._io = io
        self._plain_structures: set[tuple[int, int]] = set()
        """Input structures (:func:`_plain_structure`) this capture's full check accepted (:meth:`_flat`)."""
        split = split_model(gm, op_nodes, sg)
        if keep:
            _put_back(split, keep)
        meta = boundary_meta(gm, split.boundary_values, make_rows, self.precision)
        from graphpipe.frontend.shapes import ShapeRules

        self._shapes = ShapeRules(gm, ranges)
        """What each input dim may be per step (:mod:`graphpipe.frontend.shapes`)."""
        self._shapes_planned = self._shapes.bind(make_rows(sg.batch_size, 0)).bindings
        """The symbols' sizes the plan was made at (the example's)."""
        self._step_shape = None
        self._has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gm.modules())
        mine = {s: split.programs[s] for s in (sg.stages_on_device(self.rank) if self.rank < sg.num_devices else ())}
        self._uninitialised = sorted(materialize_stages(model, mine, self.device, self.seed, initial).uninitialised)
        """Model names of hosted tensors built on meta that no initialiser filled: a checkpoint must (:meth:`load`)."""
        # rank 0 sends every stage's weights from its whole model (:meth:`_receive_rank0_weights`)
        self._stage_sources = dict(enumerate(split.programs)) if self.rank == 0 else mine
        if any(stage.parallel for stage in sg.stages):
            self._receive_rank0_weights()  # FSDP and TP stages shard their weights in the set-up: whole ones first
        # the tensors no stage holds (unused by forward), which rank 0 saves so a checkpoint is whole
        self._unused_state = {}
        if self.rank == 0:  # a model built on meta: its unused tensors are made from the seed, as a stage's are
            blank = materialize_unused(model, split.programs, self.seed)
            self._unused_state = {k: v for k, v in unused_state(model, split.programs).items()
                                  if k.split("/", 1)[1] not in blank}
        self._setup = setup_rank(self.rank, self.world_size, self.plan, split, meta, loss_fn, self.device,
                                 self.backend, timeout_s=self.timeout_s, seed=self.seed, batchnorm=self._batchnorm,
                                 fault=fault, measure=measure, compile=self._compile, model=model)
        self._names = {}
        for s, prog in self._setup.programs.items():
            for name, p in prog.module.named_parameters():
                self._names[p] = prog.param_names.get(name, name)
        self._counted = self._counted_parameters()
        self.reads_inputs = any(prog.model_inputs for prog in self._setup.programs.values())
        """Whether this rank's stages read model inputs (the others are handed none each step)."""
        self._sink_id = split.sink_stage
        example = make_rows(2, 0)
        self._target_shapes = [(tuple(t.shape[1:]), t.dtype)
                               for t in example[len(example) - io.num_target_leaves:] if isinstance(t, torch.Tensor)] \
            if io.target_spec is not None else []
        self.last_step = None
        """The last step's :class:`~graphpipe.runtime.executor.StepResult` (per-action times, activation peak)."""

    def _recapture(self, inputs: Any, target: Any) -> None:
        """The first ``step(inputs, target)`` of a model captured without a target: capture it again with this
        mini-batch and target as the example (every rank steps together, so the collectives of the set-up
        match), keeping this rank's parameter tensors and their optimizer state."""
        keep = {(s, name): p for s, prog in self._setup.programs.items() for name, p in prog.module.named_parameters()}
        self._build(inputs, target, keep)

    def _counted_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank counts once in global sums: a stage's first replica, a tied parameter's owner."""
        from graphpipe.runtime.intra_stage import counts_here

        sg, setup = self.plan.stage_graph, self._setup
        out = []
        for s, prog in setup.programs.items():
            if sg.stages[s].parallel:  # FSDP / TP: every shard of the first replica counts (intra_stage)
                out += counts_here(sg.stages[s], self.rank, [p for name, p in prog.module.named_parameters()
                                                             if (s, name) not in setup.tied_copies])
                continue
            if sg.stages[s].devices[0] != self.rank:
                continue
            for name, p in prog.module.named_parameters():
                if (s, name) not in setup.tied_copies:
                    out.append(p)
        return out


    # ------------------------------------------------------------------ parameters
    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its stages', each once), for its optimizer."""
        return iter(self._setup.executor.parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(the model's own name, parameter)`` of every parameter on this rank."""
        for p in self._setup.executor.parameters():
            yield self._names[p], p

    # ------------------------------------------------------------------ training
    def step(self, inputs: Any, target: Any = None) -> torch.Tensor:
        """Forward and backward of one mini-batch through the plan's schedule; returns its loss on every rank.

        ``inputs``: a tensor, a tuple of inputs or a dict of keyword inputs
        (the whole mini-batch, the same on every rank); ``target`` when the
        loss takes one. Gradients accumulate into ``.grad`` (all-reduced over
        replicas, summed over tied copies); zero them between steps.

        Shapes may change from step to step where the model allows: a
        sequence length (any dim but the batch of an integer input; a
        float input's where its factory declares them), and the rows of a
        last partial batch (fewer than the plan's batch: every micro-batch
        keeps its place with proportionally fewer rows, docs/semantics.md).
        A size the model or the plan cannot take is refused in one line
        before anything runs, on every rank alike.

        The loss comes back as a detached 0-dim float64 tensor on this rank's
        device, as a plain loop's ``loss`` does: ``loss.item()`` (or
        ``float(loss)``) waits for the device, so read it when logging, not
        every step, and the next step's work is queued while this one runs.
        """
        self._train(self._flat(inputs, target))
        loss = self.last_step.terms.tensor()
        if self.world_size > 1:
            dist.all_reduce(loss)  # on the device: an NCCL group reduces CUDA tensors only
        return loss

    def timed_step(self, flat: tuple | None, *, start: Callable[[], float], sizes: dict[str, int] | None = None):
        """One timed step on the graph's flat inputs (``None`` on ranks whose stages read none): ``start()``
        (the job driver's barrier, :class:`~graphpipe.runtime.driver.StepClock`) returns the shared start the
        step's per-action times count from, and the step ends when the device has finished it. ``sizes``: the
        step's symbol sizes when they are not the plan's (``--vary-shapes``; every rank knows them, inputs or
        not). Returns this rank's :class:`~graphpipe.runtime.executor.StepResult`. ``graphpipe run``'s step."""
        if sizes is not None:
            self._step_shape = self.shape_at(sizes)
        self._train(flat, start=start, wait=True)
        return self.last_step

    @property
    def shape_rules(self):
        """What each input dim may be per step (:class:`~graphpipe.frontend.shapes.ShapeRules`)."""
        return self._shapes

    @property
    def planned_sizes(self) -> dict[str, int]:
        """The symbols' sizes the plan was made at (the batch's and every varying length's)."""
        return dict(self._shapes_planned)

    def shape_at(self, sizes: dict[str, int]):
        """The :class:`~graphpipe.frontend.shapes.StepShape` of symbol sizes ``sizes``, refused as a step's would
        be (:meth:`step`)."""
        return self._checked(self._shapes.at(sizes))

    @property
    def rank_setup(self):
        """This rank's :class:`~graphpipe.runtime.setup.RankSetup` (its executor, one
        :class:`~graphpipe.runtime.hosted.HostedStage` per stage it hosts), for diagnostics such as
        ``evals/overlap_sends.py``; training never needs it."""
        return self._setup

    @property
    def check_layout(self) -> dict[str, dict[str, int]]:
        """Rows per call of every context-taking op: how ``--check``'s single-process reference cuts its dropout
        and BatchNorm to match this plan (:func:`~graphpipe.runtime.reference.reference_layout`)."""
        return self._setup.layout

    def counted_tensors(self) -> tuple[list[tuple[str, torch.Tensor, bool]], list[tuple[str, torch.Tensor, bool]]]:
        """``(parameters, buffers)`` of this rank's stages as ``(name in the model, tensor, counted)``, stage by
        stage: ``counted`` where this rank counts the tensor in a whole-model tally (a stage's first replica; a
        tied parameter's owner; a buffer's first stage), so every tensor is counted once over all ranks. What
        ``--check`` compares (every copy) and counts."""
        sg, setup = self.plan.stage_graph, self._setup
        params, buffers = [], []
        for s in sorted(setup.programs):
            prog = setup.programs[s]
            first = sg.stages[s].devices[0] == self.rank
            for name, p in prog.module.named_parameters():
                params.append((prog.param_names.get(name, name), p, first and (s, name) not in setup.tied_copies))
            for name, b in prog.module.named_buffers():
                buffers.append((name, b, first and setup.buffer_stage[name] == s))
        return params, buffers

    def _train(self, flat: tuple | None, *, start: Callable[[], float] | None = None, wait: bool = False) -> None:
        """One step on the graph's flat inputs (``None`` on ranks whose stages read none).

        ``start``: called when the step is ready to run, returns its start
        time (``graphpipe run``'s barrier, so every rank's times share one
        start); ``wait``: the step's time ends when the device has finished
        it (:meth:`RankExecutor.run_iteration`).
        """
        from graphpipe.runtime.runnable import autocast

        self._ready_to_run()
        executor = self._setup.executor
        shape, self._step_shape = self._step_shape, None
        if shape is not None:  # the API's step: its own sizes; graphpipe run's steps are the plan's
            executor.prepare_step(shape.rows, shape.bindings)
        else:
            executor.prepare_step(self.plan.stage_graph.batch_size, self._shapes_planned)
        executor.ensure_grads()
        t0 = start() if start is not None else time.perf_counter()
        with autocast(self.precision, self.device):
            self.last_step = executor.run_iteration(flat if self.reads_inputs else None, t0, self._steps, wait=wait)
        self._steps += 1

    def _ready_to_run(self) -> None:
        """Before a step or an evaluation: not closed, rank 0's weights in (a real model), every meta tensor
        filled."""
        if self._closed:
            raise InputError("this Pipeline was closed: its process groups are gone (build a new one to train on)")
        self._receive_rank0_weights()
        if self._uninitialised:
            names = self._uninitialised
            raise InputError(f"{len(names)} tensor(s) of rank {self.rank}'s stages were built on the meta device and "
                             f"have no initialiser (reset_parameters), e.g. {', '.join(names[:3])}: load them "
                             "first with pipe.load(checkpoint)")

    def _flat(self, inputs: Any, target: Any) -> tuple:
        """The graph's flat inputs for ``inputs`` and ``target``, checked against the captured structure.

        Inputs that are a tensor or a tuple (list) of tensors, with no target
        or a tensor, flatten to themselves: once such a structure passed the
        full check (``pytree`` flattening and a comparison of tree specs,
        every step), the same structure is taken as is.
        """
        key = _plain_structure(inputs, target)
        if key is not None and key in self._plain_structures:
            flat = ((inputs,) if key[0] == 0 else tuple(inputs)) + ((target,) if key[1] else ())
        else:
            flat = self._flat_checked(inputs, target)
            if key is not None:
                self._plain_structures.add(key)
        self._step_shape = self._shape_of(flat)
        return flat

    def _shape_of(self, flat: tuple):
        """The step's sizes (:class:`~graphpipe.frontend.shapes.StepShape`), refused in one line, on every rank
        alike and before anything runs, where the program or the plan cannot take them: a dim the model pins,
        more rows than the plan's batch, a partial batch too small to give every micro-batch a row."""
        return self._checked(self._shapes.bind(flat))

    def _checked(self, shape):
        from graphpipe.runtime.routing import rows_refusal

        refusal = rows_refusal(self.plan.stage_graph, shape.rows, self._has_batchnorm)
        if refusal is not None:
            raise InputError(refusal)
        self._memory_guard(shape)
        return shape

    def _memory_guard(self, shape) -> None:
        """Refuse a step whose sizes would not fit the plan's devices: the plan's predicted peak per device with
        its activations scaled by the step's tokens (rows times every varying dim) over the planned ones, against
        the device memory the plan was made for (activations grow with the longest length's growth: exact for
        per-token layers, a lower bound under attention). Every rank checks the same numbers."""
        pred = self.plan.predicted
        peaks, acts = getattr(pred, "peak_memory_bytes", None), getattr(pred, "peak_activation_bytes", None)
        cluster = getattr(self.plan, "cluster", None)
        if not peaks or not acts or cluster is None or shape.bindings == self._shapes_planned:
            return
        search = self.plan.search or {}
        # the plan's memory is at --max-shape's length when it was planned with one, else at the example's
        stretch = max(1.0, search["max_shape"] / search["example_length"]) if search.get("max_shape") else 1.0
        grow = max((size / (self._shapes_planned[sym] * stretch) for sym, size in shape.bindings.items()
                    if sym != self._shapes.batch and self._shapes_planned.get(sym)), default=1.0)
        ratio = shape.rows / self.plan.stage_graph.batch_size * grow
        if ratio <= 1.0:
            return
        limit = cluster.memory_bytes
        for d, (peak, act) in enumerate(zip(peaks, acts)):
            need = peak - act + act * ratio
            if need > limit:
                sizes = ", ".join(f"{size}" for sym, size in shape.bindings.items() if sym != self._shapes.batch)
                raise InputError(f"a step of {shape.rows} rows at length {sizes} would need about "
                                 f"{need / 1e9:.1f} GB on device {d} ({ratio:.2f}x the planned activations; the "
                                 f"plan's devices have {limit / 1e9:.1f} GB): give shorter batches or re-plan with "
                                 "--max-shape at this size")

    def _flat_checked(self, inputs: Any, target: Any) -> tuple:
        args, kwargs = normalize_inputs(inputs)
        if self._io.target_spec is not None and target is None:
            raise InputError("the loss takes a target: call step(inputs, target)")
        if self._io.target_spec is None and target is not None:
            if self._model is None or _takes_target(self._loss_fn) is False:
                raise InputError("the loss takes no target (loss_fn(output)); call step(inputs)")
            self._recapture(inputs, target)
        return self._io.flat_inputs(args, kwargs, target)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so the global ``norm_type`` norm (all stages, each parameter once) is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` on the whole model; returns the norm before clipping.

        The partial norms stay on the device and are all-reduced there (one
        collective); the norm comes back as a 0-dim float64 tensor on the
        device (torch's is a 0-dim tensor too), so clipping never waits for
        the device.
        """
        norm_type = float(norm_type)
        grads = [_local(p.grad.detach()) for p in self._counted if p.grad is not None]
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads])
            local = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
        else:
            local = torch.zeros((), dtype=torch.float64, device=self.device)
        total = local.reshape(1).to(self.device)
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            norm = total[0]
        else:
            dist.all_reduce(total)
            norm = total[0] ** (1.0 / norm_type)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        mine = [_local(p.grad) for p in self._setup.executor.parameters() if p.grad is not None]
        if mine:
            torch._foreach_mul_(mine, coef.to(mine[0].dtype))
        return norm

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def forward(self, inputs: Any) -> Any:
        """The model's output for ``inputs`` (no grad, eval mode: dropout off, BatchNorm running statistics),
        on every rank. Each stage runs once on the whole batch on its first replica, in stage order."""
        from graphpipe.runtime.runnable import autocast

        self._ready_to_run()
        sg = self.plan.stage_graph
        args, kwargs = normalize_inputs(inputs)
        rows = _batch([t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)])
        flat = self._io.flat_inputs(args, kwargs, self._zero_target(rows))
        # the values crossing cuts at this batch's sizes (any rows, any length the model takes)
        bindings = self._shapes.bind(flat, len(flat) - self._io.num_target_leaves).bindings
        at_shape = {n: m.at(bindings) for n, m in self._setup.executor.planned_meta.items()}
        values: dict[str, torch.Tensor] = {}
        out = None
        from graphpipe.runtime.comm import recv_header, send_header
        from graphpipe.runtime.intra_stage import eval_ranks

        for stage_id in range(sg.num_stages):
            prog = self._setup.programs.get(stage_id)
            if prog is None or self.rank not in eval_ranks(sg.stages[stage_id]):
                continue
            for name, index in prog.model_inputs:
                values[name] = flat[index].to(self.device)
            for producer, names in prog.recv_values:
                src = sg.stages[producer].devices[0]
                for n in names:
                    if src != self.rank:
                        meta = at_shape[n]
                        shape = recv_header(len(meta.shape(rows)), src, self.device) if meta.sized_by_data \
                            else meta.shape(rows)
                        buffer = torch.empty(shape, dtype=meta.dtype, device=self.device)
                        dist.recv(buffer, src)
                        values[n] = meta.from_wire(buffer)  # batch-major on the wire
            prog.module.eval()
            # an FSDP / TP stage runs through its wrapper (gathered weights, DTensor inputs) on its whole group
            call = self._setup.executor.hosted[stage_id].forward if sg.stages[stage_id].parallel else prog.module
            try:
                with autocast(self.precision, self.device):
                    sent, model_out = call(*[values[n] for n in prog.input_names])
            finally:
                prog.module.train()
                if hasattr(call, "reshard"):  # FSDP: back to the shards the optimizer holds
                    call.reshard()
            by_name = dict(zip(prog.output_names, sent))
            if sg.stages[stage_id].devices[0] != self.rank:
                continue  # the stage's first rank sends its outputs, to every rank that runs the consumer
            for consumer, names in prog.send_values:
                for dst in eval_ranks(sg.stages[consumer]):
                    for n in names:
                        if dst == self.rank:
                            values[n] = by_name[n]
                        else:
                            wire = at_shape[n].to_wire(by_name[n]).contiguous()
                            if at_shape[n].sized_by_data:
                                send_header(wire, dst)[0].wait()
                            dist.send(wire, dst)
            if prog.is_sink:
                out = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in model_out)
        holder = [out]
        dist.broadcast_object_list(holder, src=sg.stages[self._sink_id].devices[0])
        return self._io.output(holder[0][:len(self._io.kept)])

    def _zero_target(self, rows: int) -> Any:
        """Evaluation reads no target, but the graph takes one when the loss does: zeros of its shape."""
        if self._io.target_spec is None:
            return None
        from torch.utils import _pytree as pytree

        leaves = [torch.zeros((rows, *shape), dtype=dtype) for shape, dtype in self._target_shapes]
        return pytree.tree_unflatten(leaves, self._io.target_spec)

    # ------------------------------------------------------------------ checkpoints
    def _check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """An optimizer holding a parameter this rank does not own would step weights no stage trains."""
        if optimizer is None:
            return
        mine = {id(p) for p in self._setup.executor.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in mine:
                    raise InputError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that rank {self.rank} "
                                     "does not own: build it from pipe.parameters()")

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
        """This rank's share of the checkpoint: ``model/<name>`` (and ``optim/<name>/<key>``), each parameter
        from the rank that counts it, buffers from the first stage holding them."""
        self._check_optimizer(optimizer)
        counted = {id(p) for p in self._counted}
        state: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if id(p) in counted:
                state[f"model/{name}"] = p.detach()
                if optimizer is not None:
                    for key, value in optimizer.state.get(p, {}).items():
                        if isinstance(value, torch.Tensor):
                            state[f"optim/{name}/{key}"] = value
        for s, prog in self._setup.programs.items():
            if self.plan.stage_graph.stages[s].devices[0] != self.rank:
                continue
            for name, b in prog.module.named_buffers():
                if self._setup.buffer_stage.get(name) == s:
                    state[f"buffer/{name}"] = b
        state.update(getattr(self, "_unused_state", {}))  # rank 0: the whole model's unused tensors
        return state

    def close(self) -> None:
        """End of training: every rank waits for the others, then the process groups go.

        The groups this Pipeline made (replicas', tied parameters', NCCL's
        links, the checkpoint writer's) are destroyed and every reference to
        them dropped, and the default group is destroyed if this Pipeline
        created it (one you initialised is yours to destroy, after this
        barrier). When close returns, no group of the Pipeline's keeps a
        thread: under gloo one still alive at interpreter exit could abort
        the rank after a successful run (:mod:`graphpipe.runtime.teardown`).
        The Pipeline trains no more; its parameters stay readable. A script
        that initialises the default group itself should ``import
        torch.distributed.nn`` before doing so: imported later, that module
        keeps the world group alive until the interpreter exits.
        """
        if not dist.is_initialized():
            return
        self.wait_checkpoint()
        dist.barrier()
        self._closed = True
        mine = self._setup.executor.release_groups() + self._checkpoints.release_group()
        if self._owns_group:
            dist.destroy_process_group()
        else:
            for group in mine:
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # "Invalid process group": the caller destroyed it already
                    pass
        del mine
        collect_groups()

    def save(self, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None, *,
             step: int | None = None, keep: int = 2, async_save: bool = False) -> None:
        """Write a ``torch.distributed.checkpoint`` to ``directory`` (collective), atomically: into a fresh
        folder beside it, then renamed over it, so a job killed mid-save leaves the previous checkpoint.

        With ``step=N`` it is a *step checkpoint* for :meth:`resume`:
        ``directory/step-N``, with the step count and every rank's random
        generators, sealed only once complete; the newest ``keep`` are kept.
        ``async_save=True`` writes it in the background while training goes
        on (sealed at the next save, :meth:`wait_checkpoint` or :meth:`close`).
        See :mod:`graphpipe.runtime.resume`.
        """
        import torch.distributed.checkpoint as dcp

        self._receive_rank0_weights()
        if step is not None or async_save:
            if step is None:
                raise InputError("async_save needs step=N: only step checkpoints are written in the background")
            self._checkpoints.save(self, directory, step, optimizer, keep=keep, async_save=async_save)
            return
        self.wait_checkpoint()
        directory = os.fspath(directory)
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        tmp = f"{directory}.tmp-{token[0]}"
        state = self.state_dict(optimizer)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        dist.barrier()
        if self.rank == 0:
            replace_dir(tmp, directory)
        dist.barrier()

    def resume(self, directory: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Load the newest complete step checkpoint under ``directory`` (:meth:`save` with ``step=``) and return
        its step, or 0 when there is none, so a loop runs ``for step in range(pipe.resume(dir, opt), steps)``.

        A newer checkpoint cut off while written is skipped with a warning
        naming it, never loaded. The checkpoint may come from another plan of
        the same model (fewer ranks after a host was lost). Collective.
        """
        step = self._checkpoints.resume(self, directory, optimizer)
        if step is None:
            return 0
        self._steps = step
        return step

    def wait_checkpoint(self) -> None:
        """Wait until an ``async_save`` checkpoint is written, and seal it (collective; a no-op without one)."""
        self._checkpoints.finish(self)

    @property
    def steps_done(self) -> int:
        """Training steps this pipeline has taken, counting those before a :meth:`resume`."""
        return self._steps

    def load(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read the tensors of this rank's stages (replicas and tied copies included) from a checkpoint, by their
        names in the model, reading nothing else (every rank calls it).

        ``path``: a checkpoint written by :meth:`save` (by any plan of the
        same model; ``optimizer`` then gets its state back), a
        ``torch.distributed.checkpoint`` of the plain model's ``state_dict()``
        (a seed checkpoint written by one process), a ``.safetensors`` file or a
        Hugging Face ``save_pretrained`` folder (:mod:`graphpipe.runtime.checkpoint`).
        A missing or mis-shaped parameter is named in one error before
        anything is overwritten. Buffers are read where the checkpoint has
        them (a non-persistent one is not saved); once loaded, rank 0's
        weights are not sent to the other ranks.
        """
        from graphpipe.runtime.checkpoint import check_complete, checkpoint_layout, read_tensors

        self._check_optimizer(optimizer)
        layout = checkpoint_layout(path)
        params = list(self.named_parameters())
        buffers = [(name, b) for prog in self._setup.programs.values() for name, b in prog.module.named_buffers()]
        entries = [(layout.key(n), n, p) for n, p in params] + [(layout.key(n, "buffer"), n, b) for n, b in buffers]
        pending = set(self._uninitialised)
        check_complete(layout, {key: tuple(t.shape) for key, _, t in entries},
                       optional=[layout.key(n, "buffer") for n, _ in buffers if n not in pending])
        into: dict[str, torch.Tensor] = {}
        copies = []
        for key, name, t in entries:
            if key not in layout.shapes:
                continue
            if key in into:
                copies.append((t, key))  # a tied copy, or a buffer two stages read
            else:
                into[key] = t.detach()
            pending.discard(name)
        read_tensors(layout, into)
        with torch.no_grad():
            for t, key in copies:
                t.copy_(into[key])
        self._uninitialised = sorted(pending)
        self._from_rank0 = False  # every rank holds its stages' weights now
        if optimizer is not None and layout.kind == "graphpipe":
            self._load_optimizer(layout.path, optimizer, params)

    def _load_optimizer(self, directory: str, optimizer: torch.optim.Optimizer, params) -> None:
        """The optimizer state :meth:`save` wrote for this rank's parameters (``optim/NAME/KEY``)."""
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        state: dict[str, torch.Tensor] = {}
        for name, _ in params:
            for k, md in metadata.items():
                if k.startswith(f"optim/{name}/"):
                    state[k] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if not state:
            return
        import warnings

        with warnings.catch_warnings():  # each rank reads its own keys alone, on purpose (no_dist)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
        from graphpipe.runtime.dtensors import like

        for name, p in params:
            prefix = f"optim/{name}/"
            entry = {k[len(prefix):]: like(p, v.to(p.device)) for k, v in state.items() if k.startswith(prefix)}
            if entry:
                optimizer.state[p] = entry


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP / TP stage's DTensor as this rank's shard (a view: in-place changes reach it); others as is."""
    return t.to_local() if hasattr(t, "device_mesh") else t


def _takes_target(loss_fn: Callable[..., Any]) -> bool | None:
    """Whether ``loss_fn`` takes a second positional argument (the target); None when its signature is unknown."""
    import inspect

    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2


def _plain_structure(inputs: Any, target: Any) -> tuple[int, int] | None:
    """``(0 for a tensor or 1 + n for n tensors in a tuple or list, 1 with a tensor target else 0)``: a structure
    whose flat inputs are the tensors themselves; None for any other (dicts, nested inputs, a structured target).

    >>> import torch
    >>> _plain_structure(torch.ones(2), None), _plain_structure([torch.ones(2)] * 2, torch.ones(2))
    ((0, 0), (3, 1))
    >>> _plain_structure({"x": torch.ones(2)}, None) is None
    True
    """
    if isinstance(inputs, torch.Tensor):
        shape = 0
    elif isinstance(inputs, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in inputs):
        shape = 1 + len(inputs)
    else:
        return None
    if target is None:
        return shape, 0
    return (shape, 1) if isinstance(target, torch.Tensor) else None


def _put_back(split, keep: dict) -> None:
    """Each stage module's parameters replaced by the tensors ``keep`` holds for ``(stage, name)`` (tied copies
    are cloned anew by every split; the model's own parameters are the same objects already)."""
    for prog in split.programs:
        for name, p in list(prog.module.named_parameters()):
            old = keep.get((prog.stage_id, name))
            if old is not None and old is not p:
                owner, _, leaf = name.rpartition(".")
                prog.module.get_submodule(owner)._parameters[leaf] = old


def _batch(flat) -> int:
    for x in flat:
        if isinstance(x, torch.Tensor) and x.dim():
            return int(x.shape[0])
    raise InputError("inputs need at least one tensor whose dim 0 is the batch")

