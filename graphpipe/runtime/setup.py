"""One rank's set-up for a plan, shared by every path that trains (docs/design.md, "The runtime").

:func:`setup_rank` builds what a rank needs before its first step: the
routing of every message, the process groups (created by every rank in the
same order, since ``new_group`` is collective), the tied parameters' sums,
BatchNorm's replica groups, and the :class:`~graphpipe.runtime.executor.RankExecutor`
over one :class:`~graphpipe.runtime.executor.ExecutorContext`. The training
API (:class:`graphpipe.Pipeline`, which ``graphpipe run`` also uses) and
PipeDream's asynchronous worker (:mod:`graphpipe.runtime.async_run`) both
call it, so a rank is set up one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphpipe.errors import InputError
from graphpipe.plan import Plan
from graphpipe.runtime.executor import ExecutorContext, RankExecutor, TiedSync
from graphpipe.runtime.reference import reference_layout
from graphpipe.runtime.routing import Routing
from graphpipe.runtime.stage_modules import ModelSplit, StageProgram, check_unbatched_edges

__all__ = ["setup_rank", "RankSetup"]


def _edge_values(split: ModelSplit) -> dict[tuple[int, int], tuple[str, ...]]:
    return {(prog.stage_id, c): values for prog in split.programs for c, values in prog.send_values}


@dataclass(frozen=True, slots=True, eq=False)
class RankSetup:
    """What one rank holds for a plan: its executor and stage programs, and what checks need to know."""

    executor: RankExecutor
    programs: dict[int, StageProgram]
    layout: dict[str, dict[str, int]]
    """Rows per call of every context-taking op (the reference's cut, :func:`reference_layout`)."""
    tied_copies: frozenset
    """``(stage, name)`` of the tied copies that do not count (only the owner's does)."""
    buffer_stage: dict[str, int]
    """Buffer name -> the first stage holding it (a read-only buffer several stages read counts once)."""


def setup_rank(rank: int, world_size: int, plan: Plan, split: ModelSplit, meta, loss_fn, device: torch.device,
               backend: str, *, timeout_s: float, seed: int, batchnorm: str, fault=None, measure: bool = True,
               stream=None, compile: bool = False, model=None) -> RankSetup:
    """Routing, process groups (created by every rank in the same order), tied parameters and the executor of
    ``rank``: the one set-up of ``graphpipe run`` (synchronous and asynchronous) and :class:`graphpipe.Pipeline`.

    ``stream``: ``(stage graph, schedule)`` of an asynchronous run's stream
    (:func:`~graphpipe.sched.async_pipe.stream_schedule`), which ``split`` was
    cut for; its replicas all-reduce inside the weight versions, not after
    the last backward, and its loss terms are scaled by the plan's mini-batch. ``compile``: every hosted
    stage's forward and backward compiled with ``torch.compile`` (:mod:`graphpipe.runtime.compiled`). ``model``:
    the whole model (on meta or not), whose Hugging Face ``base_model_tp_plan`` a tensor-parallel stage follows.
    """
    from graphpipe.runtime.comm import make_link_groups

    sg, schedule = stream if stream is not None else (plan.stage_graph, plan.schedule)
    my_stages = sg.stages_on_device(rank) if rank < sg.num_devices else ()
    routing = Routing(sg, schedule, _edge_values(split), [v for v, m in meta.items() if m.needs_grad])
    check_unbatched_edges(routing, meta)
    link_groups = make_link_groups(routing, world_size, backend)
    dp_groups, ar_order = {}, {}
    for stage in sg.stages:  # every rank creates every group, in stage order (new_group is collective)
        if stage.num_replicas > 1 and not stage.parallel and stage.devices not in dp_groups:
            dp_groups[stage.devices] = dist.new_group(list(stage.devices))
            if stream is not None:
                continue
            first = schedule.device_actions[stage.devices[0]]
            last_b = {}
            for pos, a in enumerate(first):
                if a.kind in ("B", "W"):
                    last_b[a.stage_id] = pos
            # whole copies only: an FSDP or TP stage on the same devices (virtual stages) reduces its own gradients
            ar_order[stage.devices] = sorted((s for s in last_b if sg.stages[s].devices == stage.devices
                                              and not sg.stages[s].parallel), key=last_b.get)
    tied = []
    tie_groups: dict[tuple[int, ...], object] = {}
    for tie in split.tied:  # every rank creates every group, in the same order (new_group is collective)
        ranks = tuple(sorted({d for s in tie.stages for d in sg.stages[s].devices}))
        if len(ranks) > 1 and ranks not in tie_groups:
            tie_groups[ranks] = dist.new_group(list(ranks))
        group = tie_groups.get(ranks)
        if rank in ranks:
            tied.append(TiedSync(tie.name, tuple(c for c in tie.copies if c[0] in my_stages), group))
    programs = {s: split.programs[s] for s in my_stages}
    buffer_stage: dict[str, int] = {}
    for prog in split.programs:
        for name, _ in prog.module.named_buffers():
            buffer_stage.setdefault(name, prog.stage_id)
    if batchnorm == "sync":
        from graphpipe.runtime.batchnorm import sharded_batchnorms

        for s, prog in programs.items():
            if sg.stages[s].round_robin and sg.stages[s].split > 1 and len(sharded_batchnorms(prog.module)) > 0:
                raise InputError(f"stage {s} is round-robin over groups of {sg.stages[s].split} replicas that "
                                 "split each micro-batch, and synchronized BatchNorm over a group is not "
                                 "supported: run with --batchnorm per-micro-batch (each replica normalises its "
                                 "own rows)")
            if sg.stages[s].num_replicas > 1 and not sg.stages[s].round_robin:  # round-robin: whole mbs already
                for bn in sharded_batchnorms(prog.module):
                    bn.group = dp_groups[sg.stages[s].devices]
    layout = reference_layout(plan, dict(split.node_stages), batchnorm) if stream is None else {}
    tied_copies = frozenset(c for tie in split.tied for c in tie.copies[1:])
    for prog in programs.values():
        prog.module.to(device)
    ctx = ExecutorContext(
        rank=rank, stage_graph=sg, actions=tuple(schedule.device_actions[rank]) if rank < sg.num_devices else (),
        programs=programs, routing=routing, meta=meta, loss_fn=loss_fn, device=device, timeout_s=timeout_s,
        link_groups=link_groups, dp_groups={k: v for k, v in dp_groups.items() if rank in k}, allreduce_order=ar_order,
        tied=tuple(tied), seed=seed, batchnorm=batchnorm, fault=fault, measure=measure, compile=compile,
        loss_batch_size=plan.stage_graph.batch_size)
    executor = RankExecutor(ctx)
    if any(stage.parallel for stage in sg.stages):  # FSDP and TP stages (every rank builds every mesh)
        from graphpipe.runtime.intra_stage import attach

        attach(executor, sg, split, rank, device, timeout_s, model)
    return RankSetup(executor, programs, layout, tied_copies, buffer_stage)
