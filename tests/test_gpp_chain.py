"""The chain view's vectorised DP (graphpipe.search.gpp_chain) against the general DP, and the search helpers
that make gpp's search cheaper (first_feasible's guess, BlockCosts' leaf tables): same answers, fewer runs."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from bruteforce import brute_force_gpp
from conftest import branches_graph, chain_graph, random_sp_graph
from graphpipe.cluster import preset
from graphpipe.costs import CostArrays
from graphpipe.models import load_model
from graphpipe.search.common import comm_links
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_chain import _NONE, _STAGES, ChainDP, is_chain, packed_stage_keys
from graphpipe.search.gpp_dp import INF, BottleneckDP
from graphpipe.search.gpp_solve import first_feasible, make_dp, min_bottleneck
from graphpipe.search.gpp_tree import build_tree, chain_tree
from graphpipe.sp import make_series_parallel
from test_gpp import BATCH, SLOW_LINK, _tight

GRAPHS = ([random_sp_graph(n, seed) for n in (5, 8, 12, 16) for seed in range(3)]
          + [branches_graph(4, 3), chain_graph(12), branches_graph(3, 5)])  # equal ops: many ties


def probe_targets(dp, num_targets, rng) -> list[float]:
    """Targets to compare two DPs at: a sample, those just above the optimum (where the search probes most,
    and ties are common), and the largest."""
    targets = list(dp.candidate_targets())
    best, _ = first_feasible(dp, targets, dp.kcap)
    near = targets[best:best + num_targets] if best is not None else []
    return rng.sample(targets, min(num_targets, len(targets))) + near + targets[-1:]


def _same_dp(tree, cluster, batch, mb, link, recompute, targets_per_dp, rng):
    """Both DPs on one tree: equal tables at sampled targets and at those just above the optimum (where the
    search probes most, and ties are common), equal back-pointers in every state, equal stages at every
    feasible bound."""
    blocks = BlockCosts(tree, cluster, batch, mb, recompute=recompute)
    general = BottleneckDP(tree, cluster, batch, mb, link=link, blocks=blocks)
    chain = ChainDP(tree, cluster, batch, mb, link=link, blocks=blocks)
    checked = 0
    for t in probe_targets(chain, targets_per_dp, rng):
        want, got = general.solve(t), chain.solve(t)
        assert (got.devices, got.stages, got.breakpoints) == (want.devices, want.stages, want.breakpoints), t
        for i in range(chain.n):  # every state's back-pointer, not only those on the root's path
            state = general._series(tree.root, i, 0)
            for v, how in enumerate(state.choice):
                if how is not None:
                    j, u = (i + 1, how[1]) if how[0] == "child" else how[1:3]
                    assert chain.choice(v, i) == (j, u), (t, i, v)
        for v, d in enumerate(want.devices):
            if d < INF:
                stages = chain.extract(v)
                assert stages == general.extract(v)
                assert sum(s.num_devices for s in stages) == d and len(stages) == got.stages[v]
                checked += 1
        # a table asked up to a depth is the full table's prefix
        for depth in (0, 1, 3):
            part = chain.solve(t, depth)
            assert part.devices == want.devices[:len(part.devices)] and len(part.devices) > min(depth, chain.kcap)
    return checked


@pytest.mark.parametrize("link", [None, SLOW_LINK], ids=["free", "slow-link"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_chain_dp_equals_the_general_dp_on_random_chains(link, recompute):
    """Same tables, back-pointers and stages as BottleneckDP on the chain view of random graphs, with ample and
    tight memory (tight: some ranges hold fewer micro-batches, so depth costs devices)."""
    rng = random.Random(3)
    checked = 0
    for graph in GRAPHS:
        tree = chain_tree(graph)
        for num_devices, mb in ((2, 4), (4, 6), (5, 8)):
            ample = preset("v100", num_devices)
            for cluster in (ample, _tight(ample, graph)):
                checked += _same_dp(tree, cluster, BATCH, mb, link, recompute, 6, rng)
    assert checked > 200  # feasible bounds compared: the test compares something


def test_chain_dp_equals_the_general_dp_on_real_models():
    """The zoo's branchy models' chain views (32-34 ops, every cut costing of a 4-node cluster)."""
    rng = random.Random(5)
    cluster = preset("v100", 32)
    for spec in ("mmt", "candle-uno", "dlrm"):
        graph, _ = make_series_parallel(load_model(spec, cluster.device).graph)
        tree = chain_tree(graph)
        for link, mb in itertools.product(comm_links(cluster), (2, 16, 64)):
            assert _same_dp(tree, cluster, 512, mb, link, False, 6, rng) > 0


@pytest.mark.slow
def test_chain_dp_equals_the_general_dp_at_every_target():
    """Every candidate target of one real search (mmt's chain view, 32 V100s, micro-batch 64, cuts on the
    intra-node link): above the optimum, where the depth frontier probes, states tie on (devices, stages)
    and the tie-break (the shortest first stage) decides the back-pointer."""
    cluster = preset("v100", 32)
    graph, _ = make_series_parallel(load_model("mmt", cluster.device).graph)

    class Every:
        def sample(self, targets, k):
            return targets

    assert _same_dp(chain_tree(graph), cluster, 512, 64, comm_links(cluster)[1], False, 0, Every()) > 0


def test_chain_dp_equals_brute_force_on_small_chains():
    """The exact optimum of the SPP space on chains of <= 8 ops (brute force over every partition)."""
    for graph in [chain_graph(n) for n in (3, 5, 8)] + [random_sp_graph(8, s) for s in range(3)]:
        tree = chain_tree(graph)
        for num_devices, mb in itertools.product((1, 2, 3, 4), (4, 6)):
            cluster = preset("v100", num_devices)
            got = min_bottleneck(tree, cluster, BATCH, mb)
            want = min_bottleneck(graph, cluster, BATCH, mb) if is_chain(build_tree(graph)) else None
            if want is not None:  # on a branchless graph the SP tree is the chain: brute force is its oracle
                brute = brute_force_gpp(graph, cluster, BATCH, mb)
                assert got.bottleneck_tps == pytest.approx(brute.bottleneck_tps, rel=1e-9)
            assert got is not None and got.devices_used <= num_devices


def test_make_dp_picks_the_chain_dp_for_chains_only():
    cluster = preset("v100", 4)
    branchy = branches_graph(3, 2)
    assert isinstance(make_dp(chain_tree(branchy), cluster, BATCH, 4), ChainDP)
    assert isinstance(make_dp(build_tree(chain_graph(5)), cluster, BATCH, 4), ChainDP)  # a branchless SP tree
    assert isinstance(make_dp(build_tree(branchy), cluster, BATCH, 4), BottleneckDP)
    with pytest.raises(ValueError):
        ChainDP(build_tree(branchy), cluster, BATCH, 4)


@pytest.mark.parametrize("view", ["sp", "chain"])
def test_first_feasible_with_any_guess_finds_the_first_feasible_target(view):
    """Whatever the guess (below, at, above the answer, out of range), the index is the smallest feasible one
    (the oracle: every target solved in turn)."""
    rng = random.Random(11)
    for graph in GRAPHS[::3]:
        tree = chain_tree(graph) if view == "chain" else build_tree(graph)
        cluster = _tight(preset("v100", 4), graph)
        dp = make_dp(tree, cluster, BATCH, 4)
        targets = dp.candidate_targets()
        table = [dp.solve(float(t)) for t in targets]
        for depth in (1, 2, dp.kcap):
            truth = next((i for i, r in enumerate(table) if r.feasible(depth)), None)
            for guess in [None, 0, len(targets) - 1, len(targets) + 5] + rng.sample(range(len(targets)), 5):
                for start in (0, (truth or 0) // 2):
                    got, runs = first_feasible(dp, targets, depth, start, guess=guess)
                    assert got == truth, (guess, start, depth)
                    assert runs <= 2 * len(targets).bit_length() + 4
                    stop = (truth or len(targets)) + rng.choice([0, 1, 5])
                    got, _ = first_feasible(dp, targets, depth, start, stop=stop, guess=guess)
                    assert got == (truth if truth is not None and truth < stop else None)


def test_a_good_guess_takes_fewer_runs():
    graph = random_sp_graph(16, 2)
    dp = make_dp(chain_tree(graph), preset("v100", 8), BATCH, 4)
    targets = dp.candidate_targets()
    truth, plain = first_feasible(dp, targets, dp.kcap)
    again, guessed = first_feasible(dp, targets, dp.kcap, guess=truth)
    assert again == truth and guessed <= 2 < plain


def test_leaf_tables_equal_one_leaf_at_a_time():
    """BlockCosts computes every leaf's tables in one vectorised pass: the same numbers, bit for bit, as the
    per-node formulas (the oracle: CostArrays on the leaf's own sums and boundary edges)."""
    for graph in GRAPHS[:4] + [load_model("mmt", preset("v100", 8).device).graph]:
        graph, _ = make_series_parallel(graph)
        cluster = _tight(preset("v100", 8), graph)
        for tree, recompute, link in itertools.product((build_tree(graph), chain_tree(graph)), (False, True),
                                                      comm_links(cluster)):
            blocks = BlockCosts(tree, cluster, BATCH, 4, recompute=recompute)
            costs = CostArrays.of(tree.graph, cluster)
            r = np.array(blocks.device_counts)
            for x, kind in enumerate(tree.kinds):
                if kind != "op":
                    continue
                o = tree.op_ids[x][0]
                op = tree.graph.ops[o]
                ins = [e for e in tree.graph.edges if e.dst == o]
                outs = sum(e.bytes for e in tree.graph.edges if e.src == o)
                inputs, saved = sum(e.bytes for e in ins), sum(e.saved for e in ins)
                tps = costs.tps(op.fwd.alpha, op.fwd.beta, op.bwd.alpha, op.bwd.beta, float(op.param_bytes), r, 4,
                                BATCH, recompute)
                held = costs.max_in_flight(float(op.param_bytes), float(op.act_bytes) + saved, r, 4, blocks.kcap,
                                           inputs, outs, recompute)
                assert np.array_equal(blocks.stage_tps(x)[0, 1], tps)
                assert np.array_equal(blocks.max_in_flight(x)[0, 1], held)
                assert blocks.boundary_bytes(x)[1][0, 1] == outs
                if link is not None:
                    cut = 2 * (link.latency_s / 4 + outs / link.bandwidth_Bps) if outs > 0 else 0.0
                    assert np.allclose(blocks.stage_cost(x, link)[0, 1], np.maximum(tps, cut), rtol=1e-12)


def test_extract_refuses_a_bound_the_last_solve_did_not_reach():
    """A solve asked up to a depth fills back-pointers only that far: extracting beyond is an error, not a
    plan read from unfilled arrays."""
    dp = ChainDP(chain_tree(chain_graph(6)), preset("v100", 4), BATCH, 4)
    t = float(dp.candidate_targets()[-1])
    assert len(dp.solve(t, 0).devices) == 1
    with pytest.raises(ValueError, match="not solved"):
        dp.extract(1)
    v, stages = dp.best_at(t)  # a full solve: every bound can be extracted again
    assert dp.extract(dp.kcap) and stages


def test_packed_stage_keys_equal_their_definition_on_random_reaches():
    """need[v - 1, pair] is the key of the first device choice whose reach holds min(v, mbs) in flight (none:
    _NONE), by definition one pair and level at a time; the DPs get it clipped at a limit, times a width, plus
    each pair's end. Under a limit above every device count's key, each key survives exactly."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        pairs, choices = int(rng.integers(0, 25)), int(rng.integers(1, 11))
        top, mbs = int(rng.integers(1, 30)), int(rng.integers(1, 40))
        reach = np.maximum.accumulate(rng.integers(0, 35, (pairs, choices)), axis=1)
        ds = np.sort(rng.choice(512, choices, replace=False) + 1).astype(np.int64)
        want = np.empty((max(top - 1, 0), pairs), dtype=np.int64)
        for v in range(1, top):
            for p in range(pairs):
                c = next((c for c in range(choices) if reach[p, c] >= min(v, mbs)), None)
                want[v - 1, p] = _NONE if c is None else ds[c] * _STAGES + 1
        width = int(rng.integers(1, 60))
        j = rng.integers(0, width, pairs).astype(np.int64)
        for limit in (513 * _STAGES, int(rng.integers(1, 600)) * _STAGES):  # no key clipped; some clipped
            packed = packed_stage_keys(reach, ds, top, mbs, limit, width, j)
            assert packed.shape == want.shape and packed.dtype == np.int64
            np.testing.assert_array_equal(packed, np.minimum(want, limit) * width + j[None, :])
