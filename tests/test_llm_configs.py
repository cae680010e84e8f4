"""evals/llm_configs.py (held-out LLM shapes) and its benchmark's report section."""

import json
import os

import pytest

from graphpipe.evals.report import TABLE_COLUMNS, build_report, fmt

EVALS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evals")


def test_report_section_shows_every_committed_result_row():
    with open(os.path.join(EVALS, "results", "bench_llm_configs.json")) as fh:
        res = json.load(fh)
    report = build_report(EVALS)
    for row in res["rows"]:
        assert "| " + " | ".join(fmt(row.get(k)) for _, k in TABLE_COLUMNS["bench_llm_configs"]) + " |" in report
    assert {r["config"] for r in res["rows"]} == set(res["config"]["configs"])


def test_unknown_config_is_named():
    from graphpipe.evals.llm_configs import NAMES, build

    with pytest.raises(ValueError, match="unknown LLM config 'gpt5'.*qwen2_72b"):
        build("gpt5")
    assert len(NAMES) == len(set(NAMES)) >= 14


def test_every_factory_builds_on_meta_at_its_published_width():
    """Two layers of each shape, on the meta device: nothing allocated, the class and config accepted."""
    pytest.importorskip("transformers")
    from graphpipe.evals.llm_configs import ARCHS, build

    for name, (_, _, shape, _) in ARCHS.items():
        model, inputs, _, labels = build(name, layers=2)
        assert all(p.device.type == "meta" for p in model.parameters()), name
        hidden = shape.get("hidden_size", shape.get("d_model"))
        assert any(hidden in p.shape for p in model.parameters()), name
        tokens = inputs.get("decoder_input_ids", inputs.get("input_ids"))  # Whisper's encoder reads audio frames
        assert labels.shape == tokens.shape, name


def test_tokens_per_sample_come_from_graphpipe_llm_seq(monkeypatch):
    """``GRAPHPIPE_LLM_SEQ`` sets the example's tokens per sample in both factory files (the stage-parallelism
    experiment's ``NAME@sN`` rows); unset it is 128, and anything but a positive integer is named."""
    pytest.importorskip("transformers")
    from graphpipe.evals.bench_llm import factory
    from graphpipe.evals.llm_configs import build

    monkeypatch.delenv("GRAPHPIPE_LLM_SEQ", raising=False)
    assert build("qwen2_72b", layers=1, tiny=True)[1]["input_ids"].shape == (2, 128)
    monkeypatch.setenv("GRAPHPIPE_LLM_SEQ", "48")
    _, inputs, _, labels = build("t5_11b", layers=1, tiny=True)
    assert inputs["input_ids"].shape == inputs["decoder_input_ids"].shape == labels.shape == (2, 48)
    monkeypatch.setenv("GRAPHPIPE_BENCH_LLM_LAYERS", "1")
    _, inputs, _, labels = factory()
    assert inputs["input_ids"].shape == labels.shape == (2, 48)
    monkeypatch.setenv("GRAPHPIPE_LLM_SEQ", "2k")
    with pytest.raises(ValueError, match="GRAPHPIPE_LLM_SEQ must be a positive integer.*'2k'"):
        build("qwen2_72b", layers=1, tiny=True)


def test_stage_parallel_names_a_sequence_length_and_its_graph_scales_with_it(tmp_path, monkeypatch):
    """``llama70b@sN`` in the stage-parallelism experiment is the same shape captured at ``N`` tokens per sample:
    every activation the graph carries between layers is ``N`` tokens of the hidden size, so doubling ``N``
    doubles each edge's bytes per sample (one layer deep, to keep it quick); the variable is restored after."""
    pytest.importorskip("transformers")
    from graphpipe.evals.stage_parallel import llm_graph

    monkeypatch.setenv("GRAPHPIPE_BENCH_LLM_LAYERS", "2")
    monkeypatch.delenv("GRAPHPIPE_LLM_SEQ", raising=False)
    short, long = llm_graph("llama70b@s16", str(tmp_path)), llm_graph("llama70b@s32", str(tmp_path))
    assert "GRAPHPIPE_LLM_SEQ" not in os.environ
    assert sorted(os.listdir(tmp_path)) == ["llama70b@s16.json", "llama70b@s32.json"]
    layer_edges = [(e.src, e.dst) for e in short.edges if "layers" in short.ops[e.src].name]
    assert layer_edges
    for src, dst in layer_edges:
        assert long.edge_bytes(src, dst) == 2 * short.edge_bytes(src, dst) == 2 * 16 * 8192 * 4
