"""Precision: presets state what their peak FLOP/s assume, profiles and runs record theirs, plans made
from a profile carry its precision, and a run at another precision warns; bad values are one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from graphpipe.cluster import PRESETS, cluster_from_dict, cluster_to_dict, preset
from graphpipe.errors import FormatError, InputError
from graphpipe.frontend.profile import Profile, profile_from_dict, profile_to_dict


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "graphpipe", *args], capture_output=True, text=True)


def test_presets_state_their_precision_and_cluster_files_round_trip_it():
    assert {name: preset(name).device.precision for name in PRESETS} == {"v100": "fp16", "a100": "bf16", "h100": "bf16",
                                                                              "cpu": "fp32"}
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
    assert "activation bytes are fp32 saves" in out.stderr  # the profile's plan: capture's fp32 saves, said
    out = _cli("run", str(plan), "--steps", "2", "--json")
    assert out.returncode == 0 and "profiled at bf16; this run trains at fp32" in out.stderr
    assert "bf16 copy" not in out.stderr


# ------------------------------------------------------------ bf16 activation bytes (capture under autocast)
BF16_MODELS = ("mmt:small", "dlrm:small", "candle-uno:small", "transformer:small", "twobranch:small")


@pytest.mark.parametrize("spec", BF16_MODELS)
def test_bf16_capture_equals_a_bf16_step_measured_by_the_runtime_meter(spec):
    """Oracle: one bf16 autocast training step of the whole module, its saves counted by the runtime's meter
    (autocast's weight copies are model state for both). Real CPU tensors and the meta device (fake CPU
    tensors) give the same bytes; bf16 keeps less than fp32 on the attention models."""
    import torch

    from graphpipe.frontend import zoo
    from graphpipe.frontend.capture import capture
    from graphpipe.runtime.measure import SavedBytesMeter

    built, meta = zoo.build(spec), zoo.build(spec, device="meta")
    batch = zoo.EXAMPLE_BATCH_SIZE
    per_op = [sum(op.act_bytes for op in capture(m.module, m.example_inputs, name=spec, loss_fn=m.loss_fn,
                                                 precision=p).graph.ops) * batch
              for m, p in ((built, "bf16"), (meta, "bf16"), (built, "fp32"))]
    x = built.example_inputs
    meter = SavedBytesMeter(list(built.module.parameters()) + list(built.module.buffers()))
    meter.reset(resident=x)
    with meter.hooks(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = built.loss_fn(built.module(*x))
    assert per_op[0] == per_op[1] == meter.peak > 0, per_op
    del loss
    if spec.startswith(("mmt", "transformer", "twobranch")):
        assert per_op[0] < per_op[2]


def test_bf16_plan_records_its_precision_and_run_warns_at_fp32(tmp_path):
    out = tmp_path / "p.json"
    proc = _cli("plan", "mmt:small", "-n", "2", "-b", "8", "--precision", "bf16", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["search"]["precision"] == "bf16" and doc["search"]["precision_from"] == "capture"
    fp32 = tmp_path / "q.json"
    assert _cli("plan", "mmt:small", "-n", "2", "-b", "8", "--out", str(fp32)).returncode == 0
    # autocast's weight copies are 2 more bytes per parameter of model state
    assert doc["cluster"]["bytes_per_param"] == json.loads(fp32.read_text())["cluster"]["bytes_per_param"] + 2
    proc = _cli("run", str(out), "--steps", "1")
    assert proc.returncode == 0 and "measured (activation bytes) at bf16; this run trains at fp32" in proc.stderr


@pytest.mark.slow
def test_bf16_plans_predict_the_activation_bytes_bf16_runs_measure():
    """Every small zoo model and Hugging Face CLIP, each planned by one of gpp, pipedream and gpipe in turn (every
    strategy on two models) and captured at bf16, run under autocast on 4 CPU ranks: --check passes (bf16
    tolerances) and every device's measured peak of saved bytes is within 10% of the prediction."""
    import os

    pytest.importorskip("transformers")
    from graphpipe.evals import memory_runtime

    clip = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_models.py") + ":clip"
    strategies = ("gpp", "pipedream", "gpipe")
    plans = {}
    for i, spec in enumerate(list(BF16_MODELS) + [clip]):
        plans.update(memory_runtime.matrix_plans([spec], [strategies[i % 3]], ["graph-1f1b"], 4, ("none",), "bf16"))
    assert {name.split("/")[-3] for name in plans} == set(strategies)
    rows, summary = memory_runtime.run_planned(plans, 4, "bf16")
    assert summary["runs"] == len(rows) == len(BF16_MODELS) + 1
    assert summary["checks_passed"] == summary["runs"], [r["run"] for r in rows if not r["check"]]
    assert summary["within_10pct"] == summary["runs"], [(r["run"], r["memory_error"]) for r in rows]


@pytest.mark.gpu
def test_bf16_capture_on_cuda_bounds_a_cuda_autocast_step():
    """On CUDA: capture's bf16 bytes (CPU kernels' saves) never under-count one CUDA bf16 step of the module, and
    stay within 25% of it when attention takes the math path.

    CUDA's fused attention (flash / cuDNN) saves no seq x seq probabilities, so
    with the default kernels a CUDA step saves less than the capture predicts
    (the plan is conservative); with ``SDPBackend.MATH`` the two count the same
    tensors up to autocast's per-device cast lists (docs/limits.md, "Cost
    model").
    """
    import contextlib

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphpipe.frontend import zoo
    from graphpipe.frontend.capture import capture
    from graphpipe.runtime.measure import SavedBytesMeter

    for spec in ("mmt:small", "transformer:small"):
        built = zoo.build(spec, device="cuda")
        predicted = zoo.EXAMPLE_BATCH_SIZE * sum(
            op.act_bytes for op in capture(built.module, built.example_inputs, name=spec, loss_fn=built.loss_fn,
                                           precision="bf16").graph.ops)
        x = built.example_inputs
        peaks = {}
        for kernels in ("default", "math"):
            meter = SavedBytesMeter(list(built.module.parameters()) + list(built.module.buffers()))
            meter.reset(resident=x)
            pick = sdpa_kernel([SDPBackend.MATH]) if kernels == "math" else contextlib.nullcontext()
            with pick, meter.hooks(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = built.loss_fn(built.module(*x))
            peaks[kernels] = meter.peak
            del loss
        assert peaks["default"] <= predicted, (spec, predicted, peaks)
        assert abs(predicted - peaks["math"]) <= 0.25 * peaks["math"], (spec, predicted, peaks)
