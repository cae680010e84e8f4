"""Spawn one process per device, watch them, and never hang (docs/design.md, "The runtime").

:func:`launch` starts ``world_size`` processes (``spawn`` start method, so
every rank starts from a clean interpreter, as under ``torchrun``) on a free
loopback port, lets each run :func:`graphpipe.runtime.worker.run_rank`, and
watches them:

* a rank that raises reports ``rank R: <exception>`` through a queue and
  exits non-zero; the parent then terminates every other rank and raises
  :class:`RuntimeFailure` with the earliest failure's message (a rank's
  failure usually makes its peers fail too — "connection closed" — so the
  root cause is the first one in time);
* a rank that dies without a word (signal, out of memory) is reported with
  its exit code;
* waits inside the ranks are bounded by the process-group timeout
  (``RunOptions.timeout_s``): a peer that stops answering turns into an
  exception within it, never a hang. When the peers time out while one rank
  is still alive and silent, that rank is the one named (a hung rank 0 is
  reported as rank 0, not as the gloo timeout of an idle rank 3).

The ranks never outlive the launcher: each runs in a process group of its
own (Ctrl-C at a terminal reaches only the launcher, which ends them — no
``KeyboardInterrupt`` traceback per rank), asks the kernel for SIGTERM when
its parent dies (``PR_SET_PDEATHSIG``: a SIGKILLed launcher takes its ranks
along), and the launcher ends them in a ``finally`` on any exit, including
SIGTERM, which ``graphpipe``'s CLI turns into an exception. A run asking for
more ranks than the host can start (:func:`host_rank_limit`) is refused
before any process starts.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue as queue_mod
import re
import signal
import socket
import sys
import time
import traceback
import warnings
from typing import Sequence

from graphpipe.errors import GraphpipeError, InputError
from graphpipe.runtime.jobs import RunOptions

__all__ = ["RuntimeFailure", "launch", "free_port", "host_rank_limit", "check_host_capacity"]

log = logging.getLogger(__name__)

# After the first failure, wait this long for earlier-stamped reports from other ranks.
_GRACE_S = 1.0
# A rank is a Python process with torch loaded and its stages' weights: about
# 350 MB resident for the zoo's small models (measured with /usr/bin/time on
# 4-rank runs of mmt:small), and a CPU time-shared by more than 8 ranks makes
# gloo's timeouts fire before the work does.
RANK_MEMORY_BYTES = 400 * 2**20
RANKS_PER_CPU = 8
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PROGRESS_S = 10.0  # -v: a line this often while the ranks work


class RuntimeFailure(GraphpipeError):
    """A rank of a real run failed; the message names the rank and its exception."""


def free_port() -> int:
    """A free TCP port on the loopback interface (bound and released; the OS does not reuse it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_rank_limit() -> tuple[int, str]:
    """How many ranks this host can start, and why: min(8 per usable CPU, available memory / 400 MiB)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit, why = RANKS_PER_CPU * cpus, f"{RANKS_PER_CPU} per CPU on {cpus} CPU(s)"
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        available = None
    if available is not None and available // RANK_MEMORY_BYTES < limit:
        limit = max(1, available // RANK_MEMORY_BYTES)
        why = f"about {RANK_MEMORY_BYTES // 2**20} MiB each in {available / 2**30:.1f} GiB of available memory"
    return limit, why


def check_host_capacity(world_size: int) -> None:
    """Refuse (one line, exit 2) a run of more ranks than :func:`host_rank_limit` allows."""
    limit, why = host_rank_limit()
    if world_size > limit:
        raise InputError(f"the run needs {world_size} ranks (one per device of the plan) but this host can start "
                         f"at most {limit} ({why}); plan for fewer devices (graphpipe plan -n {limit}) "
                         "or run under torchrun on more hosts")


def _detach(parent_pid: int) -> None:
    """First thing in a rank: own process group, die with the launcher, signals back on.

    The launcher blocked SIGINT/SIGTERM/SIGHUP while it started us, so none
    arrives between fork and here.
    """
    os.setpgid(0, 0)  # Ctrl-C at the terminal goes to the foreground group: the launcher only
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the kernel ends us when the launcher dies, even by SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; it ends us with SIGTERM
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def _child(rank: int, world_size: int, jobs, init_method: str, results: mp.Queue, parent_pid: int) -> None:
    _detach(parent_pid)
    try:
        from graphpipe.runtime.worker import run_rank

        def done(index: int, result: dict | None) -> None:
            if rank == 0:
                results.put(("job", rank, index, result, time.time()))

        run_rank(rank, world_size, jobs, init_method, done)
        results.put(("done", rank, None, None, time.time()))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        stamp = time.time()
        last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        where = f" (at {os.path.basename(last[0].filename)}:{last[0].lineno})" if last else ""
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()
        message = " ".join(line.strip() for line in text[:6]) + where
        try:
            results.put(("error", rank, None, message, stamp))
            results.close()
            results.join_thread()
        finally:
            os._exit(1)


def _quiet_resource_tracker() -> None:
    """A rank killed after a failure leaves the semaphores of its queues behind; multiprocessing's resource
    tracker (a process of its own, started with this interpreter's ``-W`` options) then prints a warning after
    our one-line error. It cleans them up either way, so the warning is silenced."""
    option = "ignore:resource_tracker:UserWarning"
    if option not in sys.warnoptions:
        sys.warnoptions.append(option)
        warnings.filterwarnings("ignore", message="resource_tracker", category=UserWarning)


def launch(jobs: Sequence[tuple[dict, RunOptions]], world_size: int) -> list[dict | None]:
    """Run ``jobs`` (plan documents with options) on ``world_size`` fresh processes; rank 0's results.

    Raises :class:`RuntimeFailure` when any rank fails.
    """
    if not jobs:
        return []
    check_host_capacity(world_size)
    _quiet_resource_tracker()
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(r, world_size, list(jobs), init_method, results, os.getpid()),
                         daemon=True, name=f"graphpipe-rank{r}") for r in range(world_size)]
    job_results: dict[int, dict | None] = {}
    finished: set[int] = set()
    errors: list[tuple[float, int, str]] = []
    first_error_at = None
    try:
        # Signals wait while the ranks start (they inherit the mask and unblock it
        # in _detach); a Ctrl-C here arrives right after, inside this try.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        log.info("started %d ranks (pids %s)", world_size, ", ".join(str(p.pid) for p in procs))
        began = last_note = time.monotonic()
        while len(finished) < world_size:
            try:
                kind, rank, index, payload, stamp = results.get(timeout=0.1)
            except queue_mod.Empty:
                kind = None
            if kind == "job":
                job_results[index] = payload
                log.info("job %d of %d finished", index + 1, len(jobs))
            elif kind == "done":
                finished.add(rank)
            elif kind == "error":
                errors.append((stamp, rank, payload))
                first_error_at = first_error_at or time.monotonic()
            if kind is None and time.monotonic() - last_note > _PROGRESS_S:
                last_note = time.monotonic()
                log.info("%.0f s: %d of %d jobs done, %d of %d ranks finished", last_note - began, len(job_results),
                         len(jobs), len(finished), world_size)
            if kind is None:
                for r, p in enumerate(procs):
                    if r not in finished and p.exitcode is not None and p.exitcode != 0 and not any(e[1] == r for e in errors):
                        # Give its report a moment to arrive through the queue.
                        first_error_at = first_error_at or time.monotonic()
                        if time.monotonic() - first_error_at > _GRACE_S:
                            errors.append((time.time(), r, f"exited with code {p.exitcode} without a report"))
            if errors and time.monotonic() - first_error_at > _GRACE_S * (0 if len(errors) >= world_size else 1):
                raise RuntimeFailure(_failure_message(errors, procs, finished))
    finally:
        if not errors:  # normal end: let every rank exit on its own (killing one mid-exit leaks its semaphores)
            for p in procs:
                if p.pid is not None:
                    p.join(timeout=30 if len(finished) == world_size else 0.5)
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [job_results.get(i) for i in range(len(jobs))]


_TIMEOUT = re.compile(r"timed? ?out|timeout|within [0-9.]+ s", re.I)
_PEER = re.compile(r"from rank (\d+)")


def _failure_message(errors: list[tuple[float, int, str]], procs, finished: set[int]) -> str:
    """The root cause: the earliest failure, unless the failures are timeouts waiting for a rank that is
    still alive and silent — then that rank (it hung; its peers only noticed)."""
    stamp, rank, message = min(errors)
    failed = {r for _, r, _ in errors}
    silent = [r for r, p in enumerate(procs) if r not in failed and r not in finished and p.is_alive()]
    if silent and all(_TIMEOUT.search(m) for _, _, m in errors):
        named = sorted({int(r) for _, _, m in errors for r in _PEER.findall(m)} & set(silent))
        hung = named or silent
        waiting = "; ".join(f"rank {r}: {m}" for _, r, m in sorted(errors)[:3])
        ranks = ", ".join(map(str, hung))
        return (f"rank{'s' if len(hung) > 1 else ''} {ranks} stopped answering (still running when "
                f"{len(errors)} peer(s) timed out waiting): {waiting}")
    return f"rank {rank} failed: {message}"
