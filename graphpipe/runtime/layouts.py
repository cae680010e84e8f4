"""Which stage layouts the runtime executes (a stage's ``tp`` and ``shard``, docs/design.md#plan-files)."""

from __future__ import annotations

from graphpipe.plan import Plan

__all__ = ["layout_refusal"]


def layout_refusal(plan: Plan, *, compile: bool = False) -> str | None:
    """Why the runtime cannot execute ``plan``'s parallelism inside its stages, in one line (None: it can).

    FSDP stages and tensor-parallel stages run on torch's ``fully_shard`` and DTensor
    (:mod:`graphpipe.runtime.intra_stage`); what of them it does not run is refused by name before any rank
    starts rather than run with other semantics than planned. A round-robin stage runs FSDP-sharded gathered for
    the step (the only FSDP a round-robin stage may plan, :class:`graphpipe.stages.Stage`), tp 1 or 2-D, where
    no device runs other work after the stage's last backward on it (:func:`_work_after_round_robin_fsdp`).
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
    owed = _work_after_round_robin_fsdp(plan)
    if owed is not None:
        s, device, action = owed
        return (f"stage {s.id} is round-robin and FSDP-sharded, and device {device} runs stage {action.stage_id}'s "
                f"{action.kind} of micro-batch {action.mb_id} after the stage's last backward there: each replica "
                "reduce-scatters its gradients after its own last backward, waiting for the other replicas, which "
                "may need that work first; give the stage devices of its own, or shard none")
    segmented = [s for s in parallel if s.checkpoints]
    if segmented:
        s = segmented[0]
        kind = "FSDP-sharded" if s.shard == "fsdp" else "tensor-parallel"
        return (f"stage {s.id} is {kind} and re-materializes in segments (checkpoints at ops "
                f"{list(s.checkpoints)}): a segment would read the stage's parameters around FSDP's gathers and "
                "DTensor's inputs; drop its checkpoints (the whole stage re-materializes) or give it tp 1 and "
                "shard none")
    return None


def _work_after_round_robin_fsdp(plan: Plan):
    """``(stage, device, action)``: the first round-robin FSDP stage one of whose devices has an action of another
    stage after the stage's last backward (B or W) there; None when there is none.

    A round-robin FSDP stage's replicas finish their micro-batches at different times, and each reduce-scatters
    its gradients over all of them after its own last backward (:mod:`graphpipe.runtime.intra_stage`); the
    collective holds a replica until the last one gets there (a gloo rank's host, a CUDA rank's stream). With
    nothing after it on the device that wait delays only the step's end; an action after it (another stage on
    the same devices) might be what the other replicas are waiting for."""
    for s in plan.stage_graph.stages:
        if not (s.round_robin and s.shard == "fsdp"):
            continue
        for d in s.devices:
            actions = plan.schedule.device_actions[d]
            last = max((i for i, a in enumerate(actions) if a.stage_id == s.id and a.kind in ("B", "W")), default=-1)
            later = next((a for a in actions[last + 1:] if a.stage_id != s.id), None)
            if later is not None:
                return s, d, later
    return None
