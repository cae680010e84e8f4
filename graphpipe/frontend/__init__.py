"""graphpipe's torch front end: from an ``nn.Module`` (or a zoo spec) to an :class:`~graphpipe.graph.OpGraph`.

Everything here imports torch; the core beside it (``graphpipe/*.py``: graph, stages, costs, cluster, plan, sp)
does not, so planning from a graph file or a plan file never loads torch. tests/test_package_edges.py guards it.

- :mod:`.capture`, :mod:`.export_inputs`: ``torch.export`` a module (its constant and keyword inputs bound) and cut its graph into ops (costs from FLOPs or a profile);
- :mod:`.exporting`, :mod:`.capture_repeats`, :mod:`.capture_refusals`, :mod:`.reentrant`, :mod:`.folded`:
  the export itself, repeated stacks captured once, refusals in one line, re-entrant and folded ops;
- :mod:`.flops`, :mod:`.split_backward`, :mod:`.profile`: FLOP formulas, the split backward, measured costs;
- :mod:`.layer`, :mod:`.zoo_models`, :mod:`.zoo`: the built-in models and their one-op layer base;
- :mod:`.graph_cache`: captured graphs cached on disk by model spec.
"""
