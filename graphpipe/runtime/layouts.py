"""Which stage layouts the runtime executes (a stage's ``tp`` and ``shard``, docs/design.md#plan-files)."""

from __future__ import annotations

from graphpipe.plan import Plan

__all__ = ["layout_refusal"]


def layout_refusal(plan: Plan) -> str | None:
    """Why the runtime cannot execute ``plan``'s parallelism inside its stages (None: it can).

    The planner may give a stage tensor parallelism (``tp``) or FSDP sharding (``shard``); the executor runs
    every stage as whole copies on each of its devices, so such a stage is refused by name before any rank
    starts rather than run with other semantics than planned.
    """
    for stage in plan.stage_graph.stages:
        if stage.parallel:
            return (f"stage {stage.id} is planned with tp {stage.tp}, shard {stage.shard}: the runtime executes "
                    f"whole-copy stages only (tp 1, shard none) for now; re-plan with --tp 1 --shard none to run it")
    return None
