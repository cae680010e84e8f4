"""ChainDP answers a target asked twice in a row from its last solve: the same table, stages and counted states
as a DP that solves it afresh (a search asks whether a target is feasible, then for its stages)."""

from __future__ import annotations

import random

from conftest import chain_graph, random_sp_graph
from graphpipe.cluster import preset
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_chain import ChainDP
from graphpipe.search.gpp_dp import INF
from graphpipe.search.gpp_tree import chain_tree
from test_gpp import BATCH


def test_a_repeated_target_equals_a_fresh_solve():
    rng = random.Random(5)
    cluster = preset("v100", 8)
    for graph in (random_sp_graph(10, 1), random_sp_graph(14, 2), chain_graph(12)):
        tree = chain_tree(graph)
        blocks = BlockCosts(tree, cluster, BATCH, 2)
        kept = ChainDP(tree, cluster, BATCH, 2, blocks=blocks)
        targets = sorted(kept.candidate_targets())
        asked = [rng.choice(targets) for _ in range(12)]
        asked = [t for t in asked for _ in range(2)] + [asked[0], None, asked[0]]  # pairs; then one between
        for t, depth in ((t, rng.choice((None, 2))) for t in asked if t is not None):
            fresh = ChainDP(tree, cluster, BATCH, 2, blocks=blocks)
            before = kept.dp_states
            got, want = kept.solve(t, depth), fresh.solve(t, depth)
            assert (got.devices, got.stages, got.breakpoints) == (want.devices, want.stages, want.breakpoints)
            assert kept.dp_states - before == fresh.dp_states
            for v, d in enumerate(want.devices):
                if d < INF:
                    assert kept.extract(v) == fresh.extract(v)
