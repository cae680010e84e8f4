"""The README's sample outputs are a fresh run's (graphpipe.evals.readme_samples): every character equal, but
for the figures that differ run to run (``max_abs_diff``: the order floating-point sums arrive in), which must
have the same form and stay within the check's tolerance."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_readme_marks_its_samples_and_render_replaces_only_them():
    from graphpipe.evals.readme_samples import SAMPLES, blocks, render

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert set(blocks(text)) == set(SAMPLES)
    assert render(text, {}) == text
    swapped = render(text, {"quick-start": "x\n"})
    assert blocks(swapped) == {"quick-start": "x\n"}
    assert len(swapped) == len(text) - len(blocks(text)["quick-start"]) + 2


@pytest.mark.slow
def test_the_readme_samples_are_what_the_commands_print_now():
    from graphpipe.evals.readme_samples import VARYING, blocks, make_all

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        committed = blocks(f.read())
    fresh = make_all(list(committed))
    for name, text in committed.items():
        assert VARYING.sub("max_abs_diff X", fresh[name]) == VARYING.sub("max_abs_diff X", text), (
            f"README sample {name!r} is stale: run `python -m graphpipe.evals.readme_samples README.md`\n{fresh[name]}")
        for figure in VARYING.findall(text):
            assert re.fullmatch(r"\d(\.\d+)?e-\d+|0", figure) and float(figure) < 1e-5, figure  # within atol
