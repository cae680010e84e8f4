"""Planning for a shared host (SearchOptions.host, ``graphpipe plan --host-cores``).

Oracles: with a core per device the host-aware plan is at least as fast as
the dedicated plan (the dedicated search on all devices is one of the
options it weighs); on one core nothing beats running every action back to
back on one rank, so the plan's iteration is the whole model's work at its
micro-batch size; the plan's predicted figures are the shared-host
simulation of its own schedule.
"""

from __future__ import annotations

import json

import pytest

from conftest import branches_graph
from graphpipe.cli import main
from graphpipe.cluster import preset
from graphpipe.errors import InputError
from graphpipe.sched import SharedHost, predicted_figures, simulate
from graphpipe.search.common import SearchOptions
from graphpipe.search.planner import make_plan

STRATEGIES = ("gpp", "pipedream", "gpipe")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_core_per_device_is_never_worse_than_dedicated(strategy):
    g = branches_graph(3, 2)
    cluster = preset("v100", 4)
    dedicated = make_plan("g", g, cluster, 32, strategy)
    shared = make_plan("g", g, cluster, 32, strategy, SearchOptions(host=SharedHost.cores(4)))
    assert shared.predicted["throughput"] >= dedicated.predicted["throughput"] * (1 - 1e-9)
    assert 1 <= shared.search["host_devices_used"] <= 4
    assert shared.search["host_slowdown"] == [[1, 1.0], [4, 1.0]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_core_plan_does_all_work_back_to_back(strategy):
    g = branches_graph(3, 2)
    cluster = preset("v100", 4)
    host = SharedHost.cores(1)
    plan = make_plan("g", g, cluster, 32, strategy, SearchOptions(host=host))
    sg = plan.stage_graph
    work = sum(sg.num_micro_batches(s) * (sg.fwd_time(s) + sg.bwd_time(s)) * sg.stages[s].num_replicas
               for s in range(sg.num_stages))
    assert plan.predicted["iteration_time_s"] >= work * (1 - 1e-9)
    # the plan is the shared-host simulation of its own schedule
    again = predicted_figures(simulate(sg, plan.schedule, cluster, host=host))
    assert plan.predicted["iteration_time_s"] == pytest.approx(again["iteration_time_s"], rel=1e-12)
    # and no plan on any number of ranks is faster than one rank doing everything at the plan's best size
    one = make_plan("g", g, preset("v100", 1), 32, strategy, SearchOptions(host=host))
    assert plan.predicted["throughput"] >= one.predicted["throughput"] * (1 - 1e-9)
    assert max(sg.devices_used()) < plan.search["host_devices_used"]  # ranks past the chosen count stay idle


def test_dedicated_plan_loses_on_a_saturated_host_and_the_host_plan_does_not():
    """Eight ranks of a four-branch model on two cores: the host plan simulates at least as fast there."""
    g = branches_graph(4, 3)
    cluster = preset("v100", 8)
    host = SharedHost.cores(2)
    dedicated = make_plan("g", g, cluster, 64, "gpp")
    on_host = simulate(dedicated.stage_graph, dedicated.schedule, cluster, host=host).throughput
    shared = make_plan("g", g, cluster, 64, "gpp", SearchOptions(host=host))
    assert shared.predicted["throughput"] >= on_host * (1 - 1e-9)
    assert shared.predicted["throughput"] < dedicated.predicted["throughput"]  # two cores cannot do eight devices' work


def test_cpsat_refuses_a_shared_host():
    with pytest.raises(InputError, match="shared host"):
        make_plan("g", branches_graph(2, 1), preset("v100", 2), 8, "gpp", SearchOptions(host=SharedHost.cores(1)),
                  schedule="cpsat")


def test_cli_host_cores(tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert main(["plan", "candle-uno:small", "--devices", "4", "--batch-size", "64", "--host-cores", "2",
                 "--out", out, "--json"]) == 0
    capsys.readouterr()
    doc = json.loads(open(out).read())
    assert doc["search"]["host_slowdown"] == [[1, 1.0], [2, 1.0]]
    assert main(["simulate", out, "--host-cores", "2", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(doc["predicted"]["iteration_time_s"], rel=1e-12)
    assert main(["plan", "candle-uno:small", "--devices", "4", "--batch-size", "64", "--host-cores", "0"]) == 2
    assert "--host-cores must be at least 1, got 0" in capsys.readouterr().err
