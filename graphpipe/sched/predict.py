"""A plan's prediction: validate its schedule and simulate it (``graphpipe simulate``, ``Plan.simulate()``).

One function, so the CLI and the Python API predict the same figures: a
flushing schedule is simulated for one iteration; an asynchronous one
(``1f1b-async``, ``2bw``) is scored as its steady state
(:func:`~graphpipe.sched.async_pipe.async_figures`), and its timeline shows two
mini-batches of the stream.

Example
-------
>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.plan import Plan
>>> from graphpipe.sched.generators import make_schedule
>>> from graphpipe.stages import Stage, StageGraph
>>> g = OpGraph.build("c", [Op("a", "x", Affine(0, 1e-3)), Op("b", "x", Affine(0, 1e-3))], [("a", "b", 1.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 4, 2)
>>> plan = Plan(model="c", stage_graph=sg, cluster=preset("v100", 2), strategy="custom",
...             schedule=make_schedule("1f1b", sg))
>>> timeline, figures = predict(plan)
>>> figures["schedule"], figures["throughput"] > 0
('1f1b', True)
"""

from __future__ import annotations

from typing import Any

from graphpipe.plan import Plan

from graphpipe.sched.async_pipe import async_figures, plan_spec, stream_graph, stream_schedule
from graphpipe.sched.simulator import SharedHost, Timeline, predicted_figures, simulate, simulate_figures
from graphpipe.sched.validate import validate_plan

__all__ = ["predict"]


def predict(plan: Plan, host: SharedHost | None = None, *, validate: bool = True,
            timeline: bool = True) -> tuple[Timeline | None, dict[str, Any]]:
    """``(timeline, figures)`` of ``plan``'s schedule, validated first unless ``validate`` is False (a caller
    that has just generated it); ``host``: devices time-sharing a host. ``timeline=False``: ``(None, figures)``,
    the same figures summed without the records (:func:`~graphpipe.sched.simulator.simulate_figures`), which
    on thousands of devices are millions of objects built only to be summed."""
    if validate:
        validate_plan(plan)
    spec = plan_spec(plan)
    if spec is None:
        if not timeline:
            return None, simulate_figures(plan.stage_graph, plan.schedule, plan.cluster, host=host)
        records = simulate(plan.stage_graph, plan.schedule, plan.cluster, host=host)
        return records, predicted_figures(records)
    if not timeline:
        return None, async_figures(plan.stage_graph, plan.cluster, spec, host=host)
    records = simulate(stream_graph(plan.stage_graph, 2), stream_schedule(plan.stage_graph, spec.name, 2),
                       plan.cluster, host=host)
    return records, async_figures(plan.stage_graph, plan.cluster, spec, host=host)
