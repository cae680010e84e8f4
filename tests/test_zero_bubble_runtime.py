"""Zero-bubble schedules executed for real on 4 CPU ranks (gloo): loss and every gradient equal one process.

One spawned 4-rank world runs every plan (process start-up dominates on a 2-core box): each zoo small model's
gpp plan with graph-zb, the sequential transformer's with zb-h1 and in ZB-V's V layout (two stages per rank),
and two hand-built stage graphs that exercise I/W with mixed micro-batch sizes and a replicated join stage (its
all-reduce after the last W).
"""

from __future__ import annotations

import pytest

from graphpipe.frontend import zoo
from graphpipe.cluster import preset
from graphpipe.plan import Plan
from graphpipe.sched import make_schedule, v_shape_chain

from test_runtime_dist import BATCH, SMALL, check_measured_timeline, hand_built, planned, run_checked

pytestmark = pytest.mark.slow


def zero_bubble_plans():
    plans = {}
    for spec in SMALL:
        plans[f"{spec}/gpp/graph-zb"] = planned(spec, "gpp", 4, "graph-zb")
    plans["transformer:small/pipedream/zb-h1"] = planned("transformer:small", "pipedream", 4, "zb-h1")
    mmt = ["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]
    plans["mmt/replicated/graph-zb"] = hand_built("mmt:small", mmt, [(0,), (1,), (2, 3)], [4, 2, 4], 4, "graph-zb")
    tb = ["embed"], ["branch0.layer0", "branch0.layer1"], ["branch1.layer0", "branch1.layer1"], ["concat", "head"]
    plans["twobranch/fan-out/graph-zb"] = hand_built("twobranch:small", tb, [(0,), (1,), (2,), (3,)], [2, 2, 2, 4], 4,
                                                     "graph-zb")
    # ZB-V: 8 layers in a V on 4 ranks (two stages per rank: the d-th from each end)
    spec = "transformer:small,layers=6"
    graph = zoo.load_graph(spec)
    sg = v_shape_chain(graph, 4, BATCH, 1)
    cluster = preset("v100", 4)
    plans["transformer/v-shape/zbv"] = Plan(model=zoo.canonical_spec(spec), stage_graph=sg, cluster=cluster,
                                            strategy="custom", schedule=make_schedule("zbv", sg, cluster))
    # DualPipeV on the same V (8 micro-batches: at least one per stage): whole backwards and split ones mixed
    plans["transformer/v-shape/dualpipev"] = Plan(model=zoo.canonical_spec(spec), stage_graph=sg, cluster=cluster,
                                                  strategy="custom", schedule=make_schedule("dualpipev", sg, cluster))
    return plans


def test_zero_bubble_runs_match_single_process():
    plans = zero_bubble_plans()
    names = sorted(plans)
    for name in names:  # the plans really split their backward
        kinds = {a.kind for acts in plans[name].schedule.device_actions for a in acts}
        assert {"I", "W"} <= kinds and ("B" in kinds) == name.endswith("dualpipev"), name
    results = run_checked(plans, names)
    for name, result in zip(names, results):
        assert {"F", "I", "W"} <= {r["kind"] for r in result.records}, name  # the measured timeline shows I, W
        check_measured_timeline(plans[name], result.records)
    replicated = results[names.index("mmt/replicated/graph-zb")]
    assert any(r["kind"] == "AR" for r in replicated.records)
