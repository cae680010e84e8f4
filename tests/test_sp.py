"""Series-parallel decomposition: the defining properties of every tree, checked
against networkx reachability, and the SP test against a brute-force N search."""

from __future__ import annotations

import itertools
import os
import random

import networkx as nx
import pytest

from conftest import (PROFILES_DIR, branches_graph, chain_graph, make_op, nested_sp_graph, non_sp_graph,
                      random_sp_graph)
from graphpipe.graph import OpGraph
from graphpipe.importers.pipedream_txt import read_pipedream
from graphpipe.sp import SPTree, contract, decompose, is_series_parallel, make_series_parallel, num_branches


# ------------------------------------------------------------------ oracles
def reach(graph: OpGraph) -> dict[int, set[int]]:
    g = graph.to_networkx()
    return {v: nx.descendants(g, v) for v in g.nodes}


def has_induced_n(graph: OpGraph) -> bool:
    """Brute force: four ops with a<c, a<d, b<d and no other comparabilities."""
    r = reach(graph)

    def lt(x, y):
        return y in r[x]

    def inc(x, y):
        return not lt(x, y) and not lt(y, x)

    for a, b, c, d in itertools.permutations(range(graph.num_ops), 4):
        if lt(a, c) and lt(a, d) and lt(b, d) and inc(a, b) and inc(b, c) and inc(c, d):
            return True
    return False


def is_convex(graph: OpGraph, op_ids, r=None) -> bool:
    """No op outside ``op_ids`` lies on a path between two of its ops."""
    r = reach(graph) if r is None else r
    members = set(op_ids)
    below = set().union(*(r[u] for u in members))
    above = {z for z in r if r[z] & members}
    return (below & above) <= members


def check_tree(tree: SPTree) -> None:
    """Assert every defining property of an SP tree (module docstring of graphpipe.sp)."""
    graph = tree.graph
    r = reach(graph)
    nodes = tree.nodes
    assert tree.root == len(nodes) - 1
    assert sorted(nodes[tree.root].op_ids) == list(range(graph.num_ops))
    leaves = []
    child_count = {}
    for node in nodes:
        assert nodes[node.id] is node
        assert list(node.op_ids) == sorted(set(node.op_ids))
        for c in node.children:
            assert c < node.id, "children must come before parents (post-order)"
            child_count[c] = child_count.get(c, 0) + 1
        if node.kind == "op":
            assert len(node.op_ids) == 1 and not node.children
            leaves.append(node.op_ids[0])
            continue
        assert len(node.children) >= 2
        kids = [nodes[c] for c in node.children]
        union = sorted(v for k in kids for v in k.op_ids)
        assert union == list(node.op_ids), "children partition the parent's ops"
        assert is_convex(graph, node.op_ids, r)
        for k in kids:
            assert k.kind != node.kind, "flattened: no series under series, no parallel under parallel"
        if node.kind == "series":
            for i, j in itertools.combinations(range(len(kids)), 2):
                for u in kids[i].op_ids:
                    for w in kids[j].op_ids:
                        assert w in r[u], f"series: op {u} of child {i} must reach op {w} of child {j}"
        else:
            assert [k.op_ids[0] for k in kids] == sorted(k.op_ids[0] for k in kids)
            for i, j in itertools.combinations(range(len(kids)), 2):
                for u in kids[i].op_ids:
                    for w in kids[j].op_ids:
                        assert w not in r[u] and u not in r[w], "parallel children are incomparable"
    assert sorted(leaves) == list(range(graph.num_ops)), "leaves partition the ops"
    assert all(child_count.get(n.id, 0) == (0 if n.id == tree.root else 1) for n in nodes), "a tree"


def random_dag(n: int, p: float, seed: int) -> OpGraph:
    rng = random.Random(seed)
    ops = [make_op(f"v{i}", fwd=1e-3 * rng.randint(1, 5), params=4e6 * rng.randint(0, 3), alpha=1e-4 * rng.randint(0, 2))
           for i in range(n)]
    edges = [(f"v{i}", f"v{j}", 1e3 * rng.randint(1, 9)) for i in range(n) for j in range(i + 1, n) if rng.random() < p]
    return OpGraph.build(f"dag{n}_{seed}", ops, edges)


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("graph", [chain_graph(1), chain_graph(5), branches_graph(2, 1), branches_graph(4, 3),
                                   nested_sp_graph()], ids=lambda g: g.name)
def test_fixture_trees(graph):
    assert is_series_parallel(graph)
    tree = decompose(graph)
    assert tree.merged == {} and tree.graph is graph
    check_tree(tree)


@pytest.mark.parametrize("seed", range(25))
def test_random_sp_graphs_decompose_without_contraction(seed):
    graph = random_sp_graph(2 + seed * 2, seed)
    assert is_series_parallel(graph)
    tree = decompose(graph)
    assert tree.merged == {}
    check_tree(tree)


@pytest.mark.parametrize("seed", range(40))
def test_sp_test_agrees_with_brute_force_n_search(seed):
    graph = random_dag(4 + seed % 5, 0.35, seed)
    assert is_series_parallel(graph) == (not has_induced_n(graph))


def test_branch_counts():
    assert num_branches(chain_graph(6)) == 1
    assert num_branches(nested_sp_graph()) == 2
    for k in (2, 3, 7, 16):
        assert num_branches(branches_graph(k, 3)) == k
    tree = decompose(branches_graph(5, 2))
    assert num_branches(tree) == 5


def test_shapes_of_known_trees():
    tree = decompose(branches_graph(3, 2))
    root = tree.nodes[tree.root]
    assert [tree.nodes[c].kind for c in root.children] == ["op", "parallel", "op"]
    par = tree.nodes[root.children[1]]
    assert [tree.nodes[c].kind for c in par.children] == ["series"] * 3
    # several sources and sinks: the root is a parallel of the two chains
    g = OpGraph.build("two_chains", [make_op(n) for n in "abcd"], [("a", "b", 1.0), ("c", "d", 1.0)])
    t = decompose(g)
    assert t.nodes[t.root].kind == "parallel"
    check_tree(t)


def _check_contraction(original: OpGraph, sp_graph: OpGraph, merged) -> None:
    assert is_series_parallel(sp_graph)
    assert not has_induced_n(sp_graph) if sp_graph.num_ops <= 12 else True
    covered = [n for names in merged.values() for n in names]
    assert len(covered) == len(set(covered)), "merged regions are disjoint"
    r = reach(original)
    for name, names in merged.items():
        assert len(names) >= 2
        assert is_convex(original, [original.op_id(n) for n in names], r), f"{name} is not convex"
        op = sp_graph.ops[sp_graph.op_id(name)]
        assert op.fwd.beta == pytest.approx(sum(original.ops[original.op_id(n)].fwd.beta for n in names))
    assert sp_graph.num_ops == original.num_ops - sum(len(v) - 1 for v in merged.values())
    for attr in ("param_bytes", "act_bytes"):
        assert sum(getattr(o, attr) for o in sp_graph.ops) == pytest.approx(sum(getattr(o, attr) for o in original.ops))
    for part in ("fwd", "bwd"):
        for coef in ("alpha", "beta"):
            total = sum(getattr(getattr(o, part), coef) for o in original.ops)
            assert sum(getattr(getattr(o, part), coef) for o in sp_graph.ops) == pytest.approx(total)
    # every original edge that is not inside a region survives, bytes aggregated
    group = {n: g for g, names in merged.items() for n in names}
    expected: dict[tuple[str, str], float] = {}
    for e in original.edges:
        s, d = original.ops[e.src].name, original.ops[e.dst].name
        key = (group.get(s, s), group.get(d, d))
        if key[0] != key[1]:
            expected[key] = expected.get(key, 0.0) + e.bytes
    got = {(sp_graph.ops[e.src].name, sp_graph.ops[e.dst].name): e.bytes for e in sp_graph.edges}
    assert got == pytest.approx(expected)


def test_non_sp_fixture_detected_and_contracted():
    graph = non_sp_graph()
    assert not is_series_parallel(graph) and has_induced_n(graph)
    sp_graph, merged = make_series_parallel(graph)
    assert merged and all(len(v) < graph.num_ops - 2 for v in merged.values()), "a small region, not the whole graph"
    _check_contraction(graph, sp_graph, merged)
    tree = decompose(graph)
    assert tree.merged == merged
    check_tree(tree)


@pytest.mark.parametrize("seed", range(30))
def test_random_dags_are_made_sp(seed):
    graph = random_dag(5 + seed % 8, 0.3, 100 + seed)
    sp_graph, merged = make_series_parallel(graph)
    if is_series_parallel(graph):
        assert merged == {} and sp_graph is graph
    else:
        assert merged
    _check_contraction(graph, sp_graph, merged)
    check_tree(decompose(graph))


def test_leaf_of_and_node_checks():
    from graphpipe.errors import InputError
    from graphpipe.sp import SPNode
    tree = decompose(nested_sp_graph())
    for v in range(tree.graph.num_ops):
        assert tree.nodes[tree.leaf_of(v)].op_ids == (v,)
    with pytest.raises(InputError, match="op id 99"):
        tree.leaf_of(99)
    with pytest.raises(InputError, match="at least two children"):
        SPNode(0, "series", (1,), (0, 1))
    with pytest.raises(InputError, match="kind must be"):
        SPNode(0, "prime", (), (0,))


def test_contract_refuses_overlapping_regions():
    from graphpipe.errors import InputError
    with pytest.raises(InputError, match="two regions"):
        contract(chain_graph(4), [(0, 1), (1, 2)])


def test_deterministic():
    graph = random_dag(14, 0.3, 7)
    assert decompose(graph) == decompose(graph)
    assert make_series_parallel(graph) == make_series_parallel(graph)


def _profile(name):
    return read_pipedream(os.path.join(PROFILES_DIR, name, "graph.txt"))


@pytest.mark.parametrize("name,expected", [("alexnet", True), ("vgg16", True), ("resnet18", True), ("resnet50", True),
                                           ("inception_v3", True), ("nasnetamobile", False), ("gnmt", False)])
def test_profiles_match_readme(name, expected):
    """data/pipedream-profiles/README.md says which profiles are SP."""
    graph = _profile(name)
    assert is_series_parallel(graph) is expected
    tree = decompose(graph)
    assert (tree.merged == {}) is expected
    check_tree(tree)
    if not expected:
        _check_contraction(graph, tree.graph, tree.merged)
        # the contraction is local: most ops keep their own identity
        assert tree.graph.num_ops > graph.num_ops // 2


def test_resnet50_tree_properties():
    tree = decompose(_profile("resnet50"))
    check_tree(tree)
    assert num_branches(tree) == 2  # residual block: conv path | shortcut
