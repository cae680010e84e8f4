"""The same plan on ``torch.distributed.pipelining`` (docs/design.md, "The runtime").

``graphpipe run PLAN --baseline torch`` runs a *sequential* plan with
PyTorch's own pipeline runtime: each stage's module (the same fx stage
programs our executor runs, from the same seed) wrapped in a
:class:`~torch.distributed.pipelining.PipelineStage`, driven by
``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` per the
plan's schedule name, on the same data and ranks. Figures and ``--check``
are computed as for our executor, so the two are directly comparable.

torch's pipelines are chains of stages with one micro-batch size, inputs
entering at stage 0, no data parallelism inside a stage, and a fixed
stage -> rank placement (stage ``i`` on rank ``i``; round-robin for
interleaved). :func:`torch_refusal` names the first property a plan lacks
(stage fan-out, a non-adjacent stage edge, per-stage micro-batch sizes,
replicated stages, model inputs read by a later stage, placement) — it is
checked before anything is launched.

``graph-1f1b`` on a chain with one micro-batch size is exactly 1F1B
(paper Alg. 2 reduces to it), so such plans run with ``Schedule1F1B``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from graphpipe.errors import PlanError
from graphpipe.plan import Plan
from graphpipe.runtime.driver import CheckTally, StepReport
from graphpipe.runtime.executor import zero_grads
from graphpipe.runtime.stage_modules import ModelSplit, StageProgram

if TYPE_CHECKING:
    from graphpipe.runtime.results import RunResult

__all__ = ["torch_refusal", "check_torch_expressible", "csv_runtime_class", "TorchEngine",
           "TORCH_SCHEDULES"]

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "graph-1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B"}


def torch_refusal(plan: Plan, split: ModelSplit | None = None, io=None) -> str | None:
    """Why torch.distributed.pipelining cannot express ``plan`` (``None`` when it can).

    Schedules torch has a class for run with that class (stage ``i`` on
    rank ``i``, round-robin for interleaved); any other flushing schedule
    (zero bubble, CP-SAT's, one read from a CSV) runs in torch's
    ``_PipelineScheduleRuntime`` from its CSV (:func:`csv_runtime_class`).
    With the capture's ``io`` (:class:`~graphpipe.frontend.exporting.IOSpec`), a
    loss target read by the last stage is torch's ``target`` (one tensor).
    """
    from graphpipe.sched.async_pipe import plan_spec
    from graphpipe.sched.torch_csv import torch_chain_refusal

    sg, name = plan.stage_graph, plan.schedule.name
    if plan_spec(plan) is not None:
        return f"schedule {name!r} is asynchronous (PipeDream's weight versions); torch's pipelines flush every step"
    if name not in TORCH_SCHEDULES and csv_runtime_class() is None:
        return (f"schedule {name!r} has no torch class (torch runs {', '.join(sorted(TORCH_SCHEDULES))}) and this "
                "torch has no _PipelineScheduleRuntime to run it from a CSV")
    reason = torch_chain_refusal(sg)
    if reason:
        return reason
    used = sg.devices_used()
    if used != tuple(range(len(used))) or len(used) != sg.num_devices:
        return f"the plan leaves devices idle (uses {list(used)} of {sg.num_devices}); torch needs every rank to hold a stage"
    k = len(used)
    if name == "interleaved":
        if sg.num_stages % k:
            return f"{sg.num_stages} virtual stages do not divide evenly over {k} ranks"
        wrong = [s.id for s in sg.stages if s.devices != (s.id % k,)]
    elif name in TORCH_SCHEDULES:
        if sg.num_stages != k:
            return f"{sg.num_stages} stages on {k} devices: torch's {TORCH_SCHEDULES[name]} runs one stage per rank"
        wrong = [s.id for s in sg.stages if s.devices != (s.id,)]
    else:
        wrong = []  # the CSV says where each stage runs
    if wrong:
        return (f"stage {wrong[0]} is on device {sg.stages[wrong[0]].devices[0]}, but torch places stage i on rank "
                f"{'i mod ranks' if name == 'interleaved' else 'i'}")
    if split is not None:
        num_inputs = io.num_inputs if io is not None else None  # the target's leaves follow the inputs
        if io is not None and io.num_target_leaves > 1:
            return f"the loss target has {io.num_target_leaves} tensors; torch's schedules split one target tensor"
        late = [p.stage_id for p in split.programs if p.stage_id != 0
                and any(num_inputs is None or i < num_inputs or p.stage_id != sg.num_stages - 1
                        for _, i in p.model_inputs)]
        if late:
            return f"stage {late[0]} reads model inputs directly (torch feeds the inputs to stage 0 only)"
        if split.sink_stage != sg.num_stages - 1:
            return f"the model output comes from stage {split.sink_stage}, not the last stage"
    return None


def csv_runtime_class():
    """torch's ``_PipelineScheduleRuntime`` (it loads and lowers a compute-only CSV), or ``PipelineScheduleMulti``
    where that is missing; ``None`` when neither is importable. Private in torch and moved between versions, so it
    is looked up, never imported by name."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return getattr(schedules, "_PipelineScheduleRuntime", None) or getattr(schedules, "PipelineScheduleMulti", None)


def check_torch_expressible(plan: Plan, split: ModelSplit | None = None, io=None) -> None:
    reason = torch_refusal(plan, split, io)
    if reason:
        raise PlanError(f"torch.distributed.pipelining cannot run this plan: {reason}. "
                        "Run it with graphpipe's own runtime (drop --baseline torch)")


class _TorchStage(torch.nn.Module):
    """A stage program with torch's calling convention: positional tensors in, tensor(s) out."""

    def __init__(self, prog: StageProgram, prev: StageProgram | None, is_last: bool, num_inputs: int,
                 num_outputs: int):
        super().__init__()
        self.prog = prog.module
        self.names = prog.input_names
        self.model_inputs = {name: i for name, i in prog.model_inputs if i < num_inputs}
        self.targets = [name for name, i in prog.model_inputs if i >= num_inputs]
        self.prev_outputs = prev.output_names if prev is not None else ()
        self.is_last = is_last
        self.num_outputs = num_outputs

    def forward(self, *args):
        if self.model_inputs:
            values = {name: args[index] for name, index in self.model_inputs.items()}
        else:
            values = dict(zip(self.prev_outputs, args))
        for name in self.targets:  # the graph passes the target through; torch hands it to the loss instead
            values[name] = args[0].new_empty(0)
        sent, out = self.prog(*(values[n] for n in self.names))
        if self.is_last:
            return tuple(out[:self.num_outputs])  # the model's outputs, without the target's stand-in
        return sent[0] if len(sent) == 1 else tuple(sent)


class TorchEngine:
    """``torch.distributed.pipelining`` as a job engine (:class:`~graphpipe.runtime.driver.Engine`): the plan's
    stage programs in torch's ``PipelineStage``s, driven by torch's schedule class (or its CSV runtime), on the
    same data and weights as graphpipe's executor; ``--check`` compares step 0 with one plain PyTorch step."""

    checks_each_step = False  # the reference is one plain step (reference_step)

    def __init__(self, rank: int, world_size: int, plan: Plan, options, device: torch.device, control=None) -> None:
        self.rank, self.world_size, self.plan, self.options = rank, world_size, plan, options
        self.device, self.control = device, control
        sg = plan.stage_graph
        self.my_stages = sg.stages_on_device(rank) if rank < sg.num_devices else ()
        self.schedule = None
        self.reference = None
        self._params: list[torch.nn.Parameter] = []

    def prepare(self) -> None:
        from torch.distributed import pipelining as pp

        from graphpipe.runtime.materialize import materialize_stages
        from graphpipe.runtime.reference import reference_step
        from graphpipe.runtime.runnable import data_seed, load_runnable, plan_granularity
        from graphpipe.runtime.stage_modules import check_op_names, split_model

        plan, options, device, my_stages = self.plan, self.options, self.device, self.my_stages
        sg = plan.stage_graph
        n = sg.num_devices
        group = dist.new_group(list(range(n))) if self.world_size > n else None
        # built on meta, each rank materializing its own stages, as graphpipe's executor does: the same weights
        runnable = load_runnable(plan.model, options.seed, "cpu", granularity=plan_granularity(plan),
                                 meta_params=True)
        check_op_names([op.name for op in sg.graph.ops], runnable.op_names, plan.model)
        split = split_model(runnable.gm, runnable.op_nodes, sg)
        check_torch_expressible(plan, split, runnable.io)
        self.num_inputs, num_outputs = runnable.io.num_inputs, len(runnable.io.kept)
        materialize_stages(runnable.module, {s: split.programs[s] for s in my_stages}, device, options.seed,
                           runnable.initial)
        loss_fn, self.make_inputs = runnable.loss_fn, runnable.make_inputs
        self.takes_target = takes_target = runnable.io.num_target_leaves == 1
        self.num_mbs = num_mbs = sg.num_micro_batches(0)
        wrappers = {s: _TorchStage(split.programs[s], split.programs[s - 1] if s else None, s == sg.num_stages - 1,
                                   self.num_inputs, num_outputs).to(device)
                    for s in my_stages}
        del runnable
        if my_stages:
            stages = [pp.PipelineStage(wrappers[s], s, sg.num_stages, device, group=group) for s in my_stages]

            def loss(output, target):  # torch passes (output, target): the target is ours, or a stand-in
                output = output if isinstance(output, tuple) else (output,)
                return loss_fn((*output, target) if takes_target else output)
            if plan.schedule.name in TORCH_SCHEDULES:
                cls = getattr(pp, TORCH_SCHEDULES[plan.schedule.name])
                self.schedule = cls(stages if plan.schedule.name == "interleaved" else stages[0], num_mbs,
                                    loss_fn=loss, scale_grads=True)
            else:  # torch's own CSV loader and lowering (sends, receives) run the plan's schedule
                self.schedule = _csv_schedule(plan, stages, num_mbs, loss, self.rank)
        self.programs = {s: split.programs[s] for s in my_stages}
        self._params = [p for prog in self.programs.values() for p in prog.module.parameters()
                        if p.requires_grad]  # not frozen
        if options.check and my_stages:
            self.reference = reference_step(plan.model, options.seed, sg.batch_size, data_seed(options.seed, 0), "cpu",
                                            plan_granularity(plan), meta_params=True)

    def num_steps(self) -> int:
        return self.options.steps

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def resume(self, directory: str, optimizer) -> int:
        raise PlanError("--checkpoint-dir: the torch baseline writes no step checkpoints (drop --baseline torch)")

    def save(self, directory: str, optimizer, step: int) -> None:
        self.resume(directory, optimizer)

    def step(self, step: int, clock) -> StepReport:
        from graphpipe.runtime.runnable import data_seed

        sg, device = self.plan.stage_graph, self.device
        flat = self.make_inputs(sg.batch_size, data_seed(self.options.seed, step))
        inputs = tuple(x.to(device) for x in flat[:self.num_inputs]) if 0 in self.my_stages else ()
        target = (flat[self.num_inputs].to(device) if self.takes_target
                  else torch.zeros(sg.batch_size, device=device))
        zero_grads(self._params)  # persistent buffers zeroed in place, as our executor does
        losses: list = []
        t0 = clock.start()
        if self.schedule is not None:
            if sg.num_stages - 1 in self.my_stages:
                # torch insists on a target for the last stage; a loss without one gets zeros it does not read
                self.schedule.step(*inputs, target=target, losses=losses)
            else:
                self.schedule.step(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        loss = float(sum(float(x.detach()) for x in losses) / self.num_mbs) if losses else 0.0
        return StepReport(elapsed, loss, t0)

    def check(self, step: int, first: bool) -> CheckTally | None:
        """Every gradient of this rank's stages against the plain step (by the stage module's names)."""
        from graphpipe.runtime.reference import compare_gradients

        if self.reference is None:
            return None
        return CheckTally.of_params(compare_gradients(
            ((name, p, True) for prog in self.programs.values() for name, p in prog.module.named_parameters()),
            self.reference.grads[0], self.options))

    def finish(self, run) -> RunResult | None:
        from graphpipe.runtime.results import finish_job

        plan = self.plan
        return finish_job(self.rank, self.world_size, plan, run.options, run.reports, run.tally, self.reference,
                          backend=dist.get_backend(), control=self.control,
                          baseline="torch.distributed.pipelining." + (
                              TORCH_SCHEDULES.get(plan.schedule.name)
                              or f"{csv_runtime_class().__name__} (CSV of {plan.schedule.name}{_file_note(plan)})"))

    def close(self) -> None:
        """torch's stages keep their groups (the job's world, or one sub-group over the plan's ranks)."""
        self.schedule = None


def _file_note(plan: Plan) -> str:
    from graphpipe.sched.torch_csv import torch_file_rows

    kept = torch_file_rows(plan)
    return f", {plan.search['torch_csv'].get('file')} as written, {kept[1]}" if kept is not None else ""


def _csv_schedule(plan: Plan, stages, num_mbs: int, loss, rank: int):
    """torch's CSV runtime over this rank's ``stages``: loaded from the torch file the plan's schedule was read
    from, as written (compute-only, or compute-and-comms with torch's own sends and receives), else from the
    plan's schedule written as torch's compute-only CSV."""
    import csv
    import io
    import os
    import tempfile

    from graphpipe.files import write_text_atomic
    from graphpipe.sched.torch_csv import to_torch_rows, torch_file_rows

    cls = csv_runtime_class()
    schedule = cls(stages, num_mbs, loss_fn=loss, scale_grads=True)
    kept = torch_file_rows(plan)
    rows, form = kept if kept is not None else (to_torch_rows(plan.stage_graph, plan.schedule), "compute_only")
    fd, path = tempfile.mkstemp(prefix=f"graphpipe-torch-rank{rank}-", suffix=".csv")
    os.close(fd)
    try:
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        write_text_atomic(path, text.getvalue())
        if form == "compute_comms":
            schedule._load_csv(path, format="compute_comms")
            _add_missing_reduce_grads(schedule, num_mbs)
        else:
            schedule._load_csv(path)
    finally:
        os.unlink(path)
    return schedule


def _add_missing_reduce_grads(schedule, num_mbs: int) -> None:
    """A compute-and-comms file whose rank lists no ``REDUCE_GRAD`` (torch's own test files predate it) gets
    torch's own pass that adds one after each stage's last backward: that action is where torch divides the
    summed gradients by the micro-batch count (``scale_grads``), which one-process training needs."""
    from torch.distributed.pipelining import schedules

    add = getattr(schedules, "_add_reduce_grad", None)
    reduce_grad = getattr(getattr(schedules, "_ComputationType", None), "REDUCE_GRAD", None)
    if add is None or reduce_grad is None:  # an older torch scales gradients without the action
        return
    for rank, actions in schedule.pipeline_order_with_comms.items():
        if not any(a is not None and a.computation_type == reduce_grad for a in actions):
            schedule.pipeline_order_with_comms[rank] = add(actions, num_mbs)
