"""The captured-graph cache: a cached zoo graph equals a fresh capture, and a bad entry, a read-only folder or
``GRAPHPIPE_CACHE_DIR=off`` never changes the answer."""

from __future__ import annotations

import json
import os

import pytest

from graphpipe.frontend import graph_cache, zoo
from graphpipe.cluster import preset
from graphpipe.search.common import SearchOptions
from graphpipe.search.planner import make_plan


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("GRAPHPIPE_CACHE_DIR", str(folder))
    zoo._load_graph_cached.cache_clear()  # the in-process cache would hide the disk
    yield folder
    zoo._load_graph_cached.cache_clear()


def _fresh(spec, monkeypatch, **kw):
    monkeypatch.setenv("GRAPHPIPE_CACHE_DIR", "off")
    zoo._load_graph_cached.cache_clear()
    try:
        return zoo.load_graph(spec, **kw)
    finally:
        zoo._load_graph_cached.cache_clear()


@pytest.mark.parametrize("spec", ["mmt:small", "transformer:small", "dlrm:small"])
def test_a_cached_graph_equals_a_fresh_capture_and_plans_the_same(spec, cache, monkeypatch):
    first = zoo.load_graph(spec)
    assert len(os.listdir(cache)) == 1
    zoo._load_graph_cached.cache_clear()
    again = zoo.load_graph(spec)  # read back from the disk
    folder = str(cache)
    fresh = _fresh(spec, monkeypatch)
    assert again == first == fresh
    monkeypatch.setenv("GRAPHPIPE_CACHE_DIR", folder)
    cluster = preset("v100", 4)
    plans = [make_plan(spec, g, cluster, 32, "gpp", SearchOptions()) for g in (again, fresh)]
    assert plans[0].stage_graph == plans[1].stage_graph and plans[0].schedule == plans[1].schedule


def test_the_key_covers_precision_device_and_the_source(cache, monkeypatch):
    zoo.load_graph("mmt:small")
    zoo.load_graph("mmt:small", precision="bf16")
    zoo.load_graph("mmt:small", device=preset("h100").device)
    assert len(os.listdir(cache)) == 3
    monkeypatch.setattr(graph_cache, "_source_fingerprint", lambda: "another graphpipe")
    zoo._load_graph_cached.cache_clear()
    zoo.load_graph("mmt:small")
    assert len(os.listdir(cache)) == 4  # a changed package never reads the old entry


def test_a_torn_entry_is_captured_anew_and_rewritten(cache, monkeypatch):
    good = zoo.load_graph("twobranch:small")
    (entry,) = os.listdir(cache)
    (cache / entry).write_text('{"format": "graphpipe.graph/1", "ops": [')
    zoo._load_graph_cached.cache_clear()
    assert zoo.load_graph("twobranch:small") == good
    zoo._load_graph_cached.cache_clear()
    assert graph_cache.graph_from_dict(json.loads((cache / entry).read_text())) == good


def test_an_unwritable_cache_folder_only_costs_time(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GRAPHPIPE_CACHE_DIR", str(blocker / "cache"))  # makedirs fails under a file
    zoo._load_graph_cached.cache_clear()
    try:
        got = zoo.load_graph("candle-uno:small")
    finally:
        zoo._load_graph_cached.cache_clear()
    assert got == _fresh("candle-uno:small", monkeypatch)


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHPIPE_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert graph_cache.cache_dir() is None
    zoo._load_graph_cached.cache_clear()
    zoo.load_graph("mmt:small")
    zoo._load_graph_cached.cache_clear()
    assert os.listdir(tmp_path) == []
    monkeypatch.delenv("GRAPHPIPE_CACHE_DIR")
    assert graph_cache.cache_dir() == os.path.join(str(tmp_path), "graphpipe")


def test_old_entries_are_pruned_to_the_newest(cache, monkeypatch):
    os.makedirs(cache)
    for i in range(5):
        (cache / f"graph-old{i}.json").write_text("{}")
        os.utime(cache / f"graph-old{i}.json", (1000 + i, 1000 + i))
    (cache / "notes.txt").write_text("not ours")
    monkeypatch.setattr(graph_cache, "KEEP", 3)
    zoo.load_graph("mmt:small")
    left = sorted(os.listdir(cache))
    assert "notes.txt" in left and "graph-old4.json" in left and "graph-old3.json" in left
    assert not any(f"graph-old{i}.json" in left for i in range(3))
    assert len([n for n in left if n.startswith("graph-")]) == 3


def test_planning_from_the_cache_or_a_graph_file_imports_no_torch(cache, tmp_path):
    """A fresh process plans a zoo model whose graph is cached, and a PipeDream profile, and simulates the
    plan, without importing torch; the zoo plan is the one the planner makes in this process (torch loaded)."""
    import subprocess
    import sys

    from conftest import PROFILES_DIR

    graph = zoo.load_graph("mmt:small")  # captured here: fills the cache
    entries = os.listdir(cache)
    script = ("import json, sys\nfrom graphpipe.cli import main\ncode = main(sys.argv[1:])\n"
              "print(json.dumps([code, 'torch' in sys.modules]))")

    def run(*argv):
        out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                             env={**os.environ, "GRAPHPIPE_CACHE_DIR": str(cache)})
        return json.loads(out.stdout.strip().splitlines()[-1])

    path = str(tmp_path / "plan.json")
    assert run("plan", "mmt:small", "--devices", "4", "--batch-size", "32", "--out", path) == [0, False]
    assert os.listdir(cache) == entries  # read from the cache, not captured and stored again
    profile = os.path.join(PROFILES_DIR, "gnmt", "graph.txt")
    assert run("plan", profile, "--devices", "4", "--batch-size", "64", "--out", str(tmp_path / "g.json")) == [0, False]
    assert run("simulate", path) == [0, False]
    doc = json.loads((tmp_path / "plan.json").read_text())
    expected = make_plan("mmt:small", graph, preset("v100", 4), 32, "gpp", SearchOptions())
    assert [s["ops"] for s in doc["stages"]] == [[expected.graph.ops[i].name for i in s.op_ids]
                                                 for s in expected.stage_graph.stages]
    assert doc["predicted"]["throughput"] == pytest.approx(expected.predicted["throughput"], rel=1e-12)


def test_the_memory_budget_is_not_part_of_the_key(cache, monkeypatch):
    """--memory-gb changes what fits, not what the capture measures: every memory reads the same entry, and
    the graph equals a fresh capture at that memory."""
    from graphpipe.cluster import load_cluster

    first = zoo.load_graph("mmt:small", device=load_cluster("v100", 1).device)
    for gb in (2, 7.5, 80):
        zoo._load_graph_cached.cache_clear()
        assert zoo.load_graph("mmt:small", device=load_cluster("v100", 1, memory_gb=gb).device) == first
    assert len(os.listdir(cache)) == 1
    assert _fresh("mmt:small", monkeypatch, device=load_cluster("v100", 1, memory_gb=2).device) == first
