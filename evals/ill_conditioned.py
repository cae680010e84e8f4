"""``--check`` on ill-conditioned CNNs: correct runs pass, a wrong gradient fails.

EfficientNet-B0 (32x32 images) and Inception-v3 (75x75), written in plain
PyTorch in :mod:`graphpipe.evals.cnn_models`, are planned by gpp on
``--ranks`` CPU ranks at a batch of 16 in micro-batches of 4, so their last
BatchNorms normalise four values per channel. Each plan runs
``graphpipe run --check`` (the command a user types, one subprocess each):

* ``fixed``: ``--check-tolerance fixed`` (atol + rtol*|reference|, fp32's
  ``assert_close`` defaults, no float64 run);
* ``fp64``: the default tolerance, widened by the reference's own
  fp32-vs-fp64 spread per tensor;
* ``wrong gradient``: the default tolerance, with one rank's gradients
  halved after every step (``GRAPHPIPE_FAIL_AT=grad``): must FAIL;
* ``mixed shards``: the same model cut into the same stages with micro-batches
  of 4 and 8 on alternate stages, where no shard-by-shard reference exists and
  the reference is the whole mini-batch cut per op: default tolerance.

Beside them, ``eager spread``: how far plain eager PyTorch at fp32 lies from
fp64 on the same model, weights and micro-batches (largest gradient
difference): the rounding a fixed tolerance would have to absorb.

Usage::

    python -m graphpipe.evals.ill_conditioned --out evals   # writes OUT/results/ill-conditioned.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["run", "main", "MODELS", "eager_spread"]

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"EfficientNet-B0": os.path.join(HERE, "cnn_models.py") + ":efficientnet_b0",
          "Inception-v3": os.path.join(HERE, "cnn_models.py") + ":inception_v3"}
VARIANTS = ("fixed", "fp64", "wrong gradient", "mixed shards")


def eager_spread(spec: str, micro_batch: int) -> float:
    """Largest |fp32 - fp64| over every gradient of plain eager training, micro-batch by micro-batch, one step."""
    import torch

    from graphpipe.frontend.capture import load_factory

    f = load_factory(spec)
    model, x, loss_fn, target = f.module, f.args[0], f.loss_fn, f.example_target

    def grads(dtype):
        m = copy.deepcopy(model).to(dtype).train()
        for lo in range(0, x.shape[0], micro_batch):
            rows = slice(lo, lo + micro_batch)
            (loss_fn(m(x[rows].to(dtype)), target[rows]) * (micro_batch / x.shape[0])).backward()
        return {n: p.grad.double() for n, p in m.named_parameters()}

    a, b = grads(torch.float32), grads(torch.float64)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _plan(spec: str, ranks: int, batch: int, micro_batch: int, folder: str) -> str:
    path = os.path.join(folder, "plan.json")
    subprocess.run([sys.executable, "-m", "graphpipe", "plan", spec, "--devices", str(ranks), "--batch-size",
                    str(batch), "--micro-batch-size", str(micro_batch), "--out", path],
                   check=True, capture_output=True, text=True)
    return path


def _mixed(path: str, micro_batch: int, folder: str) -> str:
    """The plan at ``path`` with every other stage's micro-batch doubled (shards of two sizes)."""
    from graphpipe.plan import Plan, read_plan, write_plan
    from graphpipe.sched import make_schedule
    from graphpipe.stages import Stage, StageGraph

    plan = read_plan(path)
    sg = plan.stage_graph
    stages = [Stage(s.id, s.op_ids, s.devices, micro_batch * (2 if s.id % 2 else 1)) for s in sg.stages]
    mixed = StageGraph.build(sg.graph, stages, sg.batch_size, sg.num_devices)
    out = os.path.join(folder, "mixed.json")
    write_plan(out, Plan(model=plan.model, stage_graph=mixed, cluster=plan.cluster, strategy="custom",
                         schedule=make_schedule("gpipe", mixed, plan.cluster)))
    return out


def _check(plan: str, steps: int, extra: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "graphpipe", "run", plan, "--steps", str(steps), "--check",
                           "--timeout", "600", "--json", *extra],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    try:
        check = json.loads(proc.stdout)["check"]
    except (ValueError, KeyError):
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return {"passed": check["passed"], "max_abs_diff": check["max_abs_diff"],
            "mismatches": check["num_mismatches"], "fp64_spread": (check.get("fp64_spread") or {}).get("max_grad")}


def run(ranks: int = 4, batch: int = 16, micro_batch: int = 4, steps: int = 2,
        models: dict[str, str] | None = None) -> dict[str, Any]:
    rows = []
    for name, spec in (models or MODELS).items():
        spread = eager_spread(spec, micro_batch)
        with tempfile.TemporaryDirectory() as folder:
            plan = _plan(spec, ranks, batch, micro_batch, folder)
            runs = {"fixed": (plan, ["--check-tolerance", "fixed"], None), "fp64": (plan, [], None),
                    "wrong gradient": (plan, [], {"GRAPHPIPE_FAIL_RANK": str(ranks - 1), "GRAPHPIPE_FAIL_AT": "grad"}),
                    "mixed shards": (_mixed(plan, micro_batch, folder), [], None)}
            for variant, (path, extra, env) in runs.items():
                row = {"model": name, "variant": variant, "eager_spread": spread, **_check(path, steps, extra, env)}
                row["verdict"] = "error" if "error" in row else "PASSED" if row["passed"] else "FAILED"
                row["expected"] = "FAILED" if variant == "wrong gradient" else "PASSED"
                rows.append(row)
                print(f"{name:<16} {variant:<15} {row['verdict']:<7} max |diff| {row.get('max_abs_diff', float('nan')):.3g}"
                      f"  eager fp32-vs-fp64 {spread:.3g}", flush=True)
    return {"config": {"ranks": ranks, "batch_size": batch, "micro_batch_size": micro_batch, "steps": steps,
                       "strategy": "gpp", "models": {k: os.path.basename(v) for k, v in (models or MODELS).items()}},
            "rows": rows,
            "summary": {"as_expected": sum(r["verdict"] == r["expected"] for r in rows), "runs": len(rows)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None, help="write OUT/results/ill-conditioned.json")
    args = p.parse_args(argv)
    result = run(args.ranks, args.batch_size, args.micro_batch_size, args.steps)
    print(f"{result['summary']['as_expected']}/{result['summary']['runs']} runs gave the expected verdict")
    if args.out:
        from graphpipe.evals.common import write_result

        print("wrote", write_result(args.out, "ill-conditioned", result["config"], result["rows"], result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
