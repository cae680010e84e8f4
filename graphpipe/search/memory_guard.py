"""A resident-memory budget for a search: stop it with one clear line instead of a kernel kill.

Searches grow tables with the graph and the device count (Piper's downset
pairs, the DPs' memo tables); a search that would outgrow the machine used
to end in the kernel's out-of-memory kill (exit 137, no message).
:func:`memory_guard` watches the process's resident set size from a
background thread (``/proc/self/statm``, every :data:`POLL_S` seconds) and,
once it passes the budget, raises :class:`MemoryBudgetError` in the thread
running the search (``PyThreadState_SetAsyncExc``: delivered between two
Python bytecodes, so a long numpy call finishes first; the searches keep
their arrays in chunks for that reason). A ``MemoryError`` inside the
guarded block becomes the same error. The CLI prints it as one line, exit 2.

The default budget is :data:`DEFAULT_FRACTION` of the machine's memory
(``MemTotal``); ``graphpipe plan --max-memory-gb`` or
``SearchOptions.max_memory_gb`` sets another. :func:`stage` names what is
running (a strategy, or gpp ranking a candidate's plan) for the message.

Example
-------
>>> with memory_guard("gpp", limit_bytes=64 * 2**30):
...     total = sum(range(1000))
>>> total
499500
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from typing import Iterator

from graphpipe.errors import GraphpipeError

__all__ = ["MemoryBudgetError", "memory_guard", "stage", "resident_bytes", "machine_bytes", "default_budget_bytes",
           "DEFAULT_FRACTION", "POLL_S"]

DEFAULT_FRACTION = 0.5
"""Share of the machine's memory a search may hold by default: room for the rest of the machine (other jobs,
the page cache) while a search that would need it all is stopped long before the kernel steps in."""

POLL_S = 0.01
"""Seconds between two readings of the resident size: reading ``/proc/self/statm`` costs microseconds."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryBudgetError(GraphpipeError):
    """A search's process went over its resident-memory budget; the message names the search and the fix."""

    def __init__(self, what: str, resident: float, limit: float):
        self.what, self.resident, self.limit = what, resident, limit
        fix = "raise --max-memory-gb or plan on fewer devices"
        if "piper" in what:  # its downset pairs are what grows: the other strategies do not enumerate them
            fix += ", or use --strategy gpp or pipedream"
        super().__init__(f"{what} search stopped: the process holds {resident / 2**30:.3g} GB, over its memory "
                         f"budget of {limit / 2**30:.3g} GB (--max-memory-gb); {fix}")


def resident_bytes() -> float:
    """The process's resident set size in bytes (``/proc/self/statm``; the peak RSS where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        import resource
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def machine_bytes() -> float | None:
    """Total memory of the machine (``MemTotal``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    try:
        return float(os.sysconf("SC_PHYS_PAGES")) * _PAGE
    except (OSError, ValueError, AttributeError):
        return None


def default_budget_bytes() -> float | None:
    """:data:`DEFAULT_FRACTION` of the machine's memory (None: unknown, no budget)."""
    total = machine_bytes()
    return None if total is None else DEFAULT_FRACTION * total


class _Guard:
    """The watcher of one guarded block: a thread polling the resident size for the thread that runs the search."""

    def __init__(self, what: str, limit: float):
        self.labels = [what]
        self.limit = limit
        self.target = threading.get_ident()
        self.stop = threading.Event()
        self.fired: MemoryBudgetError | None = None
        self.thread = threading.Thread(target=self._watch, name="graphpipe-memory-guard", daemon=True)

    @property
    def what(self) -> str:
        return self.labels[-1]

    def _watch(self) -> None:
        while not self.stop.wait(POLL_S):
            resident = resident_bytes()
            if resident > self.limit:
                self.fired = MemoryBudgetError(self.what, resident, self.limit)
                # The exception class is raised in the search's thread at its next bytecode; the instance
                # with the figures is picked up by memory_guard, which re-raises it.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.target),
                                                           ctypes.py_object(_BudgetSignal))
                return


class _BudgetSignal(Exception):
    """What the watcher raises asynchronously; :func:`memory_guard` turns it into :class:`MemoryBudgetError`."""


_active: dict[int, _Guard] = {}


@contextmanager
def memory_guard(what: str, limit_bytes: float | None = None) -> Iterator[None]:
    """Stop the block with :class:`MemoryBudgetError` once the process's resident size passes ``limit_bytes``.

    ``what`` names the search in the message (e.g. ``"piper"``). ``limit_bytes`` None is
    :func:`default_budget_bytes`. Re-entrant: inside a guarded block of the same thread it only
    relabels (the outer budget stands). The budget is checked once on entry too, so a process
    already over it fails at once.
    """
    tid = threading.get_ident()
    outer = _active.get(tid)
    if outer is not None:
        with stage(what):
            yield
        return
    limit = default_budget_bytes() if limit_bytes is None else float(limit_bytes)
    if limit is None:
        yield
        return
    resident = resident_bytes()
    if resident > limit:
        raise MemoryBudgetError(what, resident, limit)
    guard = _Guard(what, limit)
    _active[tid] = guard
    guard.thread.start()
    try:
        try:
            yield
        finally:
            guard.stop.set()
            guard.thread.join()
            del _active[tid]
    except _BudgetSignal:
        raise guard.fired or MemoryBudgetError(what, resident_bytes(), limit) from None
    except MemoryError:
        raise MemoryBudgetError(guard.what, resident_bytes(), limit) from None
    if guard.fired is not None:  # fired after the block's last bytecode: the signal may still be pending
        _drain()


def _drain() -> None:
    """Let a pending asynchronous signal land here and drop it: the guarded block finished within budget."""
    try:
        for _ in range(100):
            pass
    except _BudgetSignal:
        pass


@contextmanager
def stage(what: str) -> Iterator[None]:
    """Name what runs inside the current guard (e.g. ``"gpp (ranking piper's plan)"``); no-op without one."""
    guard = _active.get(threading.get_ident())
    if guard is None:
        yield
        return
    guard.labels.append(what)
    try:
        yield
    finally:
        guard.labels.pop()
