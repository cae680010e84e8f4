"""Shared fixtures: small op graphs with known structure (the oracles' inputs).

Every builder returns an :class:`OpGraph` with simple affine costs so that
oracles (brute force, closed-form bubbles) are easy to compute.
"""

from __future__ import annotations

import os
import random

import pytest

from graphpipe.cluster import preset
from graphpipe.graph import Affine, Op, OpGraph

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
PROFILES_DIR = os.path.join(DATA, "pipedream-profiles")
ZOO_SMALL = ["mmt:small", "dlrm:small", "candle-uno:small", "transformer:small", "twobranch:small"]
PROFILE_NAMES = ("alexnet", "gnmt", "inception_v3", "nasnetamobile", "resnet18", "resnet50", "vgg16")


def pytest_configure(config) -> None:
    """The captured-graph cache (graphpipe.frontend.graph_cache) in a folder of this session's own, shared with the
    subprocesses it starts and, under pytest-xdist, with the workers (started after this ran in the controller,
    they inherit its folder; writes are atomic): tests never read or fill the user's ~/.cache, and repeat
    captures are still saved once for all."""
    import tempfile

    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("GRAPHPIPE_TEST_CACHE"):
        config._graphpipe_cache = None  # the controller's folder; the controller removes it
        os.environ["GRAPHPIPE_CACHE_DIR"] = os.environ["GRAPHPIPE_TEST_CACHE"]
    else:
        config._graphpipe_cache = tempfile.mkdtemp(prefix="graphpipe-test-cache-")
        os.environ["GRAPHPIPE_CACHE_DIR"] = os.environ["GRAPHPIPE_TEST_CACHE"] = config._graphpipe_cache
    # Progress lines depend on how long work takes (a capture over 2 s on a loaded host says so): off, so the
    # one-line errors tests read stay one line. tests/test_progress.py turns it on where it is the subject.
    os.environ["GRAPHPIPE_PROGRESS"] = "off"
    # Tests that bring a process group up in this process must not leave it alive at its exit, where a gloo
    # group's threads can abort the interpreter (graphpipe.runtime.teardown): bind torch's defaults now.
    from graphpipe.runtime.teardown import before_init

    before_init()


def pytest_collection_modifyitems(config, items) -> None:
    """Modules holding a ``slow`` test (multi-rank runs, whole-model captures) first, each kept whole.

    ``make test`` hands modules to its workers one at a time (pytest-xdist's ``loadscope``: a module's
    fixtures, such as test_evals' quick run of every experiment, run once); a long module handed out last
    would leave the other workers idle while it runs."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None
            and getattr(item, "module", None) is not None}
    first = [item for item in items if getattr(item, "module", None) is not None and item.module.__name__ in slow]
    if first:
        chosen = set(map(id, first))
        items[:] = first + [item for item in items if id(item) not in chosen]


def pytest_unconfigure(config) -> None:
    import shutil

    if getattr(config, "_graphpipe_cache", None):
        shutil.rmtree(config._graphpipe_cache, ignore_errors=True)


def make_op(name: str, fwd: float = 1e-3, bwd: float | None = None, alpha: float = 0.0,
            params: float = 4e6, act: float = 1e5, out: float = 1e4, kind: str = "layer") -> Op:
    """An op whose per-sample forward time is ``fwd`` s and backward ``bwd`` (default 2x)."""
    bwd = 2 * fwd if bwd is None else bwd
    return Op(name, kind, Affine(alpha, fwd), Affine(2 * alpha, bwd), params, act, out)


def chain_graph(n: int = 4, fwd: float = 1e-3, name: str = "chain") -> OpGraph:
    ops = [make_op(f"l{i}", fwd) for i in range(n)]
    return OpGraph.build(name, ops, [(f"l{i}", f"l{i + 1}", 1e4) for i in range(n - 1)])


def branches_graph(k: int = 2, depth: int = 2, fwd: float = 1e-3, name: str | None = None) -> OpGraph:
    """in -> k branches of ``depth`` ops -> out (k=2, depth=1 is the diamond)."""
    ops = [make_op("in", fwd)]
    edges = []
    for b in range(k):
        prev = "in"
        for j in range(depth):
            op = f"b{b}_{j}"
            ops.append(make_op(op, fwd))
            edges.append((prev, op, 1e4))
            prev = op
        edges.append((prev, "out", 1e4))
    ops.append(make_op("out", fwd))
    return OpGraph.build(name or f"branches{k}x{depth}", ops, edges)


def nested_sp_graph() -> OpGraph:
    """s -> (a -> (c | d) -> e) | b -> t : a parallel inside a series inside a parallel."""
    names = ["s", "a", "c", "d", "e", "b", "t"]
    ops = [make_op(n, 1e-3 * (1 + i % 3)) for i, n in enumerate(names)]
    edges = [("s", "a", 1e4), ("a", "c", 1e4), ("a", "d", 1e4), ("c", "e", 1e4), ("d", "e", 1e4),
             ("e", "t", 1e4), ("s", "b", 1e4), ("b", "t", 1e4)]
    return OpGraph.build("nested", ops, edges)


def non_sp_graph() -> OpGraph:
    """The 'N' graph (a->c, a->d, b->d) plus terminals: the smallest non-SP pattern."""
    names = ["s", "a", "b", "c", "d", "t"]
    ops = [make_op(n) for n in names]
    edges = [("s", "a", 1e4), ("s", "b", 1e4), ("a", "c", 1e4), ("a", "d", 1e4), ("b", "d", 1e4),
             ("c", "t", 1e4), ("d", "t", 1e4)]
    return OpGraph.build("non_sp", ops, edges)


def random_sp_graph(num_ops: int, seed: int) -> OpGraph:
    """A random two-terminal SP DAG with exactly ``num_ops`` ops (>= 2), random costs."""
    rng = random.Random(seed)

    def build(n: int, prefix: str):
        # returns (ops list, edges, entry names, exit names)
        if n == 1:
            return [prefix], [], [prefix], [prefix]
        if n >= 2 and (n < 3 or rng.random() < 0.5):
            k = rng.randint(1, n - 1)
            a = build(k, prefix + "a")
            b = build(n - k, prefix + "b")
            edges = a[1] + b[1] + [(x, y, 1e4 * rng.randint(1, 4)) for x in a[3] for y in b[2]]
            return a[0] + b[0], edges, a[2], b[3]
        k = rng.randint(1, n - 1)
        a = build(k, prefix + "p")
        b = build(n - k, prefix + "q")
        return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]

    names, edges, _, _ = build(num_ops, "n")
    ops = [make_op(n, fwd=1e-3 * rng.randint(1, 5), params=4e6 * rng.randint(0, 3)) for n in names]
    return OpGraph.build(f"random_sp{num_ops}_{seed}", ops, edges)


@pytest.fixture
def chain():
    return chain_graph()


@pytest.fixture
def diamond():
    return branches_graph(2, 1, name="diamond")


@pytest.fixture
def four_branch():
    return branches_graph(4, 2)


@pytest.fixture
def nested_sp():
    return nested_sp_graph()


@pytest.fixture
def non_sp():
    return non_sp_graph()


@pytest.fixture
def v100_8():
    return preset("v100", 8)


@pytest.fixture
def profiles_dir():
    """The real PipeDream profiles shipped in the repository's data/ folder."""
    return PROFILES_DIR


@pytest.fixture
def one_thread():
    """Tiny models and ops run faster and steadier on one intra-op thread (shared CI cores).

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``; torch is
    imported here lazily so planning-only tests never need it.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
