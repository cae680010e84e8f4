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
