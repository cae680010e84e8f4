"""A run's result records (graphpipe.runtime.results) and the JSON ``graphpipe run --json`` prints.

Oracles: ``from_dict(to_dict(r)) == r`` for records holding every field;
the nested key paths of ``graphpipe run --json`` equal the ones graphpipe
printed before the result became a typed record (lists taken from that
version's output on the same plans, written below); a real run's JSON
reads back into the record and writes out to the same text.
"""

from __future__ import annotations

import doctest
import json

import pytest

from graphpipe.errors import InputError
from graphpipe.runtime import results
from graphpipe.runtime.results import (AsyncRun, CheckResult, Fp64Spread, FullBatch, Measured, PlanInfo, Predicted,
                                       ReplayCheck, RunDevices, RunResult, RunSummary)

RECORD = {"rank": 0, "stage_id": 0, "kind": "F", "mb_id": 0, "ready": 0.0, "start": 0.001, "end": 0.002}


def full_check() -> CheckResult:
    return CheckResult(passed=True, max_abs_diff=1e-7, loss=0.5, reference_loss=0.5, loss_abs_diff=0.0,
                       steps_checked=2, losses_checked=[0.5, 0.4], reference_losses=[0.5, 0.4], num_params_checked=4,
                       num_params=4, num_buffers_checked=2, num_buffers=2, num_mismatches=0, rtol=1.3e-6, atol=1e-5,
                       batchnorm="per-micro-batch", inexact_ops=["dropout"],
                       fp64_spread=Fp64Spread(factor=4.0, loss=1e-8, max_grad=2e-8),
                       full_batch=FullBatch(loss=0.51, loss_abs_diff=0.01, max_grad_abs_diff=0.02),
                       unseeded_ops={"randn": "torch.randn"})


def full_result() -> RunResult:
    measured = Measured(iteration_time_s=0.5, throughput=16.0, step_times_s=[0.5, 0.6], warmup_steps=1,
                        timeline_step=1, peak_activation_bytes=[10.0, 20.0], peak_rss_bytes=[1e8, 2e8],
                        cuda_max_memory_allocated_bytes=[5.0, 6.0])
    return RunResult(measured=measured, losses=[0.5, 0.4], records=[RECORD], backend="gloo", rank_cpus=[[0], [1]],
                     baseline="torch.distributed.pipelining.Schedule1F1B", check=full_check(), precision="fp32",
                     resumed_from_step=1, restarts=2, check_skipped="--check skipped: no room")


def async_result() -> RunResult:
    measured = Measured(iteration_time_s=0.5, throughput=16.0, step_times_s=[0.5], warmup_steps=1, stream_time_s=2.0,
                        stream_throughput=24.0, stashed_weight_bytes=[8.0, 0.0],
                        stashed_weight_bytes_predicted=[8.0, 0.0], iteration="median over windows")
    check = ReplayCheck(passed=False, max_abs_diff=0.1, num_mismatches=3, num_params_checked=4, num_params=4,
                        losses_checked=12, what="every micro-batch's loss", reference="replay", loss=0.5,
                        reference_loss=0.49, rtol=1.3e-6, atol=1e-5)
    return RunResult(measured=measured, losses=[0.5, 0.4, 0.3], records=[RECORD], backend="gloo",
                     async_run=AsyncRun(schedule="2bw", vertical_sync=False, update_every=4, stash=True,
                                        stashed_versions=[[1], [0]]),
                     check=check)


def summary_of(result: RunResult) -> RunSummary:
    return RunSummary(plan=PlanInfo(model="mmt:small", strategy="gpp", schedule="1f1b", num_devices=2, batch_size=8,
                                    num_stages=2),
                      measured=result.measured,
                      predicted=Predicted(iteration_time_s=0.4, throughput=20.0, bubble_fraction=[0.1, 0.2],
                                          peak_memory_bytes=[1.0, 2.0], peak_activation_bytes=[3.0, 4.0],
                                          host_memory_bytes=[5.0, 6.0]),
                      losses=result.losses, backend=result.backend, precision="fp32", plan_precision=None,
                      rank_cpus=result.rank_cpus, prediction_error=0.2, memory_error=0.1, check=result.check,
                      resumed_from_step=result.resumed_from_step, restarts=result.restarts,
                      async_run=result.async_run, baseline=result.baseline, check_skipped=result.check_skipped,
                      devices=RunDevices(planned="V100-16GB", run="CPU (x86_64)"), timeline=object())


@pytest.mark.parametrize("make", [full_result, async_result], ids=["sync", "async"])
def test_a_result_reads_back_from_its_json(make):
    result = make()
    assert RunResult.from_dict(result.to_dict()) == result
    assert RunResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    summary = summary_of(result)
    doc = json.loads(json.dumps(summary.to_dict()))
    assert "timeline" not in doc and RunSummary.from_dict(doc) == summary  # the timeline is not compared
    assert json.dumps(RunSummary.from_dict(doc).to_dict()) == json.dumps(doc)  # same keys, same order


def test_the_check_reads_back_as_its_own_kind():
    assert type(RunResult.from_dict(async_result().to_dict()).check) is ReplayCheck
    assert type(RunResult.from_dict(full_result().to_dict()).check) is CheckResult
    assert "async" in async_result().to_dict()  # the JSON key of async_run


def test_optional_fields_are_none_and_left_out_of_the_json():
    bare = RunResult(measured=Measured(iteration_time_s=1.0, throughput=8.0, step_times_s=[1.0], warmup_steps=0),
                     losses=[1.0], records=[], backend="gloo")
    doc = bare.to_dict()
    assert list(doc) == ["measured", "losses", "records", "backend"]
    assert list(doc["measured"]) == ["iteration_time_s", "throughput", "step_times_s", "warmup_steps"]
    back = RunResult.from_dict(doc)
    assert back == bare and back.check is None and back.measured.peak_rss_bytes is None and back.restarts is None


def test_a_required_none_stays_in_the_json():
    """``plan_precision`` and ``backend`` are always printed, as null when unknown."""
    doc = summary_of(full_result()).to_dict()
    assert doc["plan_precision"] is None and "plan_precision" in doc


def test_sequences_are_frozen_to_tuples():
    result = full_result()
    assert result.losses == (0.5, 0.4) and result.rank_cpus == ((0,), (1,))
    assert result.check.losses_checked == (0.5, 0.4) and isinstance(result.records, tuple)


def test_bad_json_gets_a_clear_error():
    doc = full_result().to_dict()
    with pytest.raises(InputError, match="unknown key.*'extra'"):
        RunResult.from_dict({**doc, "extra": 1})
    del doc["measured"]["throughput"]
    with pytest.raises(InputError, match="Measured: the object has no 'throughput'"):
        RunResult.from_dict(doc)
    with pytest.raises(InputError, match="expected a JSON object, got list"):
        RunResult.from_dict([])


def test_docstring_examples():
    outcome = doctest.testmod(results)
    assert outcome.failed == 0 and outcome.attempted > 0


# Nested key paths of `graphpipe run --json` (3 steps, --check) on the plans below, as printed before the result was
# a typed record.
SYNC_KEYS = [
    "plan", "plan.model", "plan.strategy", "plan.schedule", "plan.num_devices", "plan.batch_size", "plan.num_stages",
    "measured", "measured.iteration_time_s", "measured.throughput", "measured.step_times_s", "measured.warmup_steps",
    "measured.timeline_step", "measured.peak_activation_bytes", "measured.peak_rss_bytes",
    "predicted", "predicted.iteration_time_s", "predicted.throughput", "predicted.bubble_fraction",
    "predicted.peak_memory_bytes", "predicted.peak_activation_bytes", "predicted.host_memory_bytes",
    "losses", "backend", "precision", "plan_precision", "rank_cpus", "prediction_error", "memory_error",
    "check", "check.passed", "check.max_abs_diff", "check.loss", "check.reference_loss", "check.loss_abs_diff",
    "check.steps_checked", "check.losses_checked", "check.reference_losses", "check.num_params_checked",
    "check.num_params", "check.num_buffers_checked", "check.num_buffers", "check.num_mismatches", "check.rtol",
    "check.atol", "check.batchnorm", "check.fp64_spread", "check.fp64_spread.factor", "check.fp64_spread.loss",
    "check.fp64_spread.max_grad", "check.full_batch", "check.full_batch.loss", "check.full_batch.loss_abs_diff",
    "check.full_batch.max_grad_abs_diff", "check.full_batch.note",
    "devices", "devices.planned", "devices.run"]
TORCH_KEYS = [
    "plan", "plan.model", "plan.strategy", "plan.schedule", "plan.num_devices", "plan.batch_size", "plan.num_stages",
    "measured", "measured.iteration_time_s", "measured.throughput", "measured.step_times_s", "measured.warmup_steps",
    "measured.timeline_step",
    "predicted", "predicted.iteration_time_s", "predicted.throughput", "predicted.bubble_fraction",
    "predicted.peak_memory_bytes", "predicted.peak_activation_bytes",
    "losses", "backend", "precision", "plan_precision", "rank_cpus", "prediction_error",
    "check", "check.passed", "check.max_abs_diff", "check.loss", "check.reference_loss", "check.loss_abs_diff",
    "check.num_params_checked", "check.num_params", "check.num_mismatches", "check.rtol", "check.atol",
    "baseline", "devices", "devices.planned", "devices.run"]
ASYNC_KEYS = [
    "plan", "plan.model", "plan.strategy", "plan.schedule", "plan.num_devices", "plan.batch_size", "plan.num_stages",
    "measured", "measured.iteration_time_s", "measured.throughput", "measured.step_times_s", "measured.warmup_steps",
    "measured.stream_time_s", "measured.stream_throughput", "measured.stashed_weight_bytes",
    "measured.stashed_weight_bytes_predicted", "measured.iteration",
    "predicted", "predicted.iteration_time_s", "predicted.throughput", "predicted.bubble_fraction",
    "predicted.peak_memory_bytes", "predicted.peak_activation_bytes", "predicted.stashed_weight_bytes",
    "losses", "backend", "precision", "plan_precision", "prediction_error",
    "check", "check.passed", "check.max_abs_diff", "check.num_mismatches", "check.num_params_checked",
    "check.num_params", "check.losses_checked", "check.what", "check.reference", "check.loss", "check.reference_loss",
    "check.rtol", "check.atol",
    "async", "async.schedule", "async.vertical_sync", "async.update_every", "async.stash", "async.stashed_versions",
    "devices", "devices.planned", "devices.run"]


def key_paths(doc: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in doc.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += key_paths(value, f"{prefix}{key}.")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "torch", "async"])
def test_run_json_keeps_its_keys(kind, tmp_path, capsys):
    from graphpipe.frontend import zoo
    from graphpipe.cli import main
    from graphpipe.cluster import preset
    from graphpipe.plan import write_plan
    from graphpipe.sched.async_pipe import async_spec_for, with_async
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan

    graph = zoo.load_graph("transformer:small")
    if kind == "async":
        plan = make_plan("transformer:small", graph, preset("v100", 2), 16, "pipedream", schedule="1f1b")
        plan = with_async(plan, async_spec_for("2bw", plan.stage_graph))
    else:
        plan = make_plan("transformer:small", graph, preset("v100", 2), 8, "pipedream",
                         SearchOptions(micro_batch_size=2), schedule="1f1b")
    write_plan(str(tmp_path / "p.json"), plan)
    argv = ["run", str(tmp_path / "p.json"), "--steps", "3", "--check", "--json", "--timeout", "120"]
    assert main(argv + (["--baseline", "torch"] if kind == "torch" else [])) == 0
    text = capsys.readouterr().out
    doc = json.loads(text)
    assert key_paths(doc) == {"sync": SYNC_KEYS, "torch": TORCH_KEYS, "async": ASYNC_KEYS}[kind]
    assert json.dumps(RunSummary.from_dict(doc).to_dict(), indent=1) + "\n" == text  # the record writes what it read
