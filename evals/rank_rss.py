"""Host memory per rank against the prediction, for a model too big for one rank.

A GPT-style chain whose training state (16 bytes per parameter, as the
planner counts for Adam) does not fit one device of ``--memory-gb`` is
planned on ``--ranks`` CPU ranks and trained for ``--steps`` steps by
``graphpipe run`` (every rank builds the model on the meta device and
materializes only its own stages). Each rank reports its peak resident set
size (``ru_maxrss``); beside it:

* ``expected``: what the launcher checks before starting the ranks
  (:func:`graphpipe.runtime.memory.rank_memory`): its stages' weights and
  gradients, the plan's activations in flight, and a per-process base;
* ``stage_state``: weights and gradients of the stages it hosts, and the
  plan's activations (the part that should scale with its stages);
* ``tiny_rank``: the peak RSS of a rank of a tiny model's run (the
  measured fixed per-process base), so ``rss - tiny_rank`` is what the
  rank's stages cost;
* ``whole_model``: the bytes of the whole model's weights, what every rank
  held before ranks materialized their own stages.

Then the same model as two FSDP stages of two ranks each (the plan's first
and last halves merged, ``shard: fsdp``, run by torch's ``fully_shard``):
each rank should hold about half of its stage's weights and gradients, so
its RSS above the tiny rank should be about half of what that stage would
cost whole (``whole_stage``), and the launcher's estimate (which charges a
sharded stage's share) should hold.

Last, a small diffusers UNet (``evals/unet_model.py``: convolutions, group
norms, cross-attention) planned by gpp on three CPU ranks, each rank's peak
against the same estimate (a UNet rank once peaked 50% above it).

Usage::

    python -m graphpipe.evals.rank_rss --out evals      # writes evals/results/rank-rss.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

__all__ = ["run", "main"]

SPEC = "transformer:paper,layers=8,seq=64"
TINY = "transformer:small"


def _unet_plan(ranks: int, batch: int):
    """The UNet planned as ``graphpipe plan evals/unet_model.py:unet --devices RANKS --batch-size BATCH --cluster
    cpu`` plans it."""
    import os

    import graphpipe

    spec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unet_model.py") + ":unet"
    return graphpipe.plan(spec, devices=ranks, batch_size=batch, cluster="cpu")


def _plan(spec: str, ranks: int, batch: int, memory_gb: float | None):
    from graphpipe.frontend import zoo
    from graphpipe.cluster import preset
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    cluster = preset("v100", ranks)
    if memory_gb is not None:
        cluster = cluster.with_memory(memory_gb * 1e9)
    return make_plan(zoo.canonical_spec(spec), zoo.load_graph(spec), cluster, batch, "gpp",
                     SearchOptions(micro_batch_size=1))


def _sharded(plan):
    """``plan``'s model in two stages of ``ranks / 2`` FSDP ranks each: its first and last halves of stages merged,
    with the default schedule and the simulator's prediction (what a hand-edited plan file gets)."""
    from graphpipe.plan import Plan
    from graphpipe.sched.complete import completion
    from graphpipe.stages import Stage, StageGraph

    sg = plan.stage_graph
    n, half = sg.num_devices, sg.num_stages // 2
    groups = [sg.stages[:half], sg.stages[half:]]
    stages = [Stage(i, tuple(sorted(op for st in group for op in st.op_ids)),
                    tuple(range(i * n // 2, (i + 1) * n // 2)), n // 2, shard="fsdp")
              for i, group in enumerate(groups)]
    merged = StageGraph.build(sg.graph, stages, sg.batch_size, n, cluster=plan.cluster)
    schedule, predicted = completion(merged, plan.cluster, "custom")
    return Plan(model=plan.model, stage_graph=merged, cluster=plan.cluster, strategy="custom", schedule=schedule,
                predicted=predicted)


def _rows(plan, measured, tiny, base, layout):
    from graphpipe.runtime.memory import rank_memory

    sg = plan.stage_graph
    rows = []
    for r, mem in enumerate(rank_memory(plan)):
        stages = list(sg.stages_on_device(r))
        whole = sum(2.0 * sg.param_bytes(s) for s in stages)  # weights and gradients, unsharded
        rows.append({"layout": layout, "rank": r, "stages": stages, "rss_bytes": measured[r],
                     "expected_bytes": mem.total_bytes, "stage_state_bytes": mem.state_bytes + mem.activation_bytes,
                     "whole_stage_state_bytes": whole, "tiny_rank_bytes": tiny[r],
                     "rss_minus_tiny_bytes": measured[r] - base,
                     "error_vs_expected": (measured[r] - mem.total_bytes) / mem.total_bytes})
    return rows


def run(spec: str = SPEC, ranks: int = 4, batch: int = 4, steps: int = 2, memory_gb: float = 1.5) -> dict[str, Any]:
    """Plan and run ``spec`` and a tiny model on ``ranks`` CPU ranks; one row per rank of ``spec``'s run."""
    from graphpipe.errors import InfeasibleError
    from graphpipe.runtime import RunOptions, run_plan
    from graphpipe.runtime.memory import rank_memory

    try:  # the model must not fit one device of memory_gb: that is the point
        _plan(spec, 1, batch, memory_gb)
        raise SystemExit(f"{spec} fits one device of {memory_gb} GB: pick a larger model or a smaller --memory-gb")
    except InfeasibleError:
        pass
    plan = _plan(spec, ranks, batch, memory_gb)
    options = RunOptions(steps=steps, warmup_steps=1, timeout_s=1200, num_threads=1)
    tiny = run_plan(_plan(TINY, ranks, batch, None), options).measured.peak_rss_bytes
    measured = run_plan(plan, options).measured.peak_rss_bytes
    sharded = _sharded(plan)
    measured_fsdp = run_plan(sharded, options).measured.peak_rss_bytes
    base = statistics.median(tiny)
    sg = plan.stage_graph
    rows = _rows(plan, measured, tiny, base, "pipeline") + _rows(sharded, measured_fsdp, tiny, base, "2 x FSDP-2")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        unet = None
    else:
        unet = _unet_plan(3, 8)
        rows += _rows(unet, run_plan(unet, options).measured.peak_rss_bytes, tiny, base, "diffusers UNet (gpp)")
    for row in rows:  # the report's columns, in MB
        row.update({f"{k[:-6]}_mb": row[k] / 1e6 for k in ("rss_bytes", "expected_bytes", "stage_state_bytes",
                                                           "whole_stage_state_bytes", "rss_minus_tiny_bytes")})
    return {"config": {"spec": spec, "ranks": ranks, "batch_size": batch, "steps": steps, "memory_gb": memory_gb,
                       "tiny": TINY, "sharded": [list(st.devices) for st in sharded.stage_graph.stages]},
            "rows": rows,
            "summary": {"whole_model_weight_bytes": sg.graph.param_bytes, "tiny_rank_median_bytes": base,
                        "max_rss_bytes": max(measured), "max_error_vs_expected": max(abs(r["error_vs_expected"])
                                                                                      for r in rows),
                        # per FSDP rank: its RSS above the tiny rank over its stage's whole weights and gradients
                        "unet_max_error_vs_expected": max((abs(r["error_vs_expected"]) for r in rows
                                                           if r["layout"].startswith("diffusers")), default=None),
                        "fsdp_share": [round((r["rss_minus_tiny_bytes"]) / r["whole_stage_state_bytes"], 3)
                                       for r in rows if r["layout"] == "2 x FSDP-2"]}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default=SPEC)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--memory-gb", type=float, default=1.5)
    p.add_argument("--out", default=None, help="write OUT/results/rank-rss.json")
    args = p.parse_args(argv)
    result = run(args.spec, args.ranks, args.batch_size, args.steps, args.memory_gb)
    mb = 1e6
    print(f"{result['config']['spec']} on {args.ranks} CPU ranks; whole model's weights "
          f"{result['summary']['whole_model_weight_bytes'] / mb:.0f} MB; a tiny model's rank "
          f"{result['summary']['tiny_rank_median_bytes'] / mb:.0f} MB")
    print("layout      rank  stages          peak RSS MB  expected MB  stages' state+acts MB  RSS - tiny rank MB")
    for row in result["rows"]:
        print(f"{row['layout']:<10}  {row['rank']:>4}  {str(row['stages']):<14}  {row['rss_bytes'] / mb:>11.0f}  "
              f"{row['expected_bytes'] / mb:>11.0f}  {row['stage_state_bytes'] / mb:>21.0f}  "
              f"{row['rss_minus_tiny_bytes'] / mb:>18.0f}")
    if args.out:
        from graphpipe.evals.common import write_result

        print("wrote", write_result(args.out, "rank-rss", result["config"], result["rows"], result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
