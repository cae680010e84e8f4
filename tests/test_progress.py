"""Progress on stderr: a bar at a terminal, periodic lines elsewhere, nothing when off; stdout stays clean."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

from graphpipe.progress import Progress, progress_mode, slow_notice

HERE = os.path.dirname(os.path.abspath(__file__))


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_lines_count_every_unit_with_a_rate_and_the_label():
    out = io.StringIO()
    with Progress("run", total=4, unit="step", stream=out, mode="lines", every_s=0) as bar:
        for k in range(4):
            time.sleep(0.01)
            bar.update(postfix=f"loss {k}")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"graphpipe: run: {k}/4 step" for k in (1, 2, 3, 4)]
    assert "step/s" in lines[-1] and "step/s" not in lines[0]  # a rate once two units are in (close repeats none)
    assert lines[-1].endswith("loss 3")


def test_a_resumed_count_starts_at_its_step_and_a_heartbeat_speaks_before_the_first_unit():
    """initial: the steps a checkpoint holds; the rate counts only this count's units. heartbeat: a line at once
    and while no unit finishes (an experiment whose first point takes minutes)."""
    out = io.StringIO()
    with Progress("run", total=10, unit="step", stream=out, mode="lines", every_s=3600, initial=6) as bar:
        bar.update(2)
    assert out.getvalue().startswith("graphpipe: run: 8/10 step (") and "0/10" not in out.getvalue()
    out = io.StringIO()
    bar = Progress("eval x", total=3, unit="point", stream=out, mode="lines", every_s=0.05, heartbeat=True)
    assert out.getvalue().startswith("graphpipe: eval x: 0/3 point (")
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    bar.close()
    assert out.getvalue().count("0/3 point") >= 2


def test_lines_are_rate_limited():
    out = io.StringIO()
    bar = Progress("eval x", total=1000, unit="point", stream=out, mode="lines", every_s=3600)
    for _ in range(1000):
        bar.update()
    bar.close()
    assert out.getvalue().count("\n") == 1 and "1000/1000 point" in out.getvalue()  # only the closing line


def test_off_writes_nothing_and_quiet_close_skips_the_last_line():
    out = io.StringIO()
    with Progress("run", total=2, stream=out, mode="off") as bar:
        bar.update(2)
    failed = Progress("run", total=2, stream=out, mode="lines", every_s=3600)
    failed.update()
    failed.close(quiet=True)
    assert out.getvalue() == ""


def test_bar_at_a_terminal_and_lines_elsewhere(monkeypatch):
    monkeypatch.delenv("GRAPHPIPE_PROGRESS", raising=False)
    assert progress_mode(_Tty()) == "bar" and progress_mode(io.StringIO()) == "lines"
    monkeypatch.setenv("GRAPHPIPE_PROGRESS", "off")
    assert progress_mode(_Tty()) == "off"
    tty = _Tty()
    with Progress("profile m", total=3, unit="pass", stream=tty, mode="bar") as bar:
        bar.update(3)
    assert "graphpipe: profile m" in tty.getvalue() and "3/3" in tty.getvalue()


def test_slow_notice_speaks_only_for_slow_work():
    out = io.StringIO()
    with slow_notice("capturing quick", after_s=5, stream=out, mode="lines"):
        pass
    assert out.getvalue() == ""
    with slow_notice("capturing slow", after_s=0.05, stream=out, mode="lines"):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "graphpipe: capturing slow ..." and lines[1].startswith("graphpipe: capturing slow: done in")


def _cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "graphpipe", *argv], capture_output=True, text=True, timeout=600,
                          cwd=HERE, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_run_reports_steps_on_stderr_and_keeps_json_clean(tmp_path):
    plan = tmp_path / "p.json"
    made = _cli("plan", "twobranch:small", "--devices", "2", "--batch-size", "8", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    proc = _cli("--progress", "lines", "run", str(plan), "--steps", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # nothing but the JSON object on stdout
    assert "graphpipe: run: 3/3 step" in proc.stderr and "2 ranks started" in proc.stderr
    quiet = _cli("--progress", "off", "run", str(plan), "--steps", "2")
    assert quiet.returncode == 0 and "graphpipe: run:" not in quiet.stderr


@pytest.mark.slow
def test_profile_reports_its_passes(tmp_path):
    out = tmp_path / "p.profile.json"
    proc = _cli("profile", "transformer:small", "--out", str(out), "--batch-sizes", "1,2", "--repeats", "2",
                "--warmup", "1", env={"GRAPHPIPE_PROGRESS": "lines"})
    assert proc.returncode == 0, proc.stderr
    assert "graphpipe: profile transformer:small: 6/6 pass" in proc.stderr
