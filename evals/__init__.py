"""The paper's evaluations, benchmarks and REPORT.md (installed as ``graphpipe.evals``).

The folder sits at the top of the repository (``evals/``, beside
``graphpipe/``) with the committed results, figures and ``REPORT.md``; the
wheel installs it as the subpackage ``graphpipe.evals`` (a setuptools
``package-dir`` mapping), so nothing but ``graphpipe`` is a top-level name in
site-packages. Run its modules as ``python -m graphpipe.evals.NAME``;
``graphpipe eval`` runs the experiments and writes to ``./eval-out`` unless
``--out`` says otherwise (``--out evals`` regenerates the committed report).
"""
