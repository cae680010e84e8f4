"""Exceptions with meaning. The CLI turns any :class:`GraphpipeError` into
one line ``graphpipe: error: ...`` and exit code 2; anything else is our bug
(exit 1, one line, the traceback under ``-v``).

:func:`user_code_error` turns an exception raised inside the user's own code
(a ``file.py:factory`` or its module's ``forward``) into a
:class:`UserCodeError` whose message names the user's file and line:

>>> try:
...     exec(compile("1 / 0", "/home/me/model.py", "exec"))
... except ZeroDivisionError as exc:
...     print(user_code_error(exc, "calling factory()", "/home/me/model.py"))
/home/me/model.py:1: calling factory() failed: ZeroDivisionError: division by zero
"""

import os
import re
import traceback

__all__ = [
    "some",
    "GraphpipeError",
    "InputError",
    "GraphCycleError",
    "FormatError",
    "PlanError",
    "LaunchError",
    "ScheduleError",
    "InfeasibleError",
    "DeviceMemoryError",
    "DeadlockError",
    "UserCodeError",
    "user_code_error",
    "user_location",
    "library_frame",
    "library_location",
]


class GraphpipeError(Exception):
    """Base of every error that is the user's input, not our bug."""


class InputError(GraphpipeError, ValueError):
    """A bad argument or file: the message names the value and the fix."""


class FormatError(InputError):
    """A file of the wrong shape or unknown ``format`` version."""


class GraphCycleError(InputError):
    """The op graph has a cycle; ``cycle`` lists the op names on it."""

    def __init__(self, cycle: list[str]):
        self.cycle = list(cycle)
        super().__init__("graph has a cycle: " + " -> ".join(self.cycle + self.cycle[:1]))


class PlanError(InputError):
    """A stage graph or plan that breaks an invariant (named in the message)."""


class LaunchError(PlanError, SystemExit):
    """A job started with another number of ranks than its plan runs on (``graphpipe.Pipeline`` under torchrun).

    Every rank reads the same plan, so every rank raises it, before any
    collective: none waits on a peer that is gone. Left uncaught (the usual
    case: the user's training script) it ends the process with exit code 2
    and no traceback, the one line having gone to stderr when it was raised;
    caught, it is a :class:`PlanError` like any other.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2  # SystemExit's exit status when nothing catches it


class ScheduleError(InputError):
    """A schedule that fails validation; the message holds the device x step grid."""


class DeadlockError(ScheduleError):
    """Simulation or validation found actions that can never run."""


class InfeasibleError(GraphpipeError):
    """No plan/schedule satisfies the constraints; the message names the one that binds, with its numbers."""


class DeviceMemoryError(InfeasibleError):
    """No plan fits in device memory (the binding constraint is memory, not a count or a divisibility).

    A class of its own so the command line can add where the device's memory
    came from (the default preset, ``--cluster``, ``--memory-gb``) and what
    device a ``--profile`` was measured on: the search knows only the bytes.
    """


class UserCodeError(InputError):
    """The user's own code (a factory, a module's ``forward``) raised; the message names its file and line."""


# Frames in these folders are ours or the interpreter's, never the user's.
_NOT_USER = (os.path.dirname(os.path.abspath(traceback.__file__)) + os.sep,
             os.path.dirname(os.path.abspath(__file__)) + os.sep)


def _user_frame(exc: BaseException, user_file: str | None):
    """The deepest traceback frame in ``user_file`` (or, without one, outside graphpipe, torch and the stdlib)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    want = os.path.realpath(user_file) if user_file else None
    for frame in reversed(frames):
        name = frame.filename
        if want is not None:
            if os.path.realpath(name) == want:
                return frame
        elif (not name.startswith("<") and not name.startswith(_NOT_USER)
              and f"{os.sep}site-packages{os.sep}" not in name):
            return frame
    return None


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def user_location(exc: BaseException, user_file: str | None = None) -> str:
    """``"file:line: "`` of the user's code that raised ``exc`` ("" when none is found).

    Looks through the traceback first, then through a traceback quoted in the
    message (torch.fx quotes the traced source line of a failing node).
    """
    frame = _user_frame(exc, user_file) or (_user_frame(exc, None) if user_file else None)
    if frame is not None:
        return f"{frame.filename}:{frame.lineno}: "
    want = os.path.realpath(user_file) if user_file else None
    quoted = [(f, n) for f, n in _FILE_LINE.findall(str(exc))
              if (os.path.realpath(f) == want if want else not f.startswith(_NOT_USER))]
    if quoted:
        return f"{quoted[-1][0]}:{quoted[-1][1]}: "
    return f"{user_file}: " if user_file else ""


def library_frame(frames: list[traceback.FrameSummary], skip: tuple[str, ...] = ()) -> traceback.FrameSummary | None:
    """The deepest of ``frames`` (a traceback's or a stack's, outermost first) outside graphpipe, the stdlib and
    the folders ``skip``: where an installed library (transformers) called in, when no user code did."""
    for frame in reversed(frames):
        if not frame.filename.startswith(("<", *_NOT_USER, *skip)):
            return frame
    return None


def library_location(exc: BaseException, skip: tuple[str, ...] = ()) -> str:
    """``"file:line: "`` of :func:`library_frame` in ``exc``'s traceback ("" when none): a model whose code is
    installed (transformers) fails in that library, not in user code."""
    frame = library_frame(traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else [], skip)
    return f"{frame.filename}:{frame.lineno}: " if frame is not None else ""


def user_code_error(exc: BaseException, doing: str, user_file: str | None = None) -> UserCodeError:
    """One line for a failure in the user's code: ``file:line: <doing> failed: Type: message``.

    The original exception stays the ``__cause__`` (raise it ``from exc``), so
    ``graphpipe -v`` can print the full traceback.
    """
    where = user_location(exc, user_file)
    text = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    if len(message) > 300:
        message = message[:297] + "..."
    return UserCodeError(f"{where}{doing} failed: {message}")


def some(names, limit: int = 6, sep: str = ", ") -> str:
    """The first ``limit`` of ``names`` joined for a one-line message, `` ...`` when there are more.

    >>> some(["a", "b", "c"], 2)
    'a, b ...'
    """
    names = list(names)
    return sep.join(names[:limit]) + (" ..." if len(names) > limit else "")
