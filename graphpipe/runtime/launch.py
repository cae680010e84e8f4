"""Spawn one process per device, watch them, and never hang (DESIGN §8).

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
  exception within it, never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Sequence

from graphpipe.errors import GraphpipeError
from graphpipe.runtime.jobs import RunOptions

__all__ = ["RuntimeFailure", "launch", "free_port"]

# After the first failure, wait this long for earlier-stamped reports from other ranks.
_GRACE_S = 1.0


class RuntimeFailure(GraphpipeError):
    """A rank of a real run failed; the message names the rank and its exception."""


def free_port() -> int:
    """A free TCP port on the loopback interface (bound and released; the OS does not reuse it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, jobs, init_method: str, results: mp.Queue) -> None:
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


def launch(jobs: Sequence[tuple[dict, RunOptions]], world_size: int) -> list[dict | None]:
    """Run ``jobs`` (plan documents with options) on ``world_size`` fresh processes; rank 0's results.

    Raises :class:`RuntimeFailure` when any rank fails.
    """
    if not jobs:
        return []
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(r, world_size, list(jobs), init_method, results), daemon=True,
                         name=f"graphpipe-rank{r}") for r in range(world_size)]
    for p in procs:
        p.start()
    job_results: dict[int, dict | None] = {}
    finished: set[int] = set()
    errors: list[tuple[float, int, str]] = []
    first_error_at = None
    try:
        while len(finished) < world_size:
            try:
                kind, rank, index, payload, stamp = results.get(timeout=0.1)
            except queue_mod.Empty:
                kind = None
            if kind == "job":
                job_results[index] = payload
            elif kind == "done":
                finished.add(rank)
            elif kind == "error":
                errors.append((stamp, rank, payload))
                first_error_at = first_error_at or time.monotonic()
            if kind is None:
                for r, p in enumerate(procs):
                    if r not in finished and p.exitcode is not None and p.exitcode != 0 and not any(e[1] == r for e in errors):
                        # Give its report a moment to arrive through the queue.
                        first_error_at = first_error_at or time.monotonic()
                        if time.monotonic() - first_error_at > _GRACE_S:
                            errors.append((time.time(), r, f"exited with code {p.exitcode} without a report"))
            if errors and time.monotonic() - first_error_at > _GRACE_S * (0 if len(errors) >= world_size else 1):
                stamp, rank, message = min(errors)
                raise RuntimeFailure(f"rank {rank} failed: {message}")
    finally:
        if not errors:  # normal end: let every rank exit on its own (killing one mid-exit leaks its semaphores)
            for p in procs:
                p.join(timeout=30)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [job_results.get(i) for i in range(len(jobs))]
