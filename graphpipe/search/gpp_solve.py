"""Solving GraphPipe's DP for one micro-batch size (paper §4; docs/design.md#partitioners): which DP, and the search over targets.

:func:`make_dp` picks the DP for a tree: :class:`~graphpipe.search.gpp_chain.ChainDP`
on a chain (the chain view, or a branchless model), the general
:class:`~graphpipe.search.gpp_dp.BottleneckDP` otherwise -- the same
recurrence, the first vectorised. Either decides one target ``t_max`` at a
time; :func:`first_feasible` searches the sorted candidate targets for the
smallest feasible one at a depth bound, and :func:`min_bottleneck` uses it
for the exact optimal bottleneck of the space.

Example
-------
Two ops, the second twice as costly, on three devices: one stage over all
three (3 ms per sample) beats any split of the two.

>>> from graphpipe.cluster import preset
>>> from graphpipe.graph import Affine, Op, OpGraph
>>> ops = [Op("a", "x", Affine(0, 1e-3), Affine(0, 2e-3)), Op("b", "x", Affine(0, 2e-3), Affine(0, 4e-3))]
>>> sol = min_bottleneck(OpGraph.build("pair", ops, [("a", "b", 1)]), preset("v100", 3), 12, 3)
>>> round(sol.bottleneck_tps, 6), [(s.op_ids, s.num_devices) for s in sol.stages]
(0.003, [((0, 1), 3)])
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from graphpipe.cluster import Cluster, Link
from graphpipe.graph import OpGraph
from graphpipe.search.gpp_blocks import BlockCosts
from graphpipe.search.gpp_chain import ChainDP, is_chain
from graphpipe.search.gpp_dp import BottleneckDP, DPSolution, Table, TargetDP
from graphpipe.search.gpp_nested import NestedChainDP
from graphpipe.search.gpp_tree import DPTree, build_tree

__all__ = ["make_dp", "first_feasible", "min_bottleneck"]


def make_dp(tree: DPTree, cluster: Cluster, batch_size: int, micro_batch_size: int, num_devices: int | None = None,
            power_of_two: bool = False, link: Link | None = None, recompute: bool = False,
            blocks: BlockCosts | None = None) -> TargetDP:
    """The DP for ``tree``: :class:`ChainDP` on a chain, else :class:`NestedChainDP` (:class:`BottleneckDP` with
    its long nested chains in numpy): the same answers as :class:`BottleneckDP`, faster."""
    cls = ChainDP if is_chain(tree) else NestedChainDP
    return cls(tree, cluster, batch_size, micro_batch_size, num_devices, power_of_two, link, recompute, blocks)


def first_feasible(dp: TargetDP, targets: Sequence[float], depth: int, start: int = 0,
                   probes: dict[int, Table] | None = None, stop: int | None = None,
                   guess: int | None = None) -> tuple[int | None, int]:
    """Index of the smallest target at which the root admits source depth <= ``depth`` (None: none does).

    Feasibility is monotone in the target, so this is a search over a sorted
    array. With a ``guess`` (the answer of a neighbouring micro-batch size),
    probe it and the index below: a right guess needs these two runs only. A
    feasible guess is an upper end; then try ``start``, a lower bound (no
    index below it is feasible, and it is often tight), and gallop down from
    the guess. Without a guess, or when it is infeasible, gallop up from the
    lowest index not known infeasible (probes there are cheap: few large
    stages meet a small target). Then bisect the bracket. ``probes`` (target index -> root
    table) carries DP runs between searches for different depths: every
    earlier probe narrows the bracket. ``stop``: only indices below it are of
    use to the caller; None is returned when none of them is feasible.
    Returns (index, DP runs).
    """
    n = len(targets) if stop is None else min(stop, len(targets))
    if n <= 0:
        return None, 0
    probes = {} if probes is None else probes
    runs = 0

    def ok(i: int) -> bool:
        nonlocal runs
        root = probes.get(i)
        if root is None or len(root.devices) <= depth:  # a table may end at the bound it was asked about
            runs += 1
            root = dp.solve(float(targets[i]), depth)
            probes[i] = root
        return root.feasible(depth)

    known = [(i, r.feasible(depth)) for i, r in probes.items() if len(r.devices) > depth]
    below = max([i for i, yes in known if not yes], default=-1)   # known infeasible
    above = min([i for i, yes in known if yes], default=n)        # known feasible
    below = max(below, min(start, n) - 1)
    if below >= n - 1:
        return None, runs
    if above <= below + 1:
        return (above if above < n else None), runs
    down = False
    if guess is not None and below + 1 < guess < min(above, n):
        # Probe the guess and the index below it: a right guess settles the search in these two runs.
        if ok(guess):
            if not ok(guess - 1):
                return guess, runs
            above = guess - 1
            if ok(below + 1):  # the lower bound is often tight
                return below + 1, runs
            below, down = below + 1, True
        else:
            below = guess
            if below >= n - 1:
                return None, runs
            if above <= below + 1:
                return (above if above < n else None), runs
    if down:
        step = 1
        while above - below > 1:  # gallop down from the guess towards the known infeasible index
            probe = above - step
            if probe <= below:
                break
            if ok(probe):
                above, step = probe, step * 2
            else:
                below = probe
                break
    else:
        if stop is not None and above >= n and n - 1 > below + 1:
            # The caller's cut-off bounds the bracket: one run at its top says whether anything below it is
            # feasible at all (often nothing is: a shallower graph needing a much larger target).
            if not ok(n - 1):
                return None, runs
            above = n - 1
        if ok(below + 1):
            return below + 1, runs
        below, step = below + 1, 1
        while True:  # gallop up
            probe = below + step
            if above < n and probe >= above:  # the bracket is already closed by an earlier probe
                break
            if probe >= n - 1:
                if not ok(n - 1):
                    return None, runs
                above = n - 1
                break
            if ok(probe):
                above = probe
                break
            below, step = probe, step * 2
    while above - below > 1:  # targets[below] infeasible, targets[above] feasible
        mid = (below + above) // 2
        if ok(mid):
            above = mid
        else:
            below = mid
    return above, runs


def min_bottleneck(graph: OpGraph | DPTree, cluster: Cluster, batch_size: int, micro_batch_size: int,
                   num_devices: int | None = None, power_of_two: bool = False,
                   link: Link | None = None, recompute: bool = False, round_robin: bool = False) -> DPSolution | None:
    """The smallest bottleneck TPS of the search space (module docstring) for one micro-batch size,
    cuts costed on ``link`` (None: free); ``round_robin``: :class:`~graphpipe.search.gpp_blocks.BlockCosts`'s.

    Search over the sorted candidate TPS values (:func:`first_feasible`):
    feasibility is monotone in ``t_max`` (a larger target only admits more
    stages), and the optimum is the TPS of some stage, so the search is
    exact. Returns None when nothing fits (memory, or no stage at all).
    """
    tree = graph if isinstance(graph, DPTree) else build_tree(graph)
    blocks = BlockCosts(tree, cluster, batch_size, micro_batch_size, num_devices, power_of_two, recompute,
                        round_robin=round_robin)
    dp = make_dp(tree, cluster, batch_size, micro_batch_size, num_devices, power_of_two, link, recompute, blocks)
    targets = dp.candidate_targets()
    start = int(np.searchsorted(targets, dp.lower_bound() * (1 - 1e-12)))
    index, tried = first_feasible(dp, targets, dp.kcap, start)
    if index is None:
        return None
    best = dp.best_at(float(targets[index]))
    assert best is not None
    v, stages = best
    return DPSolution(micro_batch_size, max(s.tps for s in stages), tuple(stages), v, tried, dp.dp_states)
