"""``--cluster cpu``: CPU ranks under gloo as a preset, and no "the plan was made for V100" note when a plan made
for CPU runs on CPU.

Oracle: the preset's figures are the documented ones (graphpipe.cluster's docstring); a plan made with it names
the CPU device, and ``graphpipe run`` on this host's CPU ranks prints no device note, where the default V100 plan
does (tests/test_reliability_runs.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

GRAPHPIPE = [sys.executable, "-m", "graphpipe"]


def test_the_cpu_preset_has_its_documented_figures():
    from graphpipe.cluster import load_cluster

    c = load_cluster("cpu", 3)
    assert (c.device.name, c.device.precision, c.num_devices, c.devices_per_node) == ("CPU", "fp32", 3, 64)
    assert (c.device.memory_bytes, c.device.peak_flops, c.device.mfu, c.device.op_overhead_s) == (4e9, 100e9, 0.3, 5e-5)
    assert (c.intra_node.latency_s, c.intra_node.bandwidth_Bps) == (1e-4, 1e9)
    assert load_cluster("CPU", 2, memory_gb=2).device.memory_bytes == 2e9


@pytest.mark.slow
def test_a_cpu_plan_runs_on_cpu_without_the_device_note(tmp_path):
    plan = tmp_path / "p.json"
    made = subprocess.run(GRAPHPIPE + ["plan", "twobranch:small", "-n", "2", "-b", "8", "--cluster", "cpu", "--out",
                                       str(plan)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    assert " on 2/2 CPU, batch 8" in made.stdout.splitlines()[0]
    assert json.loads(plan.read_text())["cluster"]["device"]["name"] == "CPU"
    run = subprocess.run(GRAPHPIPE + ["run", str(plan), "--steps", "2", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "the plan was made for" not in run.stderr
    devices = json.loads(run.stdout)["devices"]
    assert devices["planned"] == "CPU" and devices["run"].startswith("CPU")


def test_the_note_goes_when_the_costs_were_measured_on_the_run_device(capsys):
    """A V100 plan whose op costs a ``graphpipe profile`` measured on this CPU (``plan --profile``) runs on CPU
    without the note; without the profile the note stays, and names ``--cluster cpu``."""
    from types import SimpleNamespace

    from graphpipe.cli.run_cmd import _note_device
    from graphpipe.cluster import preset

    options = SimpleNamespace(backend="gloo")
    _note_device(SimpleNamespace(cluster=preset("v100", 2), search={"profile_device": "cpu"}), options)
    assert capsys.readouterr().err == ""
    _note_device(SimpleNamespace(cluster=preset("v100", 2), search={}), options)
    err = capsys.readouterr().err
    assert "the plan was made for V100-16GB; this run is on CPU" in err and "with --cluster cpu" in err
