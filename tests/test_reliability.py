"""Issue 20: no traceback on any input, outputs that never clobber what is not theirs, limits, warnings.

Each test is one item of the issue's "Why" list. Behaviour that belongs to
the process (exit codes, what reaches stderr) is checked by running the
``graphpipe`` CLI as a subprocess; library-level guarantees (temp-file
cleanup, modes, CP-SAT determinism) are checked in-process. Runs of ranks
(SIGTERM, Ctrl-C, hung ranks) are in ``test_reliability_runs.py``; the
property-based fuzz test in ``test_reliability_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from graphpipe.errors import InputError

GRAPHPIPE = [sys.executable, "-m", "graphpipe"]
HERE = os.path.dirname(os.path.abspath(__file__))


def cli(*argv: str, timeout: float = 120, env: dict | None = None, umask: int | None = None):
    """Run ``graphpipe ARGV`` as a process; (exit code, stdout, stderr)."""
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    proc = subprocess.run(GRAPHPIPE + list(argv), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, preexec_fn=preexec)
    return proc.returncode, proc.stdout, proc.stderr


def in_process(capsys, *argv: str):
    """``graphpipe ARGV`` through :func:`graphpipe.cli.main` in this process (no interpreter start-up);
    the same boundary as the console script, which is ``sys.exit(main())``."""
    from graphpipe.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    """Exit 2, exactly one stderr line ``graphpipe: error: ...`` holding every fragment, no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("graphpipe: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict:
    """A small real plan (mmt:small on 2 devices), written once for the module."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, _, err = cli("plan", "mmt:small", "-n", "2", "-b", "4", "--out", str(path))
    assert code == 0, err
    return json.loads(path.read_text())


@pytest.fixture()
def plan_file(plan_doc, tmp_path) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    return str(path)


# --------------------------------------------------------------- tracebacks
def test_huge_zoo_option_is_refused_with_the_limit():
    code, _, err = cli("inspect", "mmt:small,seq=99999999999999999999")
    assert_one_line_error(code, err, "seq", "limit")


@pytest.mark.parametrize("verb", ["simulate", "inspect", "cluster"])
def test_deeply_nested_json_documents_are_refused(tmp_path, verb):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    argv = {"simulate": ["simulate", str(deep)], "inspect": ["inspect", str(deep)],
            "cluster": ["plan", "mmt:small", "-n", "2", "-b", "4", "--cluster", str(deep)]}[verb]
    code, _, err = cli(*argv)
    assert_one_line_error(code, err, "nested deeper than")


FACTORIES = '''
import torch
import torch.nn as nn


class Mismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) @ torch.ones(3, 3)


def bad_forward():
    return Mismatch(), (torch.randn(2, 4),), lambda y: y.sum()


def raises():
    raise ValueError("no weights file")
'''


@pytest.mark.parametrize("factory, source, fragment", [
    ("raises", 'raise ValueError("no weights file")', "calling raises() failed: ValueError"),
    ("bad_forward", "return self.a(x) @ torch.ones(3, 3)", "torch.export cannot capture Mismatch: RuntimeError")])
def test_user_code_failures_name_the_users_file_and_line(tmp_path, factory, source, fragment):
    line = next(i for i, text in enumerate(FACTORIES.splitlines(), 1) if source in text)
    path = tmp_path / "mine.py"
    path.write_text(FACTORIES)
    code, _, err = cli("inspect", f"{path}:{factory}")
    assert_one_line_error(code, err, f"{path}:{line}: ", fragment)
    code, _, err = cli("-v", "inspect", f"{path}:{factory}")  # -v: the whole traceback, then the line
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("graphpipe: error: ")


def test_cluster_preset_of_the_wrong_type(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"preset": 5}')
    code, _, err = cli("plan", "mmt:small", "-n", "2", "-b", "4", "--cluster", str(path))
    assert_one_line_error(code, err, "preset must be a string")


@pytest.mark.parametrize("key, value, fragment", [
    ("stage_edges", 5, "stage_edges must be a JSON array"),
    ("stage_edges", [[0]], "stage_edges[0] must be [from_stage, to_stage]"),
    ("stage_edges", [["0", 1]], "stage_edges[0][0] must be an integer"),
    ("merged", [1], "merged must be a JSON object"),
    ("merged", {"m": "ab"}, "merged.m must be a JSON array"),
    ("predicted", [1], "predicted must be a JSON object"),
    ("predicted", {"iteration_time_s": "fast"}, "predicted.iteration_time_s must be a number"),
    ("search", "gpp", "search must be a JSON object"),
    ("search", {"time_s": True}, "search.time_s must be a number"),
])
def test_plan_fields_of_the_wrong_type(plan_doc, tmp_path, capsys, key, value, fragment):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**plan_doc, key: value}))
    code, _, err = in_process(capsys, "simulate", str(path))
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("flag, name", [("--out", "p.json"), ("--trace", "t.json"), ("--gantt", "g.png")])
@pytest.mark.parametrize("where", ["proc", "directory", "under-a-file"])
def test_outputs_to_impossible_places_fail_before_the_work(plan_file, tmp_path, capsys, flag, name, where):
    target = {"proc": f"/proc/{name}", "directory": str(tmp_path), "under-a-file": f"{plan_file}/{name}"}[where]
    code, _, err = in_process(capsys, "simulate", plan_file, flag, target)
    assert_one_line_error(code, err, flag)


def test_gantt_with_a_suffix_we_cannot_write(plan_file, tmp_path):
    code, _, err = cli("simulate", plan_file, "--gantt", str(tmp_path / "g.txt"))
    assert_one_line_error(code, err, "--gantt", ".txt", ".png")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_profile_device_bogus(tmp_path):
    code, _, err = cli("profile", "mmt:small", "--device", "bogus", "--out", str(tmp_path / "p.json"))
    assert_one_line_error(code, err, "--device", "bogus")


def test_profile_to_an_unwritable_path_fails_before_profiling(tmp_path):
    """The output is checked first: no op is timed (-v would print progress) before the refusal."""
    code, _, err = cli("-v", "profile", "mmt:small", "--out", "/proc/p.json")
    assert_one_line_error(code, err, "--out /proc/p.json")
    code, _, err = cli("-v", "run", str(tmp_path / "missing.json"), "--gantt", "/proc/g.png")
    assert_one_line_error(code, err, "--gantt /proc/g.png")  # refused before the plan is even read


# ------------------------------------------------------------------ limits
def test_batch_size_beyond_the_limit():
    code, _, err = cli("plan", "mmt:small", "-n", "4", "-b", "1000000000000")
    assert_one_line_error(code, err, "--batch-size", "limit of 1048576")


def test_too_many_micro_batches_for_a_forced_size():
    code, _, err = cli("plan", "mmt:small", "-n", "4", "-b", "65536", "--micro-batch-size", "1")
    assert_one_line_error(code, err, "micro-batches", "limit of 4096")


def test_branches_beyond_the_limit():
    code, _, err = cli("inspect", "mmt:branches=100000")
    assert_one_line_error(code, err, "layers", "limit of 1024")


def test_devices_beyond_the_limit():
    from graphpipe.cluster import MAX_DEVICES

    code, _, err = cli("plan", "mmt:small", "-n", str(MAX_DEVICES + 1), "-b", "8")
    assert_one_line_error(code, err, "devices", str(MAX_DEVICES))


def test_graph_documents_beyond_the_op_limit(tmp_path, capsys):
    from graphpipe.graph import MAX_OPS

    doc = {"format": "graphpipe.graph/1", "ops": [{"name": f"o{i}", "fwd_s": [0, 0], "bwd_s": [0, 0]}
                                                  for i in range(MAX_OPS + 1)], "edges": []}
    path = tmp_path / "big.json"
    path.write_text(json.dumps(doc))
    code, _, err = in_process(capsys, "inspect", str(path))
    assert_one_line_error(code, err, f"more than the {MAX_OPS}")


def test_run_refuses_more_ranks_than_the_host_can_start(tmp_path):
    from importlib import import_module

    limit, _ = import_module("graphpipe.runtime.launch").host_rank_limit()
    n = limit + 1
    code, _, err = cli("plan", "mmt:small", "-n", str(n), "-b", "8", "--out", str(tmp_path / "big.json"))
    assert code == 0, err
    code, _, err = cli("run", str(tmp_path / "big.json"), "--steps", "2")
    assert_one_line_error(code, err, f"needs {n} ranks", f"at most {limit}")


# ------------------------------------------------------------------ damage
def test_symlink_fifo_and_device_targets_are_refused_not_replaced(plan_file, tmp_path):
    real = tmp_path / "real.json"
    real.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for target, fragment in ((link, "symbolic link"), (fifo, "FIFO"), ("/dev/null", "device")):
        code, _, err = cli("simulate", plan_file, "--out", str(target), timeout=60)
        assert_one_line_error(code, err, fragment)
    assert os.path.islink(link) and real.read_text() == "keep"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_new_files_honour_the_umask_and_replaced_files_keep_their_mode(plan_file, tmp_path):
    new = tmp_path / "new.json"
    code, _, err = cli("simulate", plan_file, "--out", str(new), umask=0o022)
    assert code == 0, err
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o644
    old = tmp_path / "old.json"
    old.write_text("{}")
    os.chmod(old, 0o640)
    code, _, err = cli("simulate", plan_file, "--out", str(old), "--trace", str(tmp_path / "t.json"), umask=0o077)
    assert code == 0, err
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "t.json").st_mode) == 0o600
    assert json.loads(old.read_text())["format"] == "graphpipe.plan/1"


def test_temp_files_are_removed_on_failure_and_after_a_killed_writer(tmp_path):
    from graphpipe.files import write_atomic

    target = tmp_path / "out.json"

    def fail(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write("half")
        raise KeyboardInterrupt  # Ctrl-C (and SIGTERM through the CLI) mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(target), fail)
    assert list(tmp_path.iterdir()) == []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: a writer killed by SIGKILL
    stale = tmp_path / f".out.json.graphpipe-tmp-{dead.pid}-0000.json"
    stale.write_text("half")
    mine = tmp_path / f".out.json.graphpipe-tmp-{os.getpid()}-0000.json"  # a live writer's: left alone
    mine.write_text("half")
    write_atomic(str(target), lambda tmp: open(tmp, "w").write("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "out.json"])


def test_sigterm_removes_the_temp_file_of_a_write_in_progress(tmp_path):
    """A process writing through write_atomic under the CLI's SIGTERM handler leaves no temp file."""
    script = f"""
import os, signal, sys, time
from graphpipe.cli import _raise_terminated
from graphpipe.files import write_atomic
signal.signal(signal.SIGTERM, _raise_terminated)
def slow(tmp):
    open(tmp, "w").write("half")
    print("writing", flush=True)
    time.sleep(60)
try:
    write_atomic({str(tmp_path / 'out.json')!r}, slow)
except BaseException as exc:
    sys.exit(143)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert any(p.name.startswith(".out.json.graphpipe-tmp-") for p in tmp_path.iterdir())
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------- wrong silently
@pytest.mark.parametrize("argv, fragment", [(["--warmup", "-1", "--steps", "3"], "--warmup must be a non-negative integer"),
                                            (["--warmup", "10", "--steps", "3"], "--warmup 10 leaves nothing")])
def test_warmup_is_refused_not_clamped(plan_file, argv, fragment):
    code, _, err = cli("run", plan_file, *argv)
    assert_one_line_error(code, err, fragment)


def test_run_options_refuse_a_negative_warmup():
    from graphpipe.runtime.options import RunOptions

    with pytest.raises(InputError, match="--warmup"):
        RunOptions(steps=3, warmup_steps=-1)


def test_profile_of_another_configuration_warns(tmp_path):
    from graphpipe.frontend.zoo import load_graph

    names = [op.name for op in load_graph("mmt:small").ops]
    profile = {"format": "graphpipe.profile/1", "model": "mmt:small", "device": "cpu", "batch_sizes": [1, 2],
               "ops": {name: {"fwd_s": [1e-4, 1e-5], "bwd_s": [2e-4, 2e-5]} for name in names}}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(profile))
    code, _, err = cli("plan", "mmt:branches=2,layers=2", "-n", "2", "-b", "8", "--profile", str(path))
    assert code == 0, err
    assert "graphpipe: warning: the profile was measured on 'mmt:small'" in err
    code, _, err = cli("plan", "mmt:small", "-n", "2", "-b", "8", "--profile", str(path))
    assert code == 0 and "warning" not in err, err


def test_ops_without_a_profile_entry_warn(caplog):
    from graphpipe.graph import Affine
    from graphpipe.frontend.profile import Profile, apply_profile
    from graphpipe.frontend.zoo import load_graph

    graph = load_graph("mmt:small")
    first = graph.ops[0].name
    profile = Profile("mmt:small", "cpu", (1, 2), {first: (Affine(1e-4, 1e-5), Affine(2e-4, 2e-5))})
    applied = apply_profile(graph, profile, model="mmt:small")
    assert applied.ops[0].fwd == Affine(1e-4, 1e-5)
    assert f"no entry for {graph.num_ops - 1} of {graph.num_ops} ops" in caplog.text


def test_poor_fit_warns(caplog):
    from graphpipe.frontend.profile import OpTimings, _warn_poor_fits, fit_affine

    sizes = (1, 2, 4, 8)
    timings = {"a": OpTimings((1.0, 0.1, 1.0, 0.1), (1.0, 2.0, 4.0, 8.0))}  # forward: no affine law; backward: exact
    ops = {"a": (fit_affine(sizes, timings["a"].fwd_s), fit_affine(sizes, timings["a"].bwd_s))}
    poor = _warn_poor_fits(sizes, timings, ops)
    assert len(poor) == 1 and poor[0].startswith("a forward")
    assert "fits 1 op time(s) poorly" in caplog.text


def test_compare_exits_non_zero_when_every_strategy_fails():
    code, out, err = cli("plan", "mmt:small", "-n", "2", "-b", "8", "--compare", "--memory-gb", "1e-6")
    assert "strategy" in out  # the table is still printed
    assert_one_line_error(code, err, "every strategy failed")


def test_booleans_and_strings_are_not_numbers(plan_doc, tmp_path):
    graph = json.loads(json.dumps(plan_doc["graph"]))
    graph["ops"][0]["fwd_s"] = [True, 0.001]
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    code, _, err = cli("inspect", str(path))
    assert_one_line_error(code, err, "fwd_s[0] must be a number, got true")
    doc = json.loads(json.dumps(plan_doc))
    doc["stages"][0]["devices"] = ["0"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    code, _, err = cli("simulate", str(path))
    assert_one_line_error(code, err, "devices[0] must be an integer, got '0'")


def test_verbose_prints_progress_for_plan_and_simulate(plan_file):
    code, _, err = cli("-v", "plan", "mmt:small", "-n", "2", "-b", "4")
    assert code == 0 and "building mmt:small" in err and "plan found" in err, err
    code, _, err = cli("-v", "simulate", plan_file)
    assert code == 0 and "graphpipe: simulate_cmd: simulating schedule" in err, err


def test_our_bug_is_one_line_exit_1_with_the_hint(monkeypatch, capsys):
    """Anything that is not a GraphpipeError is our bug: one line, exit 1, the -v hint; -v prints the traceback."""
    from graphpipe.cli import main, models_cmd

    def boom(args):
        raise KeyError("internal")

    monkeypatch.setattr(models_cmd, "_handler", boom)
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphpipe: internal error: KeyError") and "-v" in err
    assert main(["-v", "models"]) == 1
    assert "Traceback" in capsys.readouterr().err


# ------------------------------------------------------------------ CP-SAT
def test_cpsat_gives_the_same_order_for_the_same_inputs_and_seed():
    """The issue's case: two OPTIMAL solves of one plan reported different orders and peak memories."""
    from graphpipe.cluster import preset
    from graphpipe.plan import plan_to_dict
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan
    from graphpipe.frontend.zoo import load_graph

    cluster = preset("v100", 4)
    graph = load_graph("mmt:small", device=cluster.device)
    docs = []
    for _ in range(2):
        plan = make_plan("mmt:small", graph, cluster, 32, "gpp", SearchOptions(micro_batch_size=4),
                         schedule="cpsat", time_limit_s=3)
        assert plan.search["cpsat_status"] == "OPTIMAL" and plan.search["cpsat_canonical"]
        doc = plan_to_dict(plan)
        docs.append((doc["schedule"], doc["predicted"]["peak_memory_bytes"], [s["micro_batch_size"] for s in doc["stages"]]))
    assert docs[0] == docs[1]
