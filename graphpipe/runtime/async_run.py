"""Run PipeDream's asynchronous schedules (1f1b-async, 2bw) for real, and their single-process replay oracle.

A run of ``K`` steps is one stream of ``K * M`` micro-batches through the
1F1B order without a flush (:func:`graphpipe.sched.async_pipe.stream_schedule`):
the stage graph of the stream is the plan's with ``K`` mini-batches
(:func:`~graphpipe.sched.async_pipe.stream_graph`), its rows are step ``k``'s
data at rows ``kB .. kB+B-1``, and every micro-batch's loss term is scaled
by the mini-batch ``B`` as in a flushing run. Each stage's weights live in a
:class:`~graphpipe.runtime.stash.WeightVersions`: F and B of micro-batch
``i`` run on version ``v(s, i)``, each update group's summed gradients step
SGD (``--lr``) on the latest version, replicas all-reduce at every update.

Measured figures: a stream has no per-step barrier, so the steady-state
iteration is the median over windows ``w >= 1`` of the time between the
ends of the last backward of windows ``w - 1`` and ``w`` (max over ranks;
one clock on one host); ``stream_time_s`` is the whole run. Stashed-weight
bytes are counted per rank (:attr:`WeightVersions.peak_stashed_bytes`) and
laid beside the prediction (stashed versions x the plan's weight bytes).

``--check`` replays the same version schedule in one process
(:func:`replay_reference`): micro-batch ``i`` runs through the whole
captured model with every parameter at its stage's version ``v(s, i)``
(``torch.func.functional_call``), all versions are kept, and each group's
summed gradients make the next version. Every rank compares the losses of its
sink micro-batches and the final weights of its stages with
``|a - b| <= atol + rtol |b|`` (fp32: rtol 1.3e-6, atol 1e-5).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from graphpipe.errors import InputError, PlanError
from graphpipe.plan import Plan
from graphpipe.runtime.driver import CheckTally, JobRun, StepReport
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.results import AsyncRun, Measured, ReplayCheck, RunResult
from graphpipe.runtime.runnable import data_seed, load_runnable, plan_granularity
from graphpipe.runtime.rng import ShardContext
from graphpipe.sched.async_pipe import AsyncSpec, VersionTable, stream_graph, stream_schedule, version_table

__all__ = ["ReplayResult", "replay_reference", "stream_inputs", "StreamEngine", "stage_of_params",
           "predicted_stash_bytes"]


@dataclass(frozen=True, slots=True, eq=False)
class ReplayResult:
    """What the single-process replay produced: each micro-batch's loss term and every stage's final weights."""

    mb_losses: tuple[float, ...]
    """Micro-batch ``i``'s loss, scaled by ``rows / batch_size`` as in the pipeline."""
    weights: dict[str, torch.Tensor]
    """Whole-model parameter name -> its value after the last update."""


def stream_inputs(make_inputs, batch_size: int, seed: int, steps: int) -> tuple[torch.Tensor, ...]:
    """The stream's data: step ``k``'s mini-batch (``data_seed(seed, k)``) at rows ``k B .. (k+1) B - 1``."""
    batches = [make_inputs(batch_size, data_seed(seed, k)) for k in range(steps)]
    return tuple(torch.cat(parts) for parts in zip(*batches))


def stage_of_params(split) -> dict[str, int]:
    """Whole-model parameter name -> the stage that owns it."""
    out = {}
    for prog in split.programs:
        for name, _ in prog.module.named_parameters():
            out[prog.param_names.get(name, name)] = prog.stage_id
    return out


def replay_reference(plan: Plan, table: VersionTable, seed: int, lr: float, steps: int) -> ReplayResult:
    """The replay oracle (module docstring): one process, micro-batches in order, versions from ``table``."""
    from graphpipe.runtime.stage_modules import split_model

    sg = plan.stage_graph
    ref = load_runnable(plan.model, seed, "cpu", granularity=plan_granularity(plan))
    owner = stage_of_params(split_model(ref.gm, ref.op_nodes, sg))
    gm = ref.gm
    gm.train()
    names = [n for n, _ in gm.named_parameters()]
    trains = {n: p.requires_grad for n, p in gm.named_parameters()}  # False: frozen, never stepped
    versions = [[{n: p.detach().clone() for n, p in gm.named_parameters() if owner[n] == s}]
                for s in range(sg.num_stages)]
    sums: list[dict[str, torch.Tensor] | None] = [None] * sg.num_stages
    inputs = stream_inputs(ref.make_inputs, sg.batch_size, seed, steps)
    b = sg.stages[0].micro_batch_size
    losses = []
    for i in range(table.num_micro_batches):
        params = {}
        for n in names:
            s = owner[n]
            params[n] = versions[s][table.version[s][i]][n].clone().requires_grad_(trains[n])
        ctx = ShardContext(seed, 0, i * b, b, i * b, b)
        out = torch.func.functional_call(gm, params, (*(x[i * b:(i + 1) * b] for x in inputs), ctx))
        loss = ref.loss_fn(out) * b / sg.batch_size
        loss.backward()
        losses.append(float(loss.detach()))
        for s in range(sg.num_stages):
            mine = {n: params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])
                    for n in names if owner[n] == s and trains[n]}
            sums[s] = mine if sums[s] is None else {n: sums[s][n] + g for n, g in mine.items()}
            if (i + 1) % table.group_size[s] == 0:
                latest = versions[s][-1]
                versions[s].append({n: latest[n] - lr * sums[s][n] if n in sums[s] else latest[n] for n in latest})
                sums[s] = None
    weights = {n: versions[s][-1][n] for s in range(sg.num_stages) for n in versions[s][-1]}
    return ReplayResult(tuple(losses), weights)


def _window_times(records: list[dict], num_mbs_per_window: int, steps: int) -> list[float]:
    """End of each window's last backward (max over ranks), in the shared clock."""
    ends = [0.0] * steps
    for r in records:
        if r["kind"] == "B":
            w = r["mb_id"] // num_mbs_per_window
            ends[w] = max(ends[w], r["end"])
    return ends


class StreamEngine:
    """PipeDream's asynchronous stream as a job engine (:class:`~graphpipe.runtime.driver.Engine`): the whole
    run of ``options.steps`` mini-batches is one driver step (no per-step barrier, no flush), weights updated
    inside their :class:`~graphpipe.runtime.stash.WeightVersions` (the driver's optimizer gets no parameters),
    and ``--check`` compares the final weights with the replay oracle (module docstring)."""

    checks_each_step = False

    def __init__(self, rank: int, world_size: int, plan: Plan, spec: AsyncSpec, options: RunOptions,
                 device: torch.device, backend: str, control=None) -> None:
        self.rank, self.world_size, self.plan, self.spec, self.options = rank, world_size, plan, spec, options
        self.device, self.backend, self.control = device, backend, control
        sg = plan.stage_graph
        self.my_stages = sg.stages_on_device(rank) if rank < sg.num_devices else ()
        self.reference: ReplayResult | None = None
        self.executor = None

    def prepare(self) -> None:
        from graphpipe.runtime.setup import setup_rank
        from graphpipe.runtime.stage_modules import boundary_meta, check_op_names, split_model
        from graphpipe.runtime.stash import WeightVersions

        plan, spec, options, rank = self.plan, self.spec, self.options, self.rank
        sg, steps = plan.stage_graph, options.steps
        self.table = table = version_table(sg, spec, steps)
        ssg = stream_graph(sg, steps)
        stream = stream_schedule(sg, spec.name, steps)
        runnable = load_runnable(plan.model, options.seed, "cpu", granularity=plan_granularity(plan))
        check_op_names([op.name for op in sg.graph.ops], runnable.op_names, plan.model)
        split = split_model(runnable.gm, runnable.op_nodes, ssg)
        if split.tied:
            raise InputError(f"{plan.model} ties parameters across stages ({split.tied[0].name}); asynchronous "
                             f"schedules keep one version history per stage and do not run tied copies yet")
        meta = boundary_meta(runnable.gm, split.boundary_values, runnable.make_inputs, options.precision)
        setup = setup_rank(rank, self.world_size, plan, split, meta, runnable.loss_fn, self.device, self.backend,
                           timeout_s=options.timeout_s, seed=options.seed, batchnorm="per-micro-batch",  # as its replay
                           fault=options.fault, stream=(ssg, stream))
        self.executor = executor = setup.executor
        self.programs = programs = setup.programs
        self.make_inputs = runnable.make_inputs
        self.reads_inputs = any(programs[s].model_inputs for s in self.my_stages)
        del runnable, split
        actions = executor.actions
        for s, prog in programs.items():
            stage = sg.stages[s]
            mbs = [a.mb_id for a in actions if a.stage_id == s and a.kind == "F"]
            executor.hosted[s].weights = WeightVersions(
                s, prog.module, table, mbs, options.lr, stage.num_replicas if stage.round_robin else 1,
                executor.dp_groups.get(stage.devices), stash=spec.stash, wait=executor.mailbox.wait_work)
        if options.check and (self.my_stages or rank == 0):
            self.reference = replay_reference(plan, table, options.seed, options.lr, steps)

    def num_steps(self) -> int:
        return 1  # the stream of every mini-batch is one run of the action list

    def parameters(self) -> list:
        return []  # each stage's weight versions step themselves

    def resume(self, directory: str, optimizer) -> int:
        raise PlanError("--checkpoint-dir: asynchronous schedules write no step checkpoints")

    def save(self, directory: str, optimizer, step: int) -> None:
        self.resume(directory, optimizer)

    def step(self, step: int, clock) -> StepReport:
        sg, options = self.plan.stage_graph, self.options
        inputs = stream_inputs(self.make_inputs, sg.batch_size, options.seed, options.steps) if self.reads_inputs \
            else None
        t0 = clock.start()
        result = self.executor.run_iteration(inputs, t0, 0, wait=True)
        return StepReport(result.iteration_time_s, sum(self.executor.sink_losses.values()), t0,
                          tuple(result.records))

    def check(self, step: int, first: bool) -> CheckTally | None:
        """The final weights of this rank's stages against the replay's (a stage's first replica counts)."""
        if self.reference is None or not self.my_stages:
            return None
        tally = CheckTally()
        sg = self.plan.stage_graph
        for s in sorted(self.programs):
            for name, p in self.programs[s].module.named_parameters():
                model_name = self.programs[s].param_names.get(name, name)
                tally = tally + _compare(p.detach(), self.reference.weights[model_name], self.options,
                                         sg.stages[s].devices[0] == self.rank)
        return tally

    def finish(self, run: JobRun) -> RunResult | None:
        """Rank 0 lays every rank's records, loss terms, stashed bytes and check on the stream's windows."""
        plan, options, spec, table, rank = self.plan, self.options, self.spec, self.table, self.rank
        sg, steps = plan.stage_graph, options.steps
        report = run.reports[0]
        executor = self.executor
        stash_bytes = sum(w.peak_stashed_bytes for w in executor.weights.values())
        mine = {"records": [asdict(r) for r in report.records], "t0": report.t0, "end": report.t0 + report.iteration_time_s,
                "sink_losses": dict(executor.sink_losses), "stash_bytes": stash_bytes,
                "check": (run.tally.max_abs_diff, run.tally.num_mismatches, run.tally.num_params)}
        gathered = [None] * self.world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.control)
        if rank != 0:
            return None
        origin = min(g["t0"] for g in gathered)
        all_records = [{**r, "ready": r["ready"] + g["t0"] - origin, "start": r["start"] + g["t0"] - origin,
                        "end": r["end"] + g["t0"] - origin} for g in gathered for r in g["records"]]
        m = sg.num_micro_batches(0)
        ends = _window_times(all_records, m, steps)
        diffs = [b - a for a, b in zip(ends, ends[1:])]
        iteration = statistics.median(diffs) if diffs else ends[0]
        stream_s = max(g["end"] for g in gathered) - origin
        losses_by_mb: dict[int, float] = {}
        for g in gathered:  # replicas of a split sink each hold their rows' share of a micro-batch's loss
            for i, loss in g["sink_losses"].items():
                losses_by_mb[i] = losses_by_mb.get(i, 0.0) + loss
        step_losses = [sum(losses_by_mb.get(i, 0.0) for i in range(k * m, (k + 1) * m)) for k in range(steps)]
        measured = Measured(iteration_time_s=iteration, throughput=sg.batch_size / iteration,
                            step_times_s=diffs or [iteration], warmup_steps=1 if diffs else 0, stream_time_s=stream_s,
                            stream_throughput=sg.batch_size * steps / stream_s,
                            stashed_weight_bytes=[float(g["stash_bytes"]) for g in gathered][:sg.num_devices],
                            stashed_weight_bytes_predicted=predicted_stash_bytes(sg, table),
                            iteration="median over windows w >= 1 of the gap between windows' last backward ends")
        check = None
        reference = self.reference
        if options.check and reference is not None:
            total = CheckTally()
            for g in gathered:
                total = total + CheckTally(*g["check"])
            loss_diffs = [abs(losses_by_mb[i] - reference.mb_losses[i]) for i in sorted(losses_by_mb)]
            loss_bad = sum(1 for i in losses_by_mb
                           if abs(losses_by_mb[i] - reference.mb_losses[i])
                           > options.atol + options.rtol * abs(reference.mb_losses[i]))
            check = ReplayCheck(passed=(total.num_mismatches == 0 and loss_bad == 0
                                        and len(losses_by_mb) == table.num_micro_batches
                                        and total.num_params == len(reference.weights)),
                                max_abs_diff=max([total.max_abs_diff, *loss_diffs]),
                                num_mismatches=total.num_mismatches + loss_bad,
                                num_params_checked=total.num_params, num_params=len(reference.weights),
                                losses_checked=len(losses_by_mb), what="every micro-batch's loss and the final weights",
                                reference="single-process replay of the version schedule", loss=step_losses[0],
                                reference_loss=sum(reference.mb_losses[:m]), rtol=options.rtol, atol=options.atol)
        return RunResult(measured=measured, losses=step_losses, records=all_records, backend=self.backend,
                         async_run=AsyncRun(schedule=spec.name, vertical_sync=spec.vertical_sync,
                                            update_every=spec.update_every, stash=spec.stash,
                                            stashed_versions=table.peak_stashed),
                         check=check)

    def close(self) -> None:
        """The job's end: the executor forgets its groups (replicas', links', weight versions')."""
        for group in self.executor.release_groups():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # already destroyed
                pass


def predicted_stash_bytes(sg, table: VersionTable) -> list[float]:
    """Per device: stashed versions of this run's version schedule x the plan's weight bytes (graphpipe.costs)."""
    from graphpipe import costs

    out = [0.0] * sg.num_devices
    for st in sg.stages:
        for q, d in enumerate(st.devices):
            out[d] += costs.weight_versions_bytes(sg.param_bytes(st.id), table.peak_stashed[st.id][q])
    return out


def _compare(a: torch.Tensor, b: torch.Tensor, options: RunOptions, counted: bool) -> CheckTally:
    """One tensor against the replay's: ``|a - b|``'s max and the elements outside ``atol + rtol |b|``."""
    diff = (a.double() - b.double()).abs()
    return CheckTally(float(diff.max()) if diff.numel() else 0.0,
                      int((diff > options.atol + options.rtol * b.double().abs()).sum()), int(counted))
