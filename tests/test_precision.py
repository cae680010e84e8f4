"""Precision (issue 15): presets state what their peak FLOP/s assume, profiles and runs record theirs, plans made
from a profile carry its precision, and a run at another precision warns; bad values are one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from graphpipe.cluster import PRESETS, cluster_from_dict, cluster_to_dict, preset
from graphpipe.errors import FormatError, InputError
from graphpipe.profile import Profile, profile_from_dict, profile_to_dict


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "graphpipe", *args], capture_output=True, text=True)


def test_presets_state_their_precision_and_cluster_files_round_trip_it():
    assert {name: preset(name).device.precision for name in PRESETS} == {"v100": "fp16", "a100": "bf16", "h100": "bf16"}
    doc = cluster_to_dict(preset("h100", 8))
    assert doc["device"]["precision"] == "bf16" and cluster_from_dict(doc) == preset("h100", 8)
    doc["device"]["precision"] = "fp8"
    with pytest.raises(InputError, match="precision must be one of"):
        cluster_from_dict(doc)
    del doc["device"]["precision"]  # cluster files without it: bf16
    assert cluster_from_dict(doc).device.precision == "bf16"


def test_profile_documents_carry_precision():
    from graphpipe.graph import Affine

    prof = Profile("m", "cpu", (1, 2), {"a": (Affine(0.0, 1.0), Affine(0.0, 2.0))}, "bf16")
    doc = profile_to_dict(prof)
    assert doc["precision"] == "bf16" and profile_from_dict(doc) == prof
    del doc["precision"]  # profiles written before: fp32
    assert profile_from_dict(doc).precision == "fp32"
    doc["precision"] = "int8"
    with pytest.raises(FormatError, match="precision must be one of"):
        profile_from_dict(doc)


def test_bad_precision_flags_are_one_line_exit_2(tmp_path):
    for args in (("profile", "candle-uno:small", "--out", str(tmp_path / "p.json"), "--precision", "fp16"),):
        out = _cli(*args)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--precision" in out.stderr


@pytest.mark.slow
def test_plan_from_a_bf16_profile_records_it_and_run_warns_at_fp32(tmp_path):
    prof, plan = tmp_path / "prof.json", tmp_path / "plan.json"
    out = _cli("profile", "candle-uno:small", "--out", str(prof), "--precision", "bf16", "--repeats", "1",
               "--warmup", "0", "--batch-sizes", "1,2")
    assert out.returncode == 0, out.stderr
    assert json.loads(prof.read_text())["precision"] == "bf16"
    out = _cli("plan", "candle-uno:small", "--devices", "2", "--batch-size", "8", "--profile", str(prof),
               "--out", str(plan))
    assert out.returncode == 0, out.stderr
    search = json.loads(plan.read_text())["search"]
    assert (search["precision"], search["precision_from"]) == ("bf16", "profile")
    out = _cli("run", str(plan), "--steps", "2", "--precision", "fp64")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    out = _cli("run", str(plan), "--steps", "2", "--check", "--precision", "bf16", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["precision"] == "bf16" and summary["check"]["passed"]
    assert "profiled at" not in out.stderr
    assert "bf16 copy of their weights" in out.stderr  # the memory model's fp32 saves, said beside the error
    out = _cli("run", str(plan), "--steps", "2", "--json")
    assert out.returncode == 0 and "profiled at bf16; this run trains at fp32" in out.stderr
    assert "bf16 copy" not in out.stderr
