"""Issue 20, runs: signals end every rank, a hung rank is named, -v shows progress, devices are compared;
issue 35: a rank the kernel kills is named with its signal, and a hung rank is named from heartbeats.

Every test drives ``graphpipe run`` as a process, as a scheduler or a
terminal would: SIGTERM (a scheduler's kill), SIGKILL, Ctrl-C (SIGINT to the
terminal's foreground process group) while the ranks start. "No rank alive"
means no rank process exists any more (a zombie waiting to be reaped counts
as dead: it runs nothing).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

GRAPHPIPE = [sys.executable, "-m", "graphpipe"]
# How long ranks may take to end once told: a safety net, not a measurement. A rank on a loaded host may still be
# importing torch when the launcher dies; it ends as soon as it runs its first line of ours.
GONE_WITHIN_S = 120
# Every wall-clock limit below is a safety net against a hang, never a measurement: on a host running many test
# workers a plan of mmt:small has taken over 2 minutes (6 xdist workers on 2 shared cores).
SAFETY_S = 900
STARTED = re.compile(r"started (\d+) ranks \(pids ([\d, ]+)\)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _wait_all_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("runs") / "plan.json"
    proc = subprocess.run(GRAPHPIPE + ["plan", "mmt:small", "-n", "2", "-b", "4", "--out", str(path)],
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr
    return str(path)


def _start_run(plan_file: str, *extra: str, new_session: bool = False):
    """Start ``graphpipe -v run`` for many steps; return (process, rank pids) once it says the ranks started."""
    proc = subprocess.Popen(GRAPHPIPE + ["-v", "run", plan_file, "--steps", "100000", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)
    lines = []
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        match = STARTED.search(line)
        if match:
            return proc, [int(p) for p in match.group(2).split(",")], lines
    proc.kill()
    pytest.fail("graphpipe run never said its ranks started:\n" + "".join(lines))


def _finish(proc) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=SAFETY_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail("graphpipe run did not exit after the signal")
    return proc.returncode, err


def test_sigterm_ends_every_rank(plan_file):
    """A scheduler's kill: the launcher exits 143 and every rank ends (GONE_WITHIN_S is only a safety net)."""
    proc, pids, _ = _start_run(plan_file)
    time.sleep(3)  # the ranks are importing torch / joining the process group
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert _wait_all_gone(pids, GONE_WITHIN_S) == []


def test_sigkill_of_the_launcher_ends_every_rank(plan_file):
    """No Python code runs on SIGKILL: the kernel's parent-death signal ends the ranks."""
    proc, pids, _ = _start_run(plan_file)
    time.sleep(3)
    proc.kill()
    proc.wait(timeout=30)
    assert _wait_all_gone(pids, GONE_WITHIN_S) == []


def test_ctrl_c_during_rank_start_up_is_one_line(plan_file):
    """Ctrl-C reaches the terminal's foreground group: the launcher only (ranks have their own groups),
    so there is no KeyboardInterrupt traceback per rank; exit 130 and every rank ends."""
    proc, pids, _ = _start_run(plan_file, new_session=True)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C, while the ranks start
    code, err = _finish(proc)
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "graphpipe: interrupted" in err
    assert _wait_all_gone(pids, GONE_WITHIN_S) == []


@pytest.mark.slow
@pytest.mark.parametrize("hung", [0, 1])
def test_a_hung_rank_is_named_not_the_idle_rank_that_timed_out(tmp_path, hung):
    """Rank ``hung`` goes silent at its first F; its peers (rank 0 among them when rank 1 hangs, and an idle
    rank 3) time out with gloo's anonymous timeouts or a named wait: the silent rank is reported, from its
    heartbeats (in place in the executor's forward, not waiting on any peer).

    Independent of the machine's speed: on a loaded host a peer may time out at the first barrier while
    another rank is still setting up, before anyone reaches the hang. The launcher then says that rank was
    still working ("slow, not hung"), which is also right; the run is then repeated with twice the timeout,
    until it reaches the hang."""
    plan = tmp_path / "p4.json"
    proc = subprocess.run(GRAPHPIPE + ["plan", "mmt:small", "-n", "4", "-b", "8", "--out", str(plan)],
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr
    assert "uses 3 of 4 devices" in proc.stderr  # rank 3 is idle, as in the issue
    timeout_s = 5
    while True:
        proc = subprocess.run(GRAPHPIPE + ["run", str(plan), "--steps", "2", "--timeout", str(timeout_s)],
                              capture_output=True, text=True, timeout=SAFETY_S + 8 * timeout_s,
                              env={**os.environ, "GRAPHPIPE_FAIL_RANK": str(hung), "GRAPHPIPE_FAIL_AT": "hang"})
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        if "slow, not hung" in last and timeout_s < 80:  # the run never reached the hang: set-up outlasted it
            assert "stopped answering" not in last, last
            timeout_s *= 2
            continue
        break
    assert last.startswith(f"graphpipe: error: rank {hung} stopped answering (rank {hung}: at executor.py:_forward:"), \
        proc.stderr
    assert "not waiting on any peer) while" in last and "peer(s) timed out waiting" in last, last


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 2])
def test_a_rank_killed_by_the_kernel_is_the_message_not_its_peers(tmp_path, victim):
    """``kill -9`` of one rank of a 3-rank run (what the out-of-memory killer does): its peers see the connection
    close and report first, but the error names the killed rank, its pid and SIGKILL, with the OOM-killer hint.
    The kill comes once every rank has used 4 s of CPU (past importing torch and capturing the model: training,
    or about to), a point measured in CPU time, not wall time, so a loaded host reaches it too, only later."""
    plan = tmp_path / "p3.json"
    proc = subprocess.run(GRAPHPIPE + ["plan", "mmt:small", "-n", "3", "-b", "6", "--out", str(plan)],
                          capture_output=True, text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr
    proc, pids, _ = _start_run(str(plan))
    assert len(pids) == 3
    deadline = time.monotonic() + 600  # a safety net: any moment of the run would do
    while min(_cpu_seconds(p) for p in pids) < 4.0 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the kill"
    os.kill(pids[victim], signal.SIGKILL)
    code, err = _finish(proc)
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"graphpipe: error: rank {victim} (pid {pids[victim]}) was killed by SIGKILL without a "
                           "report"), err
    assert "out-of-memory killer" in last, last
    assert "Traceback" not in err, err
    assert _wait_all_gone(pids, GONE_WITHIN_S) == []


def test_verbose_run_shows_progress_and_both_devices(plan_file):
    """-v prints progress; a V100 plan run on CPU says so next to the prediction error."""
    proc = subprocess.run(GRAPHPIPE + ["-v", "run", plan_file, "--steps", "2", "--json"], capture_output=True,
                          text=True, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr
    assert "graphpipe: launch: started 2 ranks" in proc.stderr
    assert "graphpipe: run_cmd: all ranks finished" in proc.stderr
    assert "the plan was made for V100-16GB; this run is on CPU" in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["devices"]["planned"] == "V100-16GB" and summary["devices"]["run"].startswith("CPU")


_PROBE = '''import multiprocessing, os
import torch


def make():
    if multiprocessing.parent_process() is not None:  # in a rank, not in the launcher's preflight
        raise ValueError("probe=" + os.environ.get("GRAPHPIPE_TEST_PROBE", "unset") + " cwd=" + os.getcwd())
    return torch.nn.Linear(4, 2), (torch.randn(4, 4),), lambda out: out.sum()
'''


def test_every_launch_gives_its_ranks_the_launchers_environment_and_directory_of_the_moment(tmp_path, monkeypatch):
    """Ranks are forked by a forkserver started at the first launch of the process: each later launch's ranks
    still see the launcher's environment and working directory as they are at that launch, not the server's."""
    from graphpipe.frontend.capture import captured_from_factory
    from graphpipe.cluster import preset
    from graphpipe.runtime import RunOptions, RuntimeFailure, run_plans
    from graphpipe.search.planner import make_plan

    spec = str(tmp_path / "probe.py") + ":make"
    (tmp_path / "probe.py").write_text(_PROBE)
    plan = make_plan(spec, captured_from_factory(spec).graph, preset("v100", 1), 4, "gpp")
    for value, cwd in (("first", tmp_path), ("second", tmp_path.parent)):
        monkeypatch.setenv("GRAPHPIPE_TEST_PROBE", value)
        monkeypatch.chdir(cwd)
        with pytest.raises(RuntimeFailure, match=f"probe={value} cwd={cwd}"):
            run_plans([(plan, RunOptions(steps=1, timeout_s=60))], 1)
