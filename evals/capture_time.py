"""Capture time of real models through ``torch.export``: small Hugging Face / timm models and meta-device LLMs.

::

    python -m graphpipe.evals.capture_time                 # every case below, medians of 3
    python -m graphpipe.evals.capture_time --only llama-7b --repeats 1

Cases: ``tests/hf_models.py``'s CLIP, Llama (tied head), BERT and timm EfficientNet (when timm imports), each
from a small config with random weights; a Llama-7B-shaped config (32 layers, hidden 4096) and a
Llama-70B-shaped one (80 layers, hidden 8192, 8 KV heads) built on the meta device, so no weight is
allocated (the process's peak resident size says so). Reports the whole capture and the ``torch.export`` part
of it, in seconds. Benchmarks are not tests.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

__all__ = ["CASES", "run", "main"]

CASES = ("clip", "llama", "bert", "efficientnet", "llama-7b", "llama-70b")
_LLM = {"llama-7b": (32, 4096, 32, 32, 11008), "llama-70b": (80, 8192, 64, 8, 28672)}


def _tests_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "tests")


def _factory(case: str):
    sys.path.insert(0, _tests_dir())
    import hf_models

    if case in _LLM:
        layers, hidden, heads, kv, ffn = _LLM[case]
        return hf_models.llama_meta(hf_models.llama_config(layers, hidden, heads, kv, ffn), batch=2, seq=128)
    return getattr(hf_models, case)()


def run(cases=CASES, repeats: int = 3) -> list[dict]:
    from graphpipe.frontend.capture import capture

    rows = []
    for case in cases:
        if case == "efficientnet":
            try:
                import timm  # noqa: F401
            except Exception:  # noqa: BLE001 - torchvision that does not load beside this torch: skip
                print(f"{case}: skipped (timm does not import here)")
                continue
        totals, exports = [], []
        for _ in range(repeats):
            module, inputs, loss_fn, target = _factory(case)
            t0 = time.perf_counter()
            cap = capture(module, inputs, name=case, loss_fn=loss_fn, example_target=target)
            totals.append(time.perf_counter() - t0)
            exports.append(cap.export_seconds)
        row = {"case": case, "capture_s": statistics.median(totals), "export_s": statistics.median(exports),
               "ops": cap.graph.num_ops, "param_bytes": cap.graph.param_bytes, "repeats": repeats,
               "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
        rows.append(row)
        print(f"{case:<13} capture {row['capture_s']:6.2f} s (export {row['export_s']:6.2f} s)  {row['ops']:3d} ops  "
              f"{row['param_bytes'] / 1e9:8.3f} GB of parameters  process max RSS {row['max_rss_gb']:.2f} GB",
              flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help=f"comma-separated cases of {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write OUT/results/capture_time.json")
    args = parser.parse_args(argv)
    from .common import chosen_cases

    cases = chosen_cases(args.only, CASES)
    if cases is None:
        return 2
    rows = run(cases, args.repeats)
    if args.out:
        from .common import write_result

        print(f"wrote {write_result(args.out, 'capture_time', vars(args), rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
