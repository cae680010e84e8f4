"""Progress of long work on stderr: a tqdm bar at a terminal, plain periodic lines elsewhere.

``graphpipe run``, ``profile``, ``eval`` and a slow capture say what they
are doing without ``-v``: steps done out of the total with a rate, ranks
started, the current experiment. At a terminal that is a tqdm bar (one line
redrawn in place); in a log file or a CI console it is a line at most every
:data:`LINE_EVERY_S` seconds plus a last one, since carriage returns there
only make noise. Everything goes to stderr, so ``--json`` output on stdout
stays clean. ``graphpipe --progress MODE`` (or ``GRAPHPIPE_PROGRESS``, which
a run's ranks inherit) picks ``auto`` (the default: bar at a terminal, lines
elsewhere), ``bar``, ``lines`` or ``off``.

Example
-------
>>> import io
>>> out = io.StringIO()
>>> with Progress("steps", total=3, unit="step", stream=out, mode="lines") as bar:
...     for _ in range(3):
...         bar.update()
>>> out.getvalue().splitlines()[-1].startswith("graphpipe: steps: 3/3 step")
True
>>> note("started 4 ranks", stream=out, mode="off")  # off: nothing
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

__all__ = ["Progress", "note", "slow_notice", "progress_mode", "step_done", "set_step_hook", "MODES", "LINE_EVERY_S"]

MODES = ("auto", "bar", "lines", "off")
LINE_EVERY_S = 10.0
"""Plain mode's period: often enough to show a run is alive, rare enough for a CI log."""


def progress_mode(stream: TextIO | None = None, mode: str | None = None) -> str:
    """``bar``, ``lines`` or ``off``: ``mode`` (else ``GRAPHPIPE_PROGRESS``, else auto) resolved for ``stream``."""
    chosen = mode or os.environ.get("GRAPHPIPE_PROGRESS", "auto")
    if chosen not in MODES:
        chosen = "auto"
    if chosen == "auto":
        stream = stream or sys.stderr
        return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
    return chosen


def note(message: str, stream: TextIO | None = None, mode: str | None = None) -> None:
    """One line ``graphpipe: MESSAGE`` on stderr unless progress is off (a milestone, not a bar)."""
    stream = stream or sys.stderr
    if progress_mode(stream, mode) != "off":
        stream.write(f"graphpipe: {message}\n")
        stream.flush()


class Progress:
    """Count ``total`` units of work named ``what``; :meth:`update` as they finish, :meth:`close` at the end.

    ``postfix`` (a short text: the current experiment, a loss) is shown
    beside the count. A bar needs tqdm; without it, lines are printed.
    """

    def __init__(self, what: str, total: int | None, unit: str = "it", stream: TextIO | None = None,
                 mode: str | None = None, every_s: float = LINE_EVERY_S, initial: int = 0, heartbeat: bool = False):
        """``initial``: units already done before this count began (a run resumed at a checkpoint's step).
        ``heartbeat``: in plain mode, a line at once and then every ``every_s`` seconds even while no unit
        finishes (work whose first unit takes minutes; a command whose refusal must stay one line leaves it off)."""
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream or sys.stderr
        self.mode = progress_mode(self.stream, mode)
        self.every_s = every_s
        self.done = self.initial = initial
        self.postfix = ""
        self.start = self.last_line = time.monotonic()
        self._printed: tuple[int, str] | None = None  # (count, postfix) of the last line: close repeats none
        self._bar = None
        self._closed = False
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is a dependency; a stripped install still gets lines
                self.mode = "lines"
            else:
                self._bar = tqdm(total=total, desc=f"graphpipe: {what}", unit=unit, file=self.stream,
                                 dynamic_ncols=True, leave=True, initial=initial)
        if heartbeat and self.mode == "lines":
            self._line()
            self._ticker = threading.Thread(target=self._beat, daemon=True, name="graphpipe-progress")
            self._ticker.start()

    def _beat(self) -> None:
        """Plain mode's heartbeat: the count again once ``every_s`` passed with no line."""
        while not self._stop.wait(min(1.0, self.every_s)):
            if time.monotonic() - self.last_line >= self.every_s:
                self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """``n`` more units done; ``postfix`` replaces the text shown beside the count."""
        self.done += n
        if postfix is not None:
            self.postfix = postfix
        if self._bar is not None:
            if postfix is not None:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n)
        elif self.mode == "lines" and time.monotonic() - self.last_line >= self.every_s:
            self._line()

    def _line(self) -> None:
        with self._lock:
            now = time.monotonic()
            elapsed = now - self.start
            count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
            # The rate over all the time this count has run, once two units are in: units of unequal cost (an
            # experiment's points) would make a rate from the first unit's end a figure of the cheap ones only.
            new = self.done - self.initial
            rate = f", {new / elapsed:.3g} {self.unit}/s" if new >= 2 and elapsed > 0 else ""
            extra = f"  {self.postfix}" if self.postfix else ""
            self.stream.write(f"graphpipe: {self.what}: {count} {self.unit} ({elapsed:.1f} s{rate}){extra}\n")
            self.stream.flush()
            self.last_line = time.monotonic()
            self._printed = (self.done, self.postfix)

    def close(self, quiet: bool = False) -> None:
        """End the bar, or print the last line (plain mode; not when ``quiet``: work that failed); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines" and not quiet and self._printed != (self.done, self.postfix):
            self._line()  # the last count, unless the last line already said it


class slow_notice:
    """``with slow_notice("capturing mmt"):`` prints ``graphpipe: capturing mmt ...`` if the block is still
    running after ``after_s`` seconds, and how long it took when it ends; a quick block prints nothing."""

    def __init__(self, what: str, after_s: float = 2.0, stream: TextIO | None = None, mode: str | None = None):
        self.what, self.after_s = what, after_s
        self.stream = stream or sys.stderr
        self.mode = progress_mode(self.stream, mode)
        self.shown = threading.Event()
        self._timer: threading.Timer | None = None

    def _show(self) -> None:
        self.shown.set()
        self.stream.write(f"graphpipe: {self.what} ...\n")
        self.stream.flush()

    def __enter__(self) -> "slow_notice":
        self.start = time.monotonic()
        if self.mode != "off":
            self._timer = threading.Timer(self.after_s, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.shown.is_set() and exc_type is None:
            self.stream.write(f"graphpipe: {self.what}: done in {time.monotonic() - self.start:.1f} s\n")
            self.stream.flush()


_step_hook: Callable[[], None] | None = None


def set_step_hook(hook: Callable[[], None] | None) -> None:
    """In a rank: call ``hook`` after every training step (:func:`step_done`). The launcher sets one in rank 0,
    which forwards each step to the parent's bar, so the training loops need not know who is watching."""
    global _step_hook
    _step_hook = hook


def step_done() -> None:
    """A training loop finished a step (rank 0's count is the run's)."""
    if _step_hook is not None:
        _step_hook()
