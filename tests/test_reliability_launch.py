"""Issue 35, items 2 and 3: the launcher's verdict comes from events and heartbeats, not arrival order.

:class:`graphpipe.runtime.launch._Watch` is fed the reports a real run
produces, in every order they can arrive, with stand-in processes: the root
cause it names must be the same for each order. (The end-to-end runs, a
``kill -9`` and a hang, are in ``test_reliability_runs.py``.)
"""

from __future__ import annotations

import itertools
import signal
import time

import pytest

from graphpipe.runtime.launch import _Watch, where_is

LOST = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234 "
        "(at comm.py:128)")
TIMEOUT_NAMED = "TimeoutError: no message activation 0F0->1F0 (x) from rank 0 within 5 s (peer silent or dead)"
TIMEOUT_ANON = ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
                "operation to complete (at distributed_c10d.py:6371)")


class Proc:
    """Stands in for a ``multiprocessing.Process``: what the watch reads of one."""

    def __init__(self, pid: int):
        self.pid, self.exitcode = pid, None

    def is_alive(self) -> bool:
        return self.exitcode is None


def _watch(n: int, timeout_s: float = 5.0) -> _Watch:
    return _Watch([Proc(1000 + r) for r in range(n)], timeout_s)


@pytest.mark.parametrize("order", list(itertools.permutations(["peer0", "peer2", "death"])))
def test_a_killed_rank_is_named_whichever_report_arrives_first(order):
    """Rank 1 is SIGKILLed; ranks 0 and 2 lose their connections to it. In every arrival order the verdict is
    rank 1 and its signal, never a peer's 'connection closed'."""
    watch = _watch(3)
    verdicts = []
    for event in order:
        if event == "death":
            watch.procs[1].exitcode = -signal.SIGKILL
        else:
            watch.note("error", int(event[-1]), LOST, time.time())
        watch.look()
        verdicts.append(watch.verdict())
    assert all(v is None for v in verdicts[:order.index("death")]), verdicts  # a lost connection waits for its cause
    final = verdicts[order.index("death")]
    assert final is not None
    assert str(final).startswith("rank 1 (pid 1001) was killed by SIGKILL without a report"), final
    assert "out-of-memory killer" in str(final)


def test_a_rank_that_exits_with_a_code_and_no_report_is_named_after_the_grace(monkeypatch):
    watch = _watch(2)
    watch.note("error", 0, LOST, time.time())
    watch.procs[1].exitcode = 3
    watch.look()
    assert watch.verdict() is None  # its report may still be in the queue
    watch.exited_at[1] -= 10  # the grace has passed
    watch.look()
    assert str(watch.verdict()).startswith("rank 1 (pid 1001) exited with code 3 without a report; then rank 0 failed")


def test_a_timeout_then_lost_connections_names_the_rank_the_timeout_waited_for():
    """Rank 2 times out waiting on rank 0 (stuck in its forward), then closes its process group before its own
    report is stamped: rank 1 and idle rank 3 report "connection closed" stamped *earlier*. The verdict is still
    rank 0, from the heartbeats, and never a lost connection."""
    watch = _watch(4)
    _beat(watch, 0, False, "executor.py:_forward:336", still_for=6.0)
    for r in (1, 2, 3):
        _beat(watch, r, True, "comm.py:wait_work:124", still_for=5.0)
    now = time.time()
    watch.note("error", 1, LOST, now - 0.2)
    watch.note("error", 3, LOST, now - 0.1)
    watch.note("error", 2, TIMEOUT_NAMED.replace("from rank 0", "from rank 0"), now)
    _later(watch, 1.5)
    verdict = str(watch.verdict())
    assert verdict.startswith("rank 0 stopped answering (rank 0: at executor.py:_forward:336 for 6 s"), verdict
    assert "1 peer(s) timed out waiting: rank 2: TimeoutError" in verdict


def test_a_real_error_is_the_cause_even_when_stamped_after_its_effects():
    watch = _watch(3)
    now = time.time()
    watch.note("error", 0, LOST, now - 0.3)
    watch.note("error", 2, TIMEOUT_ANON, now - 0.2)
    watch.note("error", 1, "InjectedFailure: injected failure at action 1F0 (at executor.py:272)", now)
    _later(watch, 1.5)
    assert str(watch.verdict()) == "rank 1 failed: InjectedFailure: injected failure at action 1F0 (at executor.py:272)"


def test_a_report_that_follows_the_exit_is_used():
    """A rank that raised reports, then exits 1: seen exiting first, its own message is the verdict."""
    watch = _watch(2)
    watch.procs[1].exitcode = 1
    watch.look()
    watch.note("error", 1, "ValueError: bad shape (at executor.py:10)", time.time() - 0.5)
    watch.first_at -= 5
    assert str(watch.verdict()) == "rank 1 failed: ValueError: bad shape (at executor.py:10)"


def _later(watch: _Watch, seconds: float) -> None:
    """As if ``seconds`` had passed since the first failure (the watch's clock for its grace and timeout)."""
    watch.first_at -= seconds


def _beat(watch: _Watch, rank: int, waiting: bool, where: str, still_for: float, age: float = 0.0) -> None:
    now = time.time()
    watch.note("beat", rank, (waiting, where, now - still_for), now - age)


@pytest.mark.parametrize("order", list(itertools.permutations([1, 2, 3])))
def test_the_hung_rank_is_named_from_heartbeats_in_every_order(order):
    """Rank 0 sits in its forward (not waiting); ranks 1-3 wait on peers and time out one after the other, in any
    order. Until the last waiting rank has reported there is no verdict; then it is rank 0."""
    watch = _watch(4)
    _beat(watch, 0, False, "executor.py:_forward:336", still_for=6.0)
    for r in (1, 2, 3):
        _beat(watch, r, True, "comm.py:wait_work:124", still_for=5.0)
    verdicts = []
    for r in order:
        watch.note("error", r, TIMEOUT_NAMED if r == 1 else TIMEOUT_ANON, time.time())
        _later(watch, 1.5)  # past the grace for reports on their way, well within the timeout
        verdicts.append(watch.verdict())
    assert verdicts[:2] == [None, None], verdicts
    assert str(verdicts[2]).startswith("rank 0 stopped answering (rank 0: at executor.py:_forward:336 for 6 s, "
                                       "not waiting on any peer) while 3 peer(s) timed out waiting"), verdicts[2]


def test_a_rank_still_moving_is_slow_not_hung():
    """The idle rank timed out at the first barrier while rank 0 was still setting up and moving: the verdict
    says slow, and which flag to raise."""
    watch = _watch(2)
    _beat(watch, 0, False, "jobs.py:load_runnable:250", still_for=0.1)
    watch.note("error", 1, TIMEOUT_ANON, time.time())
    assert watch.verdict() is None  # within the grace: a cause may still be on its way
    _later(watch, 1.5)
    verdict = str(watch.verdict())
    assert verdict.startswith("rank 0 did not answer within the 5 s timeout but was still working "
                              "(rank 0 at jobs.py:load_runnable:250): slow, not hung"), verdict
    assert "raise --timeout" in verdict and "stopped answering" not in verdict


def test_a_rank_without_heartbeats_is_frozen():
    watch = _watch(2)
    _beat(watch, 0, False, "executor.py:_forward:336", still_for=1.0, age=30.0)
    watch.note("error", 1, TIMEOUT_ANON, time.time())
    _later(watch, 1.5)
    assert str(watch.verdict()).startswith("rank 0 stopped answering (rank 0: no heartbeat since 30 s, last at "
                                           "executor.py:_forward:336)")


def test_where_is_tells_a_wait_from_work():
    """The heartbeat's classification of a real stack: this test's own frame is work, not a wait."""
    import sys

    waiting, shown, key = where_is(sys._getframe())
    assert not waiting and key[1] == "test_where_is_tells_a_wait_from_work"


def test_a_lost_store_connection_is_an_effect_of_the_rank_that_timed_out():
    """Rank 0 (host of the TCP store) times out during set-up waiting for rank 2, still capturing the model, and
    exits; rank 1 then loses the store ("Connection was likely closed"). The verdict is rank 2, slow; never
    rank 1's DistNetworkError."""
    watch = _watch(3)
    _beat(watch, 1, True, "distributed_c10d.py:init_process_group:1700", still_for=5.0)
    _beat(watch, 2, False, "exporting.py:export_model:347", still_for=0.05)
    now = time.time()
    watch.note("error", 1, "DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the "
                           "remote server shutdown or crash? (at distributed_c10d.py:669)", now - 0.1)
    watch.note("error", 0, TIMEOUT_ANON, now)
    _later(watch, 1.5)
    verdict = str(watch.verdict())
    assert verdict.startswith("rank 2 did not answer within the 5 s timeout but was still working "
                              "(rank 2 at exporting.py:export_model:347): slow, not hung"), verdict


def test_a_failing_op_of_a_captured_graph_is_named_by_its_graph_line_not_torchs():
    """A rank whose captured graph fails inside an aten op reports that op's line of the graph (its node and
    arguments), not torch's ``_ops.py``; an error elsewhere keeps its file and line."""
    import torch
    import torch.fx as fx

    from graphpipe.runtime.launch import _where

    g = fx.Graph()
    x, i = g.placeholder("x"), g.placeholder("i")
    g.output(g.call_function(torch.ops.aten.index.Tensor, (x, [i])))
    gm = fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(IndexError) as err:
        gm(torch.zeros(3), torch.tensor([7]))
    assert _where(err.value) == " (at the captured graph's index_tensor = torch.ops.aten.index.Tensor(x, [i]))"
    with pytest.raises(ValueError) as err:
        raise ValueError("bad")
    assert _where(err.value).startswith(" (at test_reliability_launch.py:")
