"""A plan file without a schedule gets its strategy's default schedule and the simulator's prediction.

Hand-written or hand-edited plans (devices, tp, shard changed) may drop ``schedule`` and ``predicted``;
``graphpipe simulate``, ``graphpipe run`` and ``graphpipe.Pipeline`` read them through
:func:`read_plan_completed`, which fills both in and says so in one line.

Example
-------
>>> from graphpipe.graph import Op, OpGraph, Affine
>>> from graphpipe.stages import Stage, StageGraph
>>> from graphpipe.cluster import preset
>>> g = OpGraph.build("c", [Op(n, "x", Affine(0, 1.0), Affine(0, 2.0)) for n in "ab"], [("a", "b", 0.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], 2, 2)
>>> schedule, predicted = completion(sg, preset("v100", 2), "gpipe")
>>> schedule.name, predicted["iteration_time_s"]
('gpipe', 9.0)
"""

from __future__ import annotations

from typing import Any, Callable

from graphpipe.cluster import Cluster
from graphpipe.stages import StageGraph

__all__ = ["DEFAULT_SCHEDULES", "default_schedule", "completion", "read_plan_completed"]

DEFAULT_SCHEDULES = {"gpp": "graph-1f1b", "pipedream": "1f1b", "piper": "1f1b", "gpipe": "gpipe"}
"""Each strategy's own schedule (its :class:`graphpipe.search.common.Strategy` record's ``default_schedule``;
a test checks they agree). A ``custom`` plan takes 1F1B on a chain and graph-1F1B on a graph of stages."""


def default_schedule(sg: StageGraph, strategy: str) -> str:
    """The schedule a plan of ``strategy`` runs when its file names none."""
    if strategy in DEFAULT_SCHEDULES:
        return DEFAULT_SCHEDULES[strategy]
    return "1f1b" if sg.is_chain() else "graph-1f1b"


def completion(sg: StageGraph, cluster: Cluster, strategy: str):
    """``(schedule, predicted)``: the default schedule of ``strategy`` for ``sg`` and its simulated figures."""
    from graphpipe.sched import make_schedule
    from graphpipe.sched.simulator import simulate_figures

    schedule = make_schedule(default_schedule(sg, strategy), sg, cluster, validate=False)
    return schedule, simulate_figures(sg, schedule, cluster)


def read_plan_completed(path: str, say: Callable[[str], Any] | None = None):
    """:func:`graphpipe.plan.read_plan`, filling in a missing schedule and prediction; ``say(line)`` is told
    when it does (the CLI writes it to stderr)."""
    from graphpipe.plan import read_plan

    told = []

    def complete(sg, cluster, strategy):
        schedule, predicted = completion(sg, cluster, strategy)
        told.append(f"{path} has no schedule: using {strategy}'s default {schedule.name} schedule and its "
                    f"simulated prediction ({predicted['throughput']:.4g} samples/s)")
        return schedule, predicted

    plan = read_plan(path, complete=complete)
    if told and say is not None:
        say(told[0])
    return plan
