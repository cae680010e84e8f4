"""The README's sample outputs, made by running the commands they show, so a figure in the README is one a run gave.

Each sample sits between ``<!-- sample: NAME -->`` and ``<!-- /sample -->``
(a fenced block); everything else in the README is prose. :func:`render`
runs each sample's commands in a scratch folder and rewrites its block; a
test (tests/test_readme_samples.py) checks the committed README against a
fresh run, figures that differ run to run (the gradient check's
``max_abs_diff``, which depends on the order floating-point sums arrive in)
compared by form and bound, every other character exactly. After a change
that moves a figure::

    python -m graphpipe.evals.readme_samples README.md

Samples
-------
``quick-start``: ``graphpipe plan twobranch:small --devices 4 --batch-size 32``
then ``graphpipe run plan.json --check`` (4 CPU ranks, about a minute on a
2-core host): the plan's table down to its iteration time, then the check line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

__all__ = ["SAMPLES", "quick_start", "render", "main", "VARYING"]

VARYING = re.compile(r"max_abs_diff (\S+)")
"""The figures a fresh run may give otherwise: compared by form, not value."""


def _graphpipe(cwd: str, *argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "graphpipe", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", "GRAPHPIPE_PROGRESS": "off"})
    if proc.returncode != 0:
        raise RuntimeError(f"graphpipe {' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def quick_start(cwd: str) -> str:
    """The quick start's sample: the plan's table and iteration time, ``...``, the check line."""
    plan = _graphpipe(cwd, "plan", "twobranch:small", "--devices", "4", "--batch-size", "32", "--out", "plan.json")
    run = _graphpipe(cwd, "run", "plan.json", "--check")
    head = plan.splitlines()
    head = head[:next(i for i, line in enumerate(head) if line.startswith("iteration time")) + 1]
    check = next(line for line in run.splitlines() if line.startswith("check: "))
    return "\n".join([*head, "...", check]) + "\n"


SAMPLES = {"quick-start": quick_start}


def blocks(text: str) -> dict[str, str]:
    """Each sample's fenced block as the README holds it (without the fences)."""
    found = {}
    for m in re.finditer(r"<!-- sample: ([\w-]+) -->\n```\n(.*?)```\n<!-- /sample -->", text, re.S):
        found[m.group(1)] = m.group(2)
    return found


def render(text: str, made: dict[str, str]) -> str:
    """``text`` with each sample's block replaced by ``made[name]``."""
    def put(m: re.Match) -> str:
        name = m.group(1)
        return f"<!-- sample: {name} -->\n```\n{made.get(name, m.group(2))}```\n<!-- /sample -->"

    return re.sub(r"<!-- sample: ([\w-]+) -->\n```\n(.*?)```\n<!-- /sample -->", put, text, flags=re.S)


def make_all(names=None) -> dict[str, str]:
    """Run every sample's commands (each in a scratch folder of its own)."""
    made = {}
    for name in names or SAMPLES:
        with tempfile.TemporaryDirectory(prefix=f"graphpipe-sample-{name}-") as cwd:
            made[name] = SAMPLES[name](cwd)
    return made


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m graphpipe.evals.readme_samples README.md", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        text = f.read()
    new = render(text, make_all(list(blocks(text))))
    with open(argv[0], "w", encoding="utf-8") as f:
        f.write(new)
    print(f"rewrote {len(blocks(text))} sample(s) in {argv[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
