"""Readers of other tools' model descriptions into :class:`~graphpipe.graph.OpGraph`.

* :mod:`graphpipe.importers.pipedream_txt`: PipeDream's profiled ``graph.txt``.

Our own graph JSON (``graphpipe.graph/1``) is read by :func:`graphpipe.graph.read_graph_json`.
"""
