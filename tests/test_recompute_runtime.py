"""Re-materializing stages run under torch.utils.checkpoint (non-reentrant) and still equal single-process
training (--check): loss, every gradient and buffer."""

from __future__ import annotations

import pytest

from graphpipe import zoo
from graphpipe.cluster import preset
from graphpipe.runtime import RunOptions, run_plans
from graphpipe.search.common import SearchOptions
from graphpipe.search.planner import make_plan

pytestmark = pytest.mark.slow


def _plan(spec: str, strategy: str, num_devices: int, recompute: str):
    graph = zoo.load_graph(spec)
    return make_plan(zoo.canonical_spec(spec), graph, preset("v100", num_devices), 8, strategy,
                     SearchOptions(micro_batch_size=2, recompute=recompute))


def test_recompute_all_matches_single_process():
    plans = [_plan("mmt:small", "gpp", 3, "all"), _plan("transformer:small", "gpipe", 2, "all")]
    assert all(s.recompute for p in plans for s in p.stage_graph.stages)
    results = run_plans([(p, RunOptions(steps=2, warmup_steps=1, check=True, timeout_s=120)) for p in plans], 3)
    for plan, result in zip(plans, results):
        check = result["check"]
        assert check["passed"] and check["num_params_checked"] == check["num_params"] > 0, (plan.model, check)
