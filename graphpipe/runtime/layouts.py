"""Which stage layouts the runtime executes (a stage's ``tp`` and ``shard``, docs/design.md#plan-files)."""

from __future__ import annotations

from graphpipe.plan import Plan

__all__ = ["layout_refusal"]


def layout_refusal(plan: Plan, *, compile: bool = False) -> str | None:
    """Why the runtime cannot execute ``plan``'s parallelism inside its stages, in one line (None: it can).

    FSDP stages and tensor-parallel stages run on torch's ``fully_shard`` and DTensor
    (:mod:`graphpipe.runtime.intra_stage`); what of them it does not run is refused by name before any rank
    starts rather than run with other semantics than planned.
    """
    from graphpipe.sched.async_pipe import plan_spec

    parallel = [s for s in plan.stage_graph.stages if s.parallel]
    if not parallel:
        return None
    first = parallel[0]
    if plan_spec(plan) is not None:
        return (f"stage {first.id} is planned with tp {first.tp}, shard {first.shard}, and the schedule "
                f"{plan.schedule.name!r} is asynchronous (weight versions per micro-batch): FSDP and TP stages run "
                "synchronous schedules only; re-plan with another --schedule or --tp 1 --shard none")
    if compile:
        return (f"stage {first.id} is planned with tp {first.tp}, shard {first.shard}: compiled stages run whole "
                "copies only; drop --compile (compile=True) or re-plan with --tp 1 --shard none")
    split = {a.stage_id for actions in plan.schedule.device_actions for a in actions if a.kind in ("I", "W")}
    fsdp_split = [s for s in parallel if s.shard == "fsdp" and s.reshard_after_forward and s.id in split]
    if fsdp_split:
        return (f"stage {fsdp_split[0].id} is FSDP-sharded, resharding after forward, and the schedule "
                f"{plan.schedule.name!r} splits its backward (zero bubble's I and W): its per-op FSDP units reshard "
                "and reduce-scatter in I, before W computes the weight gradients; re-plan with a B schedule "
                "(1f1b, gpipe, interleaved, graph-1f1b), set the stage's reshard_after_forward to false (gathered "
                "for the step, as the planner plans FSDP), or give it shard none")
    segmented = [s for s in parallel if s.checkpoints]
    if segmented:
        s = segmented[0]
        kind = "FSDP-sharded" if s.shard == "fsdp" else "tensor-parallel"
        return (f"stage {s.id} is {kind} and re-materializes in segments (checkpoints at ops "
                f"{list(s.checkpoints)}): a segment would read the stage's parameters around FSDP's gathers and "
                "DTensor's inputs; drop its checkpoints (the whole stage re-materializes) or give it tp 1 and "
                "shard none")
    return None
