"""The SP DP with its nested chains in numpy (graphpipe.search.gpp_nested) against the general DP it replaces:
equal tables at every target it is asked, equal stages at every feasible bound, on random SP graphs holding
long chains (inside a branch, and after a branch) and on a small T5's captured graph."""

from __future__ import annotations

import os
import random

import pytest

from conftest import make_op
from graphpipe.cluster import preset
from graphpipe.graph import OpGraph
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_dp import INF, BottleneckDP
from graphpipe.search import gpp_nested
from graphpipe.search.gpp_nested import _MIN_CHAIN, NestedChainDP
from graphpipe.search.gpp_solve import make_dp
from graphpipe.search.gpp_tree import build_tree
from graphpipe.sp import make_series_parallel
from test_gpp import BATCH, SLOW_LINK, _tight
from test_gpp_chain import probe_targets

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nested_chains_graph(seed: int) -> OpGraph:
    """in -> (a long chain | a short chain [| a branch whose tail is a long chain]) -> join -> a long chain.

    The long chains are the nodes the fast path takes: a whole series node inside a parallel one, the op
    suffix of a series node that starts with a parallel node (the root, like T5's decoder), and with the
    third branch the op suffix of a series node inside a parallel one."""
    rng = random.Random(seed)
    names, edges = ["in"], []

    def chain(prefix: str, length: int, start: str) -> str:
        prev = start
        for i in range(length):
            names.append(f"{prefix}{i}")
            edges.append((prev, names[-1], 1e4 * rng.randint(1, 4)))
            prev = names[-1]
        return prev

    ends = [chain("enc", rng.randint(_MIN_CHAIN + 1, 20), "in"), chain("emb", rng.randint(1, 3), "in")]
    if rng.random() < 0.5:
        split = chain("x", 1, "in")
        tails = [chain("xa", 1, split), chain("xb", 2, split)]
        names.append("xj")
        edges += [(t, "xj", 1e4) for t in tails]
        ends.append(chain("xt", rng.randint(_MIN_CHAIN + 1, 16), "xj"))
    names.append("join")
    edges += [(e, "join", 1e4 * rng.randint(1, 4)) for e in ends]
    chain("dec", rng.randint(_MIN_CHAIN + 1, 24), "join")
    ops = [make_op(n, fwd=1e-3 * rng.randint(1, 5), params=4e6 * rng.randint(0, 3)) for n in names]
    return OpGraph.build(f"nested_chains_{seed}", ops, edges)


def _same_dp(tree, cluster, batch, mb, link, recompute, rng, num_targets=12) -> int:
    """Both DPs on one tree: equal tables at sampled targets, at those just above the optimum (where the
    search probes most) and at the largest; equal stages at every feasible bound. Returns the bounds checked."""
    blocks = BlockCosts(tree, cluster, batch, mb, recompute=recompute)
    general = BottleneckDP(tree, cluster, batch, mb, link=link, blocks=blocks)
    fast = NestedChainDP(tree, cluster, batch, mb, link=link, blocks=blocks)
    assert fast.chains, "the graph holds no chain the fast path takes"
    checked = 0
    for t in probe_targets(general, num_targets, rng):
        want, got = general.solve(t), fast.solve(t)
        assert (got.devices, got.stages, got.breakpoints) == (want.devices, want.stages, want.breakpoints), t
        for v, d in enumerate(want.devices):
            if d < INF:
                stages = fast.extract(v)
                assert stages == general.extract(v), (t, v)
                assert sum(s.num_devices for s in stages) == d and len(stages) == got.stages[v]
                checked += 1
    return checked


@pytest.mark.parametrize("link", [None, SLOW_LINK], ids=["free", "slow-link"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_nested_chain_dp_equals_the_general_dp_on_random_graphs(link, recompute):
    rng = random.Random(7)
    checked = 0
    for seed in range(6):
        graph = _nested_chains_graph(seed)
        tree = build_tree(graph)
        for num_devices, mb in ((8, 2), (16, 4), (32, 8)):
            cluster = preset("v100", num_devices)
            for c in (cluster, _tight(cluster, graph)):
                checked += _same_dp(tree, c, BATCH * 4, mb, link, recompute, rng)
    assert checked > 100


def test_nested_chain_dp_equals_the_general_dp_on_a_small_t5(monkeypatch):
    """A seven-layer T5-11B captured from evals/llm_configs.py: the encoder is a chain beside the decoder's
    embedding, and the decoder a chain after them, both longer than the fast path's threshold."""
    from graphpipe.models import load_model

    monkeypatch.setenv("GRAPHPIPE_LLM_LAYERS", "7")
    monkeypatch.setenv("GRAPHPIPE_CACHE_DIR", "off")
    cluster = preset("h100", 64)
    graph = load_model(os.path.join(_ROOT, "evals", "llm_configs.py") + ":t5_11b", cluster.device).graph
    tree = build_tree(make_series_parallel(graph)[0])
    assert len(NestedChainDP(tree, cluster, 256, 4).chains) == 2
    rng = random.Random(3)
    checked = sum(_same_dp(tree, c, 256, mb, None, rc, rng)
                  for c in (cluster, preset("h100", 512)) for mb in (4, 8) for rc in (False, True))
    assert checked > 50


def test_make_dp_picks_the_nested_chain_dp_for_trees_with_long_chains():
    tree = build_tree(_nested_chains_graph(0))
    dp = make_dp(tree, preset("v100", 8), BATCH, 2)
    assert isinstance(dp, NestedChainDP)
    # every chain it takes is a run of op children longer than the threshold, at the end of a series node
    for x, (start, ranges) in dp.chains.items():
        kids = tree.children[x]
        assert tree.kinds[x] == "series" and len(kids) - start == ranges.n > _MIN_CHAIN
        assert all(tree.kinds[c] == "op" for c in kids[start:])


def test_kept_solves_answer_as_a_fresh_solve_when_a_search_returns_to_a_target(monkeypatch):
    """Targets visited in a random order with returns (as a bisection and the next depth's search do): the
    tables and stages equal the general DP's at every visit, fewer chains are solved than by a DP keeping
    only its latest solve, and the DP states counted equal that DP's (a return counted as the solve it saves)."""
    rng = random.Random(11)
    tree = build_tree(_nested_chains_graph(3))
    cluster = preset("v100", 16)
    blocks = BlockCosts(tree, cluster, BATCH * 4, 4)
    general = BottleneckDP(tree, cluster, BATCH * 4, 4, blocks=blocks)
    pool = probe_targets(general, 6, rng)
    walk = [rng.choice(pool) for _ in range(40)]
    dps, solves = {}, {}
    for keep in (gpp_nested._KEEP, 1):
        monkeypatch.setattr(gpp_nested, "_KEEP", keep)
        dp = dps[keep] = NestedChainDP(tree, cluster, BATCH * 4, 4, blocks=blocks)
        real, solves[keep] = dp._solve_chain, []
        dp._solve_chain = lambda x, depths, real=real, calls=solves[keep]: calls.append(x) or real(x, depths)
    for t in walk:
        want = general.solve(t)
        for keep in sorted(dps):
            monkeypatch.setattr(gpp_nested, "_KEEP", keep)
            got = dps[keep].solve(t)
            assert (got.devices, got.stages, got.breakpoints) == (want.devices, want.stages, want.breakpoints), t
            for v, d in enumerate(want.devices):
                if d < INF:
                    assert dps[keep].extract(v) == general.extract(v), (t, v)
        assert dps[1].dp_states == dps[max(dps)].dp_states, t
    assert len(solves[max(dps)]) < len(solves[1])
