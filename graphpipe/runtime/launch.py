"""Start one process per device, watch them, and never hang (docs/design.md, "The runtime").

:func:`launch` starts ``world_size`` processes on a free loopback port, lets
each run :func:`graphpipe.runtime.worker.run_rank`, and watches them. Ranks
on a CPU are forked by a ``forkserver`` that has imported the runtime,
torch.export and dynamo once (:data:`PRELOAD`) and nothing else: each starts
as a clean interpreter would after those imports (no state of the
launcher's), with the launcher's environment and working
directory of the moment, without paying the imports again (most of a small
run's start-up). Ranks that may use CUDA, or a platform without
``forkserver``, are spawned (``spawn``, as under ``torchrun``).
The launcher watches them:

* a rank that raises reports ``rank R: <exception>`` through a queue and
  exits non-zero; the parent then terminates every other rank and raises
  :class:`RuntimeFailure` naming the root cause;
* a rank that dies without a word (a signal, the kernel's out-of-memory
  killer's SIGKILL, ``os._exit``) is the root cause whenever it happens, even
  when its peers' reports ("connection closed by peer") reach the launcher
  first: the message names the dead rank, its pid and its signal or exit
  code (with SIGKILL, whether the kernel's out-of-memory killer ran
  meanwhile, from ``/proc/vmstat``), then the peers that saw it die. Peers
  that only lost a connection make the launcher wait until it sees which
  rank died, not a fixed time;
* waits inside the ranks are bounded by the process-group timeout
  (``RunOptions.timeout_s``): a peer that stops answering turns into an
  exception within it, never a hang. Which rank hung is decided from
  *heartbeats*, not from the order reports arrive in: every rank runs a
  thread that, twice a second, sends where its main thread is (the
  innermost frame), whether that is a communication wait (graphpipe's
  ``comm.py`` or ``torch.distributed``) and since when it has not moved (its
  progress stamp). When peers time out, the launcher waits until every rank
  still waiting on a peer has reported its own timeout (bounded by the
  timeout), then names the silent rank that is *not* waiting on anyone:
  stuck in place (no progress, or no heartbeat at all) it "stopped
  answering"; still moving, it is slow, not hung (a loaded host: raise
  ``--timeout``).

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
import multiprocessing.util as mp_util
import os
import queue as queue_mod
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from typing import Sequence

from graphpipe.errors import GraphpipeError, InputError
from graphpipe.files import pid_alive
from graphpipe.progress import Progress, set_step_hook
from graphpipe.runtime.memory import RANK_MEMORY_BYTES, available_memory
from graphpipe.runtime.options import RunOptions
from graphpipe.runtime.results import RunResult

__all__ = ["RuntimeFailure", "launch", "free_port", "host_rank_limit", "check_host_capacity"]

log = logging.getLogger(__name__)

# After the first failure, wait this long for earlier-stamped reports from other ranks.
_GRACE_S = 1.0
# A CPU time-shared by more than 8 ranks makes gloo's timeouts fire before the work does.
RANKS_PER_CPU = 8
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PROGRESS_S = 10.0  # -v: a line this often while the ranks work
_BEAT_S = 0.5  # a rank's heartbeat period
# A rank whose heartbeat is older than this many periods is frozen (stopped, or holding the GIL in C code).
_STALE_BEATS = 6
# After a connection loss, how long to wait to see which rank died before naming the first report instead.
_LOSS_WAIT_S = 10.0


class RuntimeFailure(GraphpipeError):
    """A rank of a real run failed; the message names the rank and its exception (or its signal).

    ``out_of_memory``: a rank ran out of memory (``MemoryError``, or a SIGKILL
    while the kernel's out-of-memory killer ran): the command exits 2, as for
    any input too large for the host. ``refused``: a rank refused its part
    (a stage ``--compile`` cannot compile, a step shape the model cannot take): it exits 2 too, an input to change.
    """

    def __init__(self, message: str, out_of_memory: bool = False, refused: bool = False):
        super().__init__(message)
        self.out_of_memory = out_of_memory
        self.refused = refused


def free_port() -> int:
    """A free TCP port on the loopback interface (bound and released; the OS does not reuse it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_rank_limit() -> tuple[int, str]:
    """How many ranks this host can start, and why: min(8 per usable CPU, available memory / 400 MiB)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit, why = RANKS_PER_CPU * cpus, f"{RANKS_PER_CPU} per CPU on {cpus} CPU(s)"
    available = available_memory()
    if available is not None and available // RANK_MEMORY_BYTES < limit:
        limit = max(1, int(available // RANK_MEMORY_BYTES))
        why = f"about {RANK_MEMORY_BYTES // 2**20} MiB each in {available / 2**30:.1f} GiB of available memory"
    return limit, why


def check_host_capacity(world_size: int) -> None:
    """Refuse (one line, exit 2) a run of more ranks than :func:`host_rank_limit` allows."""
    limit, why = host_rank_limit()
    if world_size > limit:
        raise InputError(f"the run needs {world_size} ranks (one per device of the plan) but this host can start "
                         f"at most {limit} ({why}); plan for fewer devices (graphpipe plan -n {limit}) "
                         "or run under torchrun on more hosts")


PRELOAD = ("graphpipe.runtime.worker", "torch.export", "torch._dynamo")
"""What the forkserver imports before it forks any rank: what every rank imports (torch.export pulls dynamo in at a
rank's first capture)."""


def _context(jobs: Sequence[tuple[dict, RunOptions]]):
    """The rank processes' start method: ``forkserver`` preloaded with :data:`PRELOAD` for CPU ranks, else ``spawn``.

    Ranks that may use CUDA are spawned: a CUDA process must not be forked
    from one that touched CUDA, and on a GPU host start-up is a small share
    of a run anyway. ``GRAPHPIPE_START_METHOD=spawn|forkserver`` overrides
    the choice (``evals/bench_launch.py`` compares the two).
    """
    chosen = os.environ.get("GRAPHPIPE_START_METHOD", "")
    if chosen not in ("", "spawn", "forkserver"):
        raise InputError(f"GRAPHPIPE_START_METHOD={chosen!r}: use spawn or forkserver (or leave it unset)")
    if (chosen == "spawn" or "forkserver" not in mp.get_all_start_methods()
            or (not chosen and any(_may_use_cuda(options.backend) for _, options in jobs))):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _may_use_cuda(backend: str) -> bool:
    if backend == "gloo":
        return False
    import torch

    return backend == "nccl" or torch.cuda.is_available()


def _detach(parent_pid: int, forked: bool, env: dict[str, str]) -> None:
    """First thing in a rank: the launcher's environment, own process group, die with the launcher, signals on.

    The launcher blocked SIGINT/SIGTERM/SIGHUP while it started us (and the
    forkserver, started under the same mask, forks with them blocked), so
    none arrives between fork and here. A forkserver's rank is its child, not
    the launcher's; the server ends when the launcher does (its pipe to the
    launcher closes), which ends the rank in turn.
    """
    if os.environ != env:  # the forkserver's environment is the launcher's when the server started
        os.environ.clear()
        os.environ.update(env)
    if forked:
        _let_go_of_the_server()
    os.setpgid(0, 0)  # Ctrl-C at the terminal goes to the foreground group: the launcher only
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the kernel ends us when our parent dies, even by SIGKILL
    except (OSError, AttributeError):
        pass
    # the launcher died before prctl took effect (a forked rank's parent is the server, which may outlive the
    # launcher by a moment: its liveness is the launcher's own)
    if not pid_alive(parent_pid) or (not forked and os.getppid() != parent_pid):
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; it ends us with SIGTERM
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


# Frames of these files are waits on a peer: a rank blocked there is waiting, not stuck.
_WAIT_FILES = (f"{os.sep}graphpipe{os.sep}runtime{os.sep}comm.py",
               f"{os.sep}torch{os.sep}distributed{os.sep}distributed_c10d.py",
               f"{os.sep}torch{os.sep}distributed{os.sep}rendezvous.py")


def where_is(frame) -> tuple[bool, str, tuple]:
    """(waiting on a peer?, "file:function:line" of the innermost graphpipe frame, innermost position) of a
    thread's current ``frame`` (from ``sys._current_frames()``). The innermost position, in any file, is the
    progress stamp's key: it stays the same only while the thread does not move."""
    waiting, shown, key = False, "", ()
    innermost = True
    while frame is not None:
        code = frame.f_code
        if innermost:
            key = (code.co_filename, code.co_name, frame.f_lineno)
            innermost = False
        if any(part in code.co_filename for part in _WAIT_FILES):
            waiting = True
        if not shown and f"{os.sep}graphpipe{os.sep}" in code.co_filename:
            shown = f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return waiting, shown or (f"{os.path.basename(key[0])}:{key[1]}:{key[2]}" if key else "?"), key


class _Heartbeat(threading.Thread):
    """In a rank: every :data:`_BEAT_S`, send ``("beat", rank, None, (waiting, where, since), now)`` where
    ``since`` is when the main thread last moved (its progress stamp)."""

    def __init__(self, rank: int, results: mp.Queue, main_ident: int):
        super().__init__(name=f"graphpipe-heartbeat{rank}", daemon=True)
        self.rank, self.results, self.main_ident = rank, results, main_ident
        self.stopped = threading.Event()

    def run(self) -> None:
        last_key, since = None, time.time()
        while not self.stopped.wait(_BEAT_S):
            frame = sys._current_frames().get(self.main_ident)
            if frame is None:
                return
            waiting, shown, key = where_is(frame)
            del frame
            now = time.time()
            if key != last_key:
                last_key, since = key, now
            try:
                self.results.put(("beat", self.rank, None, (waiting, shown, since), now))
            except (ValueError, OSError, AssertionError):  # the queue closed: the rank is ending
                return


def _let_go_of_the_server() -> None:
    """Close a forkserver child's copy of the server's liveness pipe.

    multiprocessing hands every forked child the pipe whose end-of-file tells
    the server its launcher is gone (so the child could start processes of its
    own). While a rank holds it, a launcher killed by SIGKILL leaves the server
    running and the rank with it; closed, the server exits with the launcher and
    the kernel's parent-death signal ends the rank.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _resumed_at(jobs) -> int:
    """The step a one-job run resumes at (its checkpoint folder's newest complete step; 0 without one), so the
    count goes on from there instead of starting at 0 and jumping at the end."""
    if len(jobs) != 1 or not getattr(jobs[0][1], "checkpoint_dir", None):
        return 0
    from graphpipe.runtime.step_checkpoints import newest_complete

    found = newest_complete(jobs[0][1].checkpoint_dir, warn=lambda _: None)  # the ranks name skipped ones
    return min(found[0], jobs[0][1].steps) if found else 0


def _child(rank: int, world_size: int, jobs, init_method: str, results: mp.Queue, parent_pid: int,
           forked: bool, env: dict[str, str], shipped: dict) -> None:
    _detach(parent_pid, forked, env)
    beat = _Heartbeat(rank, results, threading.main_thread().ident)
    beat.start()
    try:
        from graphpipe.runtime.runnable import adopt_shipments
        from graphpipe.runtime.worker import run_rank

        adopt_shipments(shipped)

        if rank == 0:  # rank 0's steps are the run's: each one moves the launcher's bar
            set_step_hook(lambda: results.put(("step", rank, None, None, time.time())))

        def done(index: int, result: RunResult | None) -> None:
            if rank == 0:  # as its JSON object: the launcher rebuilds the record (RunResult.from_dict)
                results.put(("job", rank, index, None if result is None else result.to_dict(), time.time()))

        run_rank(rank, world_size, jobs, init_method, done)
        beat.stopped.set()
        results.put(("done", rank, None, None, time.time()))
        _leave(results, 0)
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        stamp = time.time()
        beat.stopped.set()
        where = _where(exc)
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()
        message = " ".join(line.strip() for line in text[:6]) + where
        try:
            results.put(("error", rank, None, message, stamp))
        finally:
            _leave(results, 1)


def _leave(results: mp.Queue, code: int) -> None:
    """End the rank once its last report is through the queue, skipping the interpreter's finalisation.

    A finished rank has nothing left to tear down (its groups are destroyed,
    its files written and closed), but finalising an interpreter that
    imported torch, dynamo and export takes most of a second of CPU per
    rank, which on a small host is a good share of a short run. A failing
    rank must not finalise either: a gloo thread could abort it in a
    destructor and turn its report into a signal.

    multiprocessing's own exit finalizers do run, though: a rank started by
    spawn or the forkserver creates *named* semaphores (tqdm's lock, built
    whenever fx's interpreter runs, is one), registered with the launcher's
    resource tracker, and skipping their unlink makes the launcher's exit
    report them as leaked.
    """
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        results.close()
        results.join_thread()
        mp_util._run_finalizers(0)  # unlinks this rank's named semaphores (exit priority 0 and above only)
    finally:
        os._exit(code)


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the frame that raised; where it is an op of a captured graph (fx's generated code,
    whose frame names no file), that graph's line: the op and its arguments say more than torch's ``_ops.py``."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    for frame in reversed(frames):
        if frame.filename.startswith("<eval_with_key>") and frame.line:
            code = frame.line.split(";")[0].strip()
            return f" (at the captured graph's {code[:157] + '...' if len(code) > 160 else code})"
    return f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


def _quiet_resource_tracker() -> None:
    """A rank killed after a failure leaves the semaphores of its queues behind; multiprocessing's resource
    tracker (a process of its own, started with this interpreter's ``-W`` options) then prints a warning after
    our one-line error. It cleans them up either way, so the warning is silenced."""
    option = "ignore:resource_tracker:UserWarning"
    if option not in sys.warnoptions:
        sys.warnoptions.append(option)
        warnings.filterwarnings("ignore", message="resource_tracker", category=UserWarning)


def _shipments(jobs: Sequence[tuple[dict, RunOptions]]) -> dict:
    """The jobs' models as this process captured them (its preflight), for the ranks to rebuild rather than
    export again (:mod:`graphpipe.runtime.shipping`); empty where nothing is captured here, or with
    ``GRAPHPIPE_SHIP_CAPTURE=off`` (every rank captures, as under ``torchrun``: ``evals/bench_launch.py``)."""
    from graphpipe.runtime.runnable import shipments

    chosen = os.environ.get("GRAPHPIPE_SHIP_CAPTURE", "")
    if chosen not in ("", "on", "off"):
        raise InputError(f"GRAPHPIPE_SHIP_CAPTURE={chosen!r}: use on or off (or leave it unset)")
    if chosen == "off":
        return {}

    return shipments([(doc["model"], options.seed, (doc.get("search") or {}).get("granularity"), options.precision)
                      for doc, options in jobs])


def launch(jobs: Sequence[tuple[dict, RunOptions]], world_size: int) -> list[RunResult | None]:
    """Run ``jobs`` (plan documents with options) on ``world_size`` fresh processes; rank 0's
    :class:`~graphpipe.runtime.results.RunResult` per job.

    Raises :class:`RuntimeFailure` when any rank fails.
    """
    if not jobs:
        return []
    check_host_capacity(world_size)
    _quiet_resource_tracker()
    ctx = _context(jobs)
    results: mp.Queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ)
    shipped = _shipments(jobs)
    procs: list = []
    watch = _Watch(procs, max(options.timeout_s for _, options in jobs), any(options.compile for _, options in jobs))
    job_results: dict[int, dict | None] = {}
    bar: Progress | None = None
    try:
        # Signals wait while the ranks start (they inherit the mask, from the forkserver
        # started under it, and unblock it in _detach); a Ctrl-C here arrives right after,
        # inside this try.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            forked = ctx.get_start_method() == "forkserver"
            procs.extend(ctx.Process(target=_child, args=(r, world_size, list(jobs), init_method, results, os.getpid(),
                                                          forked, env, shipped), daemon=True, name=f"graphpipe-rank{r}")
                         for r in range(world_size))
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        log.info("started %d ranks (pids %s)", world_size, ", ".join(str(p.pid) for p in procs))
        steps_before = [sum(options.steps for _, options in jobs[:i]) for i in range(len(jobs) + 1)]
        # No line of its own for the start: a run refused at once keeps its one-line error.
        bar = Progress("run", total=steps_before[-1], unit="step", initial=_resumed_at(jobs))
        bar.update(0, postfix=f"{world_size} rank{'s' if world_size != 1 else ''} started"
                              f"{f', {len(jobs)} jobs' if len(jobs) > 1 else ''}")
        began = last_note = time.monotonic()
        while len(watch.finished) < world_size:
            try:
                message = results.get(timeout=0.1)
            except queue_mod.Empty:
                message = None
            while message is not None:  # everything that has arrived, before looking at the processes
                kind, rank, index, payload, stamp = message
                if kind == "step":
                    bar.update()
                elif kind == "job":
                    job_results[index] = None if payload is None else RunResult.from_dict(payload)
                    bar.update(max(0, steps_before[index + 1] - bar.done))  # a loop that reports no steps
                    log.info("job %d of %d finished", index + 1, len(jobs))
                else:
                    watch.note(kind, rank, payload, stamp)
                try:
                    message = results.get_nowait()
                except queue_mod.Empty:
                    message = None
            watch.look()
            if time.monotonic() - last_note > _PROGRESS_S:
                last_note = time.monotonic()
                log.info("%.0f s: %d of %d jobs done, %d of %d ranks finished", last_note - began, len(job_results),
                         len(jobs), len(watch.finished), world_size)
            failure = watch.verdict()
            if failure is not None:
                raise failure
        bar.close()
    finally:
        if bar is not None:
            bar.close(quiet=True)  # a failure's one line follows, not a last count
        if not watch.failed:  # normal end: let every rank exit on its own (killing one mid-exit leaks its semaphores)
            for p in procs:
                if p.pid is not None:
                    p.join(timeout=30 if len(watch.finished) == world_size else 0.5)
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
# gloo's and the TCP store's words for a peer that went away (its process ended or closed its process group; the
# store lives in rank 0): an effect, never a cause.
_LOST = re.compile(r"connection (?:closed|reset) by peer|connection refused|broken pipe|socket closed|"
                   r"connection was likely closed|failed to recv, got 0 bytes", re.I)


def _oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills (``oom_kill`` in /proc/vmstat, Linux 4.13+); None if unknown."""
    try:
        with open("/proc/vmstat", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class _Watch:
    """What the launcher knows of each rank, and when that is enough to name the root cause of a failure.

    Reports (``error``, ``done``, ``beat``) come through the queue; deaths are
    seen on the processes themselves. :meth:`verdict` decides on events, not
    arrival order: a rank that died without a word is the cause as soon as it
    is seen; peers that only lost a connection wait for that death to be
    seen; peers that timed out wait until no silent rank is still waiting on
    a peer (each such wait ends in its own report within the timeout).
    """

    def __init__(self, procs, timeout_s: float, compiling: bool = False):
        self.procs, self.timeout_s = procs, timeout_s
        self.compiling = compiling  # --compile: a rank's first step compiles its stages, a common slow rank
        self.finished: set[int] = set()
        self.errors: dict[int, tuple[float, str]] = {}  # rank -> (stamp, message)
        self.deaths: dict[int, tuple[float, int]] = {}  # rank -> (seen at, exit code): died without a report
        self.exited_at: dict[int, float] = {}  # rank -> when a non-zero exit without a report was first seen
        self.beats: dict[int, tuple[bool, str, float, float]] = {}  # rank -> (waiting, where, since, beat time)
        self.at_first: dict[int, tuple[tuple, float]] = {}  # rank -> (beat, wall time) when the first error came
        self.first_at: float | None = None  # monotonic time of the first failure seen
        self.oom_before = _oom_kills()
        self.failed = False

    def note(self, kind: str, rank: int, payload, stamp: float) -> None:
        if kind == "done":
            self.finished.add(rank)
        elif kind == "beat":
            waiting, where, since = payload
            self.beats[rank] = (waiting, where, since, stamp)
        elif kind == "error" and rank not in self.errors:
            if not self.errors:  # where everyone was when the first failure came: a rank that then lost its
                self.at_first = {r: (b, time.time()) for r, b in self.beats.items()}  # link is judged by this
            self.errors[rank] = (stamp, payload)
            self.deaths.pop(rank, None)  # its report arrived after its exit: it did say why
            self.first_at = self.first_at or time.monotonic()

    def look(self) -> None:
        """Record ranks that exited non-zero without a report: at once for a signal (no Python ran, no report
        can come), after :data:`_GRACE_S` for an exit code (its report may still be in the queue)."""
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            code = p.exitcode
            if code is None or code == 0 or r in self.finished or r in self.errors or r in self.deaths:
                continue
            seen = self.exited_at.setdefault(r, now)
            self.first_at = self.first_at or now
            if code < 0 or now - seen > _GRACE_S:
                self.deaths[r] = (time.time(), code)

    def verdict(self) -> RuntimeFailure | None:
        """The failure to raise, once the picture is complete; None while the run goes on or a report is due.

        Report stamps do not order cause and effect: a rank that fails closes its process group (the
        worker's ``finally``) before its report is stamped, so its peers' "connection closed" can be stamped
        first. Reports are therefore ranked by kind: a death without a word, then a real error (neither a
        lost connection nor a timeout), then timeouts, read with the heartbeats; lost connections are only
        ever effects.
        """
        if self.first_at is None:
            return None
        waited = time.monotonic() - self.first_at
        if self.deaths:
            return self._fail(self._death_message(), self._oom_death())
        if not self.errors or waited < _GRACE_S and len(self.errors) < len(self.procs):
            return None  # another report (a cause stamped earlier) may still be on its way
        reports = sorted((st, r, m) for r, (st, m) in self.errors.items())
        causes = [e for e in reports if not (_LOST.search(e[2]) or _TIMEOUT.search(e[2]))]
        if causes:
            stamp, rank, message = causes[0]
            # a compile the inductor refuses, or input a rank refused (a step's shape): the run's input, exit 2
            return self._fail(f"rank {rank} failed: {message}", "MemoryError" in message,
                              message.startswith(("CompileError:", "InputError:")))
        if any(_TIMEOUT.search(m) for _, _, m in reports):
            silent = self._silent()
            if any(self._waiting(r) for r in silent) and waited < self.timeout_s + 2 * _GRACE_S:
                return None  # each of them times out in turn and reports: wait for that, not for a fixed time
            suspects = silent + [r for _, r, m in reports if not _TIMEOUT.search(m)]  # + those that lost a link
            if suspects:
                return self._fail(self._hang_message(suspects))
        elif waited < _LOSS_WAIT_S:
            return None  # only lost connections: a rank died (look() will see it) or failed and says so
        stamp, rank, message = reports[0]
        return self._fail(f"rank {rank} failed: {message}")

    def _fail(self, message: str, out_of_memory: bool = False, refused: bool = False) -> RuntimeFailure:
        self.failed = True
        return RuntimeFailure(message, out_of_memory, refused)

    def _silent(self) -> list[int]:
        return [r for r, p in enumerate(self.procs)
                if r not in self.errors and r not in self.finished and r not in self.deaths and p.is_alive()]

    def _state(self, r: int) -> tuple[tuple | None, float]:
        """(last heartbeat, the time it is judged at): now for a silent rank; for one that has since reported a
        lost connection, when the first error came (after that it only reacted to a peer's exit)."""
        if r in self.errors and r in self.at_first:
            return self.at_first[r]
        if r in self.errors:
            return None, time.time()
        return self.beats.get(r), time.time()

    def _fresh(self, r: int) -> bool:
        beat, when = self._state(r)
        return beat is not None and when - beat[3] < _STALE_BEATS * _BEAT_S

    def _waiting(self, r: int) -> bool:
        return self._fresh(r) and self._state(r)[0][0]

    def _oom_death(self) -> bool:
        after = _oom_kills()
        return (any(code == -signal.SIGKILL for _, code in self.deaths.values()) and self.oom_before is not None
                and after is not None and after > self.oom_before)

    def _death_message(self) -> str:
        """The ranks that died without a word (first seen first), then what their peers saw."""
        parts = []
        for r, (_, code) in sorted(self.deaths.items(), key=lambda item: item[1]):
            pid = self.procs[r].pid
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
                text = f"rank {r} (pid {pid}) was killed by {name} without a report"
                if code == -signal.SIGKILL:
                    if self._oom_death():
                        text += (" while the kernel's out-of-memory killer ran (/proc/vmstat oom_kill rose): the "
                                 "host ran out of memory; use fewer ranks or a smaller batch")
                    else:
                        text += (f"; a SIGKILL nobody sent is usually the kernel's out-of-memory killer (look for "
                                 f"'Killed process {pid}' in dmesg or journalctl -k)")
            else:
                text = f"rank {r} (pid {pid}) exited with code {code} without a report"
            parts.append(text)
        saw = sorted(self.errors.items(), key=lambda item: item[1][0])
        if saw:
            first_rank, (_, first) = saw[0]
            peers = ", ".join(str(r) for r, _ in saw)
            parts.append(f"then rank{'s' if len(saw) > 1 else ''} {peers} failed (rank {first_rank}: "
                         f"{first[:160]}{'...' if len(first) > 160 else ''})")
        return "; ".join(parts)

    def _hang_message(self, suspects: list[int]) -> str:
        """Peers timed out waiting: name the rank that is not waiting on anyone, from its heartbeats.

        ``suspects``: the silent ranks, and those that reported only a lost connection (judged by where they
        were when the first error came)."""
        errors = sorted((st, r, m) for r, (st, m) in self.errors.items() if _TIMEOUT.search(m))
        waiting = "; ".join(f"rank {r}: {m}" for _, r, m in errors[:3])
        count = f"{len(errors)} peer(s) timed out waiting"
        frozen = [r for r in suspects if not self._fresh(r)]
        working = [r for r in suspects if self._fresh(r) and not self._state(r)[0][0]]
        # Not moving for half the timeout: the peers waited a whole timeout for it, so a hung rank has been in
        # place about that long, while a slow one moves (each call of Python code is a new position).
        age = {r: self._state(r)[1] - self._state(r)[0][2] for r in working}
        stuck = [r for r in working if age[r] >= self.timeout_s / 2]
        moving = sorted(r for r in working if r not in stuck)
        silent = [r for r in suspects if r not in self.errors]
        if frozen and silent:
            frozen = [r for r in frozen if r in silent]  # a rank that reported is not frozen, it just ended
        if frozen or stuck:
            hung = sorted(frozen + stuck, key=lambda r: self.beats[r][2] if r in self.beats else -1.0)
            details = []
            for r in hung:
                if r in frozen:
                    beat = self.beats.get(r)
                    details.append(f"rank {r}: no heartbeat" + (f" since {time.time() - beat[3]:.0f} s, last at "
                                                                f"{beat[1]}" if beat else " at all"))
                else:
                    details.append(f"rank {r}: at {self._state(r)[0][1]} for {age[r]:.0f} s, not waiting on any "
                                   "peer")
            ranks = ", ".join(map(str, hung))
            return (f"rank{'s' if len(hung) > 1 else ''} {ranks} stopped answering ({'; '.join(details)}) while "
                    f"{count}: {waiting}")
        if moving:
            ranks = ", ".join(map(str, moving))
            where = "; ".join(f"rank {r} at {self._state(r)[0][1]}" for r in moving)
            return (f"rank{'s' if len(moving) > 1 else ''} {ranks} did not answer within the {self.timeout_s:g} s "
                    f"timeout but {'were' if len(moving) > 1 else 'was'} still working ({where}): slow, not hung "
                    f"(a loaded host?{' compiling its stages in its first step?' if self.compiling else ''}); "
                    f"raise --timeout. Meanwhile {count}: {waiting}")
        named = sorted({int(r) for _, _, m in errors for r in _PEER.findall(m)} & set(silent))
        hung = named or silent or suspects
        ranks = ", ".join(map(str, hung))
        return (f"rank{'s' if len(hung) > 1 else ''} {ranks} stopped answering (still running, waiting too, when "
                f"{count}): {waiting}")
