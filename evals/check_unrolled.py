"""Held-out check of the unrolled capture: every architecture below, its repeated blocks captured once, against
the whole capture of the same model (graphpipe.frontend.capture_repeats).

    python -m graphpipe.evals.check_unrolled [--only NAME,...] [--out evals]

Each case builds one of :mod:`evals.llm_configs` at small widths (``tiny``,
sequence 16) with just enough layers for the stack to be cut (``2 * KEPT``
units after its prefix), checks which stacks :func:`repeated_stacks` finds
(path, prefix, period), and compares :func:`unrolled_capture` with a plain
capture: names, kinds, costs, bytes, edges and ids must be equal, and the cut
stacks restored. The whole capture exports every layer, which is the point
of the shortcut and what makes the deep cases slow (Gemma-3 at 50 layers,
Llama-4 at 32), so ``tests/test_capture_repeats.py``
runs the cases of :data:`IN_SUITE` (one per kind of stack) and this script
runs them all. Exit 1 when a case fails.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["CASES", "IN_SUITE", "check"]

CASES: dict[str, tuple[int, list[tuple[str, int, int]]]] = {
    # name: (layers, the stacks found as (path, prefix, period))
    "deepseek_v3_e16": (12, [("model.layers", 3, 1)]),  # 3 dense layers, then mixture-of-experts ones
    "gemma2_27b": (16, [("model.layers", 0, 2)]),  # sliding and global attention in turn
    "gemma3_27b": (50, [("model.layers", 2, 6)]),  # 5 local : 1 global; the run ends in a whole unit
    "llama4_maverick": (32, [("model.layers", 0, 4)]),  # experts every 2nd layer, no rotary every 4th
    "t5_11b": (10, [("encoder.block", 1, 1), ("decoder.block", 1, 1)]),  # block 0 holds the position table
    "bart_large": (9, [("model.encoder.layers", 0, 1), ("model.decoder.layers", 0, 1)]),  # learned positions
    "nllb_3b": (9, [("model.encoder.layers", 0, 1), ("model.decoder.layers", 0, 1)]),  # positions under no_grad
    "gpt_oss_120b": (16, [("model.layers", 0, 2)]),  # sliding and full attention in turn, experts everywhere
    "mixtral_8x22b": (9, [("model.layers", 0, 1)]),
    "falcon_40b": (9, [("transformer.h", 0, 1)]),
    "bloom_176b": (9, [("transformer.h", 0, 1)]),
    "pegasus_x_large": (16, [("model.encoder.layers", 0, 2), ("model.decoder.layers", 0, 1)]),  # glue after a stack
    "whisper_large_v3": (9, [("model.encoder.layers", 0, 1), ("model.decoder.layers", 0, 1)]),  # log-mel input
}

IN_SUITE = ("deepseek_v3_e16", "gemma2_27b", "nllb_3b", "pegasus_x_large", "falcon_40b", "bloom_176b")
"""The cases the test suite runs: a prefix before the stack, a period of 2, an encoder-decoder with positions under
``no_grad``, glue after a stack renamed, and the plain period of 1 twice. The others repeat these kinds at more
layers (Gemma-3's period of 6 and Llama-4's of 4 are what the suite's own periodic stacks check at small size)."""


def check(name: str) -> dict:
    """Capture ``name`` unrolled and whole; raises AssertionError naming what differs."""
    from graphpipe.frontend.capture import capture
    from graphpipe.frontend.capture_repeats import repeated_stacks, unrolled_capture
    from graphpipe.evals.llm_configs import build

    layers, expected = CASES[name]
    model, inputs, loss_fn, labels = build(name, layers=layers, tiny=True, seq=16)
    stacks = repeated_stacks(model)
    found = [(s.path, s.start, s.period) for s in stacks]
    assert found == expected, f"{name}: stacks {found}, expected {expected}"
    kw = dict(name=name, loss_fn=loss_fn, example_target=labels)
    started = time.perf_counter()
    unrolled = unrolled_capture(model, inputs, **kw)
    unrolled_s = time.perf_counter() - started
    assert unrolled is not None, f"{name}: the stacks were found but not unrolled"
    started = time.perf_counter()
    whole = capture(model, inputs, **kw).graph
    whole_s = time.perf_counter() - started
    assert unrolled == whole, f"{name}: the unrolled graph differs from the whole capture"  # names .. ids
    assert all(len(model.get_submodule(s.path)) == len(s.keys) for s in stacks), f"{name}: stacks not restored"
    return {"case": name, "layers": layers, "ops": whole.num_ops, "stacks": len(stacks),
            "unrolled_s": unrolled_s, "whole_s": whole_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help=f"comma-separated cases of {', '.join(CASES)}")
    parser.add_argument("--out", default=None, help="write OUT/results/check_unrolled.json")
    args = parser.parse_args(argv)
    from .common import chosen_cases

    cases = chosen_cases(args.only, CASES)
    if cases is None:
        return 2
    rows, failed = [], 0
    for name in cases:
        try:
            row = check(name)
            row["equal"] = True
            print(f"{name:<18} equal  {row['ops']:4d} ops  unrolled {row['unrolled_s']:5.1f} s  whole "
                  f"{row['whole_s']:5.1f} s", flush=True)
        except AssertionError as e:
            row, failed = {"case": name, "equal": False, "error": str(e)}, failed + 1
            print(f"{name:<18} FAILED {e}", flush=True)
        rows.append(row)
    if args.out:
        from .common import write_result

        print(f"wrote {write_result(args.out, 'check_unrolled', vars(args), rows)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
