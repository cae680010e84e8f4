"""What one rank does: build the model, keep its stages, run steps, report (DESIGN §8).

Every rank rebuilds the whole model from the plan's ``model`` spec and the
same seed (:func:`load_runnable`), captures it exactly as the planner did,
cuts it by stage (:mod:`graphpipe.runtime.stage_modules`) and keeps only the
programs of its own stages — the rest of the model is dropped with the
full module. Data is synthetic and deterministic: step ``k`` uses
``make_inputs(batch_size, seed * 1000 + k)`` and is generated only on ranks
whose stages read model inputs.

One *job* is one plan run for some steps; :func:`run_rank` runs a list of
jobs in one process group, so tests amortise process start-up over many
plans. A plan for fewer devices than the world leaves the extra ranks idle.

Measured iteration time: ranks meet at a barrier, each takes ``t0`` right
after it, runs its actions and gradient all-reduces, and the step time is
the max over ranks of ``end - t0`` (the optimizer step is excluded, as in
the simulator). The reported figure is the median over the steps after the
warm-up steps.

``--check`` (``RunOptions.check``): before the first step each rank runs
the same model on one process on the whole mini-batch (a fresh copy from
the same seed) and, after the first step's all-reduce, compares the loss and
the gradient of every parameter it owns with ``|a - b| <= atol + rtol*|b|``
(fp32 defaults of ``torch.testing.assert_close``: rtol 1.3e-6, atol 1e-5).
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from graphpipe.errors import PlanError
from graphpipe.plan import Plan, plan_from_dict
from graphpipe.runtime.executor import RankExecutor, StepResult
from graphpipe.runtime.routing import Routing
from graphpipe.runtime.stage_modules import ModelSplit, boundary_meta, check_op_names, split_model

__all__ = ["RunOptions", "rank_cpus", "pin_rank", "Runnable", "load_runnable", "run_rank", "run_job", "data_seed", "reference_step",
           "compare_gradients", "finish_job", "CHECK_RTOL", "CHECK_ATOL"]

log = logging.getLogger(__name__)

CHECK_RTOL = 1.3e-6
CHECK_ATOL = 1e-5


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    steps: int = 3
    """Training iterations to run (the first ``warmup_steps`` are not measured)."""
    warmup_steps: int = 1
    backend: str = "auto"
    """gloo, nccl, or auto (nccl when every rank has its own GPU, else gloo)."""
    check: bool = False
    """Compare the first iteration's loss and gradients with a single-process run."""
    timeout_s: float = 60.0
    """Process-group timeout: any wait longer than this fails the run."""
    seed: int = 0
    lr: float = 0.01
    """SGD learning rate of the per-rank optimizer step."""
    num_threads: int = 1
    """torch intra-op threads per rank (1: ranks share the host's cores fairly)."""
    cpus_per_rank: int = 0
    """Pin each rank to this many CPUs of its own (0: no pinning); see :func:`rank_cpus`."""
    baseline: str | None = None
    """None for our executor, ``"torch"`` for torch.distributed.pipelining."""
    rtol: float = CHECK_RTOL
    atol: float = CHECK_ATOL

    def __post_init__(self) -> None:
        from graphpipe.errors import InputError

        if not isinstance(self.steps, int) or self.steps < 1:
            raise InputError(f"--steps must be a positive integer, got {self.steps!r}")
        if not 0 <= self.warmup_steps < self.steps:
            object.__setattr__(self, "warmup_steps", 0 if self.steps == 1 else min(self.warmup_steps, self.steps - 1))
        if self.backend not in ("auto", "gloo", "nccl"):
            raise InputError(f"--backend must be gloo, nccl or auto, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise InputError(f"--timeout must be > 0 seconds, got {self.timeout_s!r}")
        if not isinstance(self.cpus_per_rank, int) or self.cpus_per_rank < 0:
            raise InputError(f"--cpus-per-rank must be a non-negative integer, got {self.cpus_per_rank!r}")
        if self.baseline not in (None, "torch"):
            raise InputError(f"--baseline must be 'torch', got {self.baseline!r}")


def rank_cpus(local_rank: int, per_rank: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The CPUs local rank ``local_rank`` is pinned to: its own ``per_rank`` of the allowed set.

    Rank ``r`` gets the ``r``-th run of ``per_rank`` consecutive CPUs of
    ``allowed`` (default: this process's affinity, sorted), so no two ranks
    of one host share a CPU. Pinning keeps the OS from moving a rank's
    compute thread between cores mid-iteration and from stacking two ranks on
    one core while another idles; with two CPUs per rank its gloo threads
    have a core of their own next to the compute thread. Raises
    :class:`~graphpipe.errors.InputError` when the set is too small.
    """
    from graphpipe.errors import InputError

    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    need = (local_rank + 1) * per_rank
    if need > len(cpus):
        raise InputError(f"--cpus-per-rank {per_rank}: rank {local_rank} needs CPUs up to the {need}th, "
                         f"but this process may use {len(cpus)} ({_cpu_list(cpus)})")
    return cpus[local_rank * per_rank:need]


def pin_rank(local_rank: int, per_rank: int) -> None:
    """Pin this process to local rank ``local_rank``'s CPUs (:func:`rank_cpus`); ``per_rank`` 0 leaves it free.

    Call it before threads start: gloo's and torch's threads inherit it.
    """
    if per_rank:
        os.sched_setaffinity(0, rank_cpus(local_rank, per_rank))


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus[:8])) + (",..." if len(cpus) > 8 else "")


def data_seed(seed: int, step: int) -> int:
    return seed * 1000 + step


@dataclass(frozen=True, slots=True, eq=False)
class Runnable:
    """A model ready to split: the module, its capture, loss and data generator."""

    spec: str
    module: torch.nn.Module
    gm: torch.fx.GraphModule
    op_nodes: dict[str, tuple[str, ...]]
    op_names: tuple[str, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    make_inputs: Callable[[int, int], tuple[torch.Tensor, ...]]


def load_runnable(spec: str, seed: int = 0, device: str = "cpu", capture: bool = True) -> Runnable:
    """Build (and trace) the model named by a plan's ``model``: a zoo spec or ``file.py:factory``.

    Factory models get synthetic inputs shaped like their example inputs
    (floats ~ N(0, 1), integers uniform in ``[0, max(example) + 1)``).
    ``capture=False`` skips tracing (the single-process reference needs only
    the module).
    """
    from graphpipe import capture as cap

    if ".py:" in spec:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module, example, loss_fn = cap.load_factory(spec)
        module = module.to(device)
        make_inputs = _synthetic_inputs(example, device)
    elif spec.endswith((".json", ".txt")) or os.path.sep in spec:
        raise PlanError(f"plan model {spec!r} is a graph file, which has no module to run; the runtime needs a zoo "
                        "spec (mmt:small) or path/to/file.py:factory — plan that instead")
    else:
        from graphpipe import zoo

        built = zoo.build(spec, device=device, seed=seed)
        module, example, loss_fn, make_inputs = built.module, built.example_inputs, built.loss_fn, built.make_inputs
    if not capture:
        return Runnable(spec, module, None, {}, (), loss_fn, make_inputs)  # type: ignore[arg-type]
    gm, op_nodes = _trace_ops(cap, module, example, spec)
    return Runnable(spec, module, gm, op_nodes, tuple(op_nodes), loss_fn, make_inputs)


def _trace_ops(cap, module: torch.nn.Module, example: Sequence[torch.Tensor], spec: str):
    """The capture's fx graph and op -> fx nodes map, without its cost measurement.

    ``capture.capture`` also measures FLOPs and bytes of every node (seconds
    per rank); the runtime needs only the grouping, which is the capture's own
    ``trace`` + ``group_nodes`` — the same functions ``capture`` calls, so
    the op names are the planner's.
    """
    if hasattr(cap, "trace") and hasattr(cap, "group_nodes"):
        gm, anchors = cap.trace(module, len(example))
        op_of_node, _ = cap.group_nodes(gm, anchors)
        op_nodes: dict[str, list[str]] = {}
        for node in gm.graph.nodes:  # fx order: ops in order of their first node, as capture reports them
            if node.name in op_of_node:
                op_nodes.setdefault(op_of_node[node.name], []).append(node.name)
        return gm, {op: tuple(names) for op, names in op_nodes.items()}
    captured = cap.capture(module, example, name=spec)
    return captured.gm, dict(captured.op_nodes)


def _synthetic_inputs(example: Sequence[torch.Tensor], device: str):
    def make_inputs(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for x in example:
            shape = (batch_size, *x.shape[1:])
            if x.dtype.is_floating_point:
                out.append(torch.randn(shape, generator=gen, dtype=x.dtype).to(device))
            else:
                high = int(x.max().item()) + 1 if x.numel() else 1
                out.append(torch.randint(0, max(high, 1), shape, generator=gen, dtype=x.dtype).to(device))
        return tuple(out)

    return make_inputs


def reference_step(spec: str, seed: int, batch_size: int, step_seed: int, device: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients of a fresh copy of the model on the whole mini-batch."""
    ref = load_runnable(spec, seed, device, capture=False)
    inputs = ref.make_inputs(batch_size, step_seed)
    loss = ref.loss_fn(ref.module(*inputs))
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in ref.module.named_parameters() if p.grad is not None}


def _pick_backend(requested: str, world_size: int) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _edge_values(split: ModelSplit) -> dict[tuple[int, int], tuple[str, ...]]:
    return {(prog.stage_id, c): values for prog in split.programs for c, values in prog.send_values}


def run_job(rank: int, world_size: int, plan: Plan, options: RunOptions, device: torch.device,
            backend: str, control=None) -> dict[str, Any] | None:
    """Run one plan on this rank; rank 0 returns the job's result, other ranks ``None``.

    ``control`` is the process group for barriers and figures (a CPU gloo
    group under NCCL; ``None``: the world group).
    """
    if options.baseline == "torch":
        from graphpipe.runtime.baseline import run_torch_job

        return run_torch_job(rank, world_size, plan, options, device, control)
    sg, schedule = plan.stage_graph, plan.schedule
    if sg.num_devices > world_size:
        raise PlanError(f"plan needs {sg.num_devices} ranks, the job has {world_size}")
    my_stages = sg.stages_on_device(rank) if rank < sg.num_devices else ()
    # Every rank builds the model, so all agree on the boundary values and shapes.
    runnable = load_runnable(plan.model, options.seed, "cpu")
    check_op_names([op.name for op in sg.graph.ops], runnable.op_names, plan.model)
    split = split_model(runnable.gm, runnable.op_nodes, sg)
    meta = boundary_meta(runnable.gm, split.boundary_values, runnable.make_inputs)
    routing = Routing(sg, schedule, _edge_values(split), [v for v, m in meta.items() if m.needs_grad])
    from graphpipe.runtime.comm import make_link_groups

    link_groups = make_link_groups(routing, world_size, backend)
    dp_groups, ar_order = {}, {}
    for stage in sg.stages:
        if stage.num_replicas > 1 and stage.devices not in dp_groups:
            dp_groups[stage.devices] = dist.new_group(list(stage.devices))
            first = schedule.device_actions[stage.devices[0]]
            last_b = {}
            for pos, a in enumerate(first):
                if a.kind == "B":
                    last_b[a.stage_id] = pos
            ar_order[stage.devices] = sorted((s for s in last_b if sg.stages[s].devices == stage.devices), key=last_b.get)
    programs = {s: split.programs[s] for s in my_stages}
    for prog in programs.values():
        prog.module.to(device)
    loss_fn, make_inputs = runnable.loss_fn, runnable.make_inputs
    reads_inputs = any(programs[s].model_inputs for s in my_stages)
    del runnable, split  # drop every other stage's parameters
    executor = RankExecutor(rank, sg, schedule.device_actions[rank] if rank < sg.num_devices else (), programs, routing,
                            meta, loss_fn, device, options.timeout_s, link_groups,
                            {k: v for k, v in dp_groups.items() if rank in k}, ar_order)
    params = executor.parameters()
    optimizer = torch.optim.SGD(params, lr=options.lr) if params else None
    reference = None
    if options.check and my_stages:
        reference = reference_step(plan.model, options.seed, sg.batch_size, data_seed(options.seed, 0), "cpu")

    steps: list[StepResult] = []
    check_stats = (0.0, 0, 0)
    for step in range(options.steps):
        inputs = make_inputs(sg.batch_size, data_seed(options.seed, step)) if reads_inputs else None
        executor.zero_grad()
        dist.barrier(group=control)
        t0 = time.perf_counter()
        result = executor.run_iteration(inputs, t0)
        steps.append(result)
        if step == 0 and reference is not None:
            # Replicas all compare; only a stage's first replica counts its parameters.
            check_stats = compare_gradients(((name, p, sg.stages[s].devices[0] == rank) for s in sorted(programs)
                                             for name, p in programs[s].module.named_parameters()), reference[1], options)
        if optimizer is not None:
            optimizer.step()
    return finish_job(rank, world_size, plan, options, [s.iteration_time_s for s in steps], [s.loss for s in steps],
                      check_stats, reference, records=[[asdict(r) for r in s.records] for s in steps], backend=backend,
                      starts=[s.t0 for s in steps], control=control)


def compare_gradients(named_params, ref_grads: dict[str, torch.Tensor], options: RunOptions) -> tuple[float, int, int]:
    """``(max |a - b|, elements outside atol + rtol*|b|, parameters counted)`` against the reference.

    ``named_params`` yields ``(name, parameter, counted)``.
    """
    max_abs, mismatches, count = 0.0, 0, 0
    for name, p, counted in named_params:
        if name not in ref_grads:
            raise PlanError(f"--check: parameter {name!r} has no gradient in the single-process run")
        if p.grad is None:
            raise PlanError(f"--check: parameter {name!r} got no gradient in the pipelined run")
        ref = ref_grads[name].to(p.grad.device)
        diff = (p.grad - ref).abs()
        if diff.numel():
            max_abs = max(max_abs, float(diff.max()))
        mismatches += int((diff > options.atol + options.rtol * ref.abs()).sum())
        count += int(counted)
    return max_abs, mismatches, count


def finish_job(rank: int, world_size: int, plan: Plan, options: RunOptions, step_times: Sequence[float],
               step_losses: Sequence[float], check_stats: tuple[float, int, int], reference, records: Sequence,
               backend: str, extra: dict | None = None, starts: Sequence[float] | None = None,
               control=None) -> dict[str, Any] | None:
    """Combine every rank's figures on rank 0 (collective: every rank calls it).

    Records are relative to each rank's own start after the barrier. On one
    host ``time.perf_counter`` is one monotonic clock shared by all
    processes, so rank 0 shifts every rank's records to the earliest start:
    the measured timeline is then causally exact (a consumer's F never
    starts before its producer's F ended). Across hosts each rank's barrier
    exit stays its zero.
    """
    sg = plan.stage_graph
    times = torch.tensor(list(step_times), dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=control)
    losses = torch.tensor(list(step_losses), dtype=torch.float64)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=control)
    max_abs = torch.tensor([check_stats[0]], dtype=torch.float64)
    dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=control)
    counts = torch.tensor([check_stats[1], check_stats[2]], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=control)
    measured_idx = list(range(options.warmup_steps, options.steps))
    step_list = [float(times[i]) for i in measured_idx]
    med = statistics.median(step_list)
    shown = min(measured_idx, key=lambda i: (abs(float(times[i]) - med), i))
    gathered = [None] * world_size if rank == 0 else None
    mine = (socket.gethostname(), starts[shown] if starts else 0.0, list(records[shown]) if records else [],
            sorted(os.sched_getaffinity(0)))
    dist.gather_object(mine, gathered, dst=0, group=control)
    if rank != 0:
        return None
    if len({host for host, _, _, _ in gathered}) == 1:
        origin = min(t0 for _, t0, _, _ in gathered)
        gathered = [(host, t0, [_shift(r, t0 - origin) for r in recs], cpus) for host, t0, recs, cpus in gathered]
    out: dict[str, Any] = {
        "measured": {"iteration_time_s": med, "throughput": sg.batch_size / med,
                     "step_times_s": step_list, "warmup_steps": options.warmup_steps, "timeline_step": shown},
        "losses": [float(x) for x in losses],
        "records": [r for _, _, recs, _ in gathered for r in recs],
        "backend": backend,
        "rank_cpus": [cpus for _, _, _, cpus in gathered],
    }
    out.update(extra or {})
    if options.check:
        if reference is None:
            reference = reference_step(plan.model, options.seed, sg.batch_size, data_seed(options.seed, 0), "cpu")
        ref_loss = reference[0]
        loss_diff = abs(float(losses[0]) - ref_loss)
        total_params = len(reference[1])  # every parameter the forward uses must have been compared once
        passed = (counts[0] == 0 and loss_diff <= options.atol + options.rtol * abs(ref_loss)
                  and int(counts[1]) == total_params)
        out["check"] = {"passed": bool(passed), "max_abs_diff": max(float(max_abs[0]), loss_diff),
                        "loss": float(losses[0]), "reference_loss": ref_loss, "loss_abs_diff": loss_diff,
                        "num_params_checked": int(counts[1]), "num_params": total_params,
                        "num_mismatches": int(counts[0]), "rtol": options.rtol, "atol": options.atol}
    return out


def _shift(record: dict, offset: float) -> dict:
    return {**record, "ready": record["ready"] + offset, "start": record["start"] + offset, "end": record["end"] + offset}


def run_rank(rank: int, world_size: int, jobs: Sequence[tuple[dict, RunOptions]], init_method: str,
             on_job_done: Callable[[int, dict | None], None] | None = None) -> list[dict | None]:
    """Join the process group and run every job in order; returns rank 0's results (``None`` elsewhere)."""
    options0 = jobs[0][1]
    pin_rank(int(os.environ.get("LOCAL_RANK", rank)), options0.cpus_per_rank)
    torch.set_num_threads(options0.num_threads)
    backend = _pick_backend(options0.backend, world_size)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if os.environ.get("GRAPHPIPE_FAIL_RANK") == str(rank) and os.environ.get("GRAPHPIPE_FAIL_AT") == "setup":
        raise RuntimeError(f"injected failure at setup (GRAPHPIPE_FAIL_RANK={rank}, GRAPHPIPE_FAIL_AT=setup)")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=options0.timeout_s),
                            device_id=device if backend == "nccl" else None)
    results = []
    try:
        # Barriers and figures travel on CPU tensors: under NCCL they get a gloo group of their own.
        control = dist.new_group(backend="gloo") if backend == "nccl" else None
        for index, (plan_doc, options) in enumerate(jobs):
            plan = plan_from_dict(plan_doc)
            result = run_job(rank, world_size, plan, options, device, backend, control)
            results.append(result)
            if on_job_done is not None:
                on_job_done(index, result)
    finally:
        dist.destroy_process_group()
    return results
