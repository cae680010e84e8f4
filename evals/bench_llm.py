"""Planning a large language model: the whole cold ``graphpipe plan`` and its search, before and after a change.

    python -m graphpipe.evals.bench_llm --before DIR [--repeat 3] [--cold-repeat 2] [--devices 512,1024]
                                        [--batch-size 2048] [--cluster h100] [--out evals] [--name bench_llm]

The model is a Llama-3-70B-shaped Hugging Face ``LlamaForCausalLM`` (80
decoder layers, hidden 8192, vocabulary 128,256) built on the meta device
by :func:`factory`, so no weights are allocated and nothing is downloaded;
``GRAPHPIPE_BENCH_LLM_LAYERS`` changes its depth (a quicker run). The same
file is the factory the commands plan::

    graphpipe plan evals/bench_llm.py:factory --devices 512 --batch-size 2048 --cluster h100

``--before DIR`` is another checkout's root (``git worktree add /tmp/old
REV``). Every repetition runs each measurement once with that code and once
with this checkout, alternately, each in a fresh process, so both see the
same load. Two measurements per device count:

* ``cold``: the whole ``graphpipe plan evals/bench_llm.py:factory ...``
  (Python start-up, torch.export capture, search, simulation, output), at the
  first device count only unless ``--cold-devices`` names more;
* ``search``: ``graphpipe plan GRAPH.json ...`` on the graph captured once
  here (so both checkouts search the same graph), and the plan's own
  ``search.time_s``.

Each row records wall seconds and the command's CPU seconds (user + system,
of the process and its children): medians, the ratio before / after of both,
and whether the two plans are the same (stages and predicted figures).
CPU seconds are the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "factory", "LLAMA_70B"]

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False)
"""Llama-3-70B's shape (transformers.LlamaConfig fields)."""


def factory():
    """``(module, example input_ids, loss, example labels)`` of a meta-device Llama-3-70B-shaped causal LM."""
    import torch
    import torch.nn.functional as F
    import transformers

    config = dict(LLAMA_70B)
    if os.environ.get("GRAPHPIPE_BENCH_LLM_LAYERS"):
        config["num_hidden_layers"] = int(os.environ["GRAPHPIPE_BENCH_LLM_LAYERS"])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    from graphpipe.evals.llm_configs import sequence_length  # this file is also loaded by path (graphpipe plan)

    seq = sequence_length()
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids}, loss_fn, torch.zeros(2, seq, dtype=torch.long, device="meta")


def _command(root: str, model: str, n: int, args) -> dict:
    """``graphpipe plan MODEL`` with the package under ``root`` in a fresh process: wall and CPU seconds, the plan."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root), GRAPHPIPE_CACHE_DIR="off", GRAPHPIPE_PROGRESS="off")
    cmd = [sys.executable, "-m", "graphpipe", "plan", model, "--devices", str(n), "--batch-size", str(args.batch_size),
           "--cluster", args.cluster, "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.abspath(root))
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"bench_llm: {' '.join(cmd)} under {root} failed: {out.stderr.strip()[-500:]}")
    plan = json.loads(out.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    same = {"stages": plan["stages"], "schedule": plan.get("schedule"), "predicted": plan["predicted"]}
    return {"wall_s": wall, "cpu_s": cpu, "search_s": plan["search"].get("time_s"),
            "throughput": plan["predicted"]["throughput"], "plan": json.dumps(same, sort_keys=True)}


def _side_by_side(kind: str, model: str, n: int, before: str, repeat: int, args) -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(repeat):
        for label, root in (("before", before), ("after", here)):
            runs[label].append(_command(root, model, n, args))
    row = {"measure": kind, "devices": n, "batch_size": args.batch_size, "cluster": args.cluster, "repeat": repeat}
    for label in ("before", "after"):
        for key in ("wall_s", "cpu_s", "search_s"):
            values = [r[key] for r in runs[label]]
            row[f"{label}_median_{key}"] = statistics.median(values)
            row[f"{label}_min_{key}"], row[f"{label}_max_{key}"] = min(values), max(values)
        row[f"{label}_throughput"] = runs[label][-1]["throughput"]
    for key in ("wall_s", "cpu_s", "search_s"):
        row[f"ratio_{key}"] = row[f"before_median_{key}"] / row[f"after_median_{key}"]
    row["same_plan"] = len({r["plan"] for rs in runs.values() for r in rs}) == 1
    return row


def _capture_graph(path: str, args) -> int:
    """Capture :func:`factory` once (this checkout) and write its op graph to ``path``; its op count."""
    from graphpipe.cluster import load_cluster
    from graphpipe.files import write_json_atomic
    from graphpipe.graph import graph_to_dict
    from graphpipe.models import load_model

    cluster = load_cluster(args.cluster, 8, None)
    graph = load_model(f"{os.path.abspath(__file__)}:factory", cluster.device).graph
    write_json_atomic(path, graph_to_dict(graph))
    return graph.num_ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphpipe.evals.bench_llm", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, metavar="DIR", help="the other checkout's root")
    p.add_argument("--repeat", type=int, default=3, help="search runs per checkout and device count (default 3)")
    p.add_argument("--cold-repeat", type=int, default=2, help="whole cold commands per checkout (default 2)")
    p.add_argument("--devices", default="512,1024", help="device counts (default 512,1024)")
    p.add_argument("--cold-devices", default=None, help="device counts of the cold command (default: the first)")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--cluster", default="h100")
    p.add_argument("--out", default="evals")
    p.add_argument("--name", default="bench_llm")
    args = p.parse_args(argv)
    from graphpipe.evals.common import write_result  # here: graphpipe plan imports this file alone, as a factory

    counts = [int(x) for x in args.devices.split(",")]
    cold_counts = [int(x) for x in args.cold_devices.split(",")] if args.cold_devices else counts[:1]
    rows = []
    model = f"{os.path.abspath(__file__)}:factory"
    for n in cold_counts:
        rows.append(_side_by_side("cold", model, n, args.before, args.cold_repeat, args))
        print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        graph_path = os.path.join(tmp, "llm.json")
        num_ops = _capture_graph(graph_path, args)
        for n in counts:
            rows.append(_side_by_side("search", graph_path, n, args.before, args.repeat, args))
            print(json.dumps(rows[-1]), flush=True)
    config = {"model": "Llama-3-70B-shaped LlamaForCausalLM (meta)", "config": LLAMA_70B,
              "layers": os.environ.get("GRAPHPIPE_BENCH_LLM_LAYERS") or LLAMA_70B["num_hidden_layers"],
              "ops": num_ops, "before": os.path.abspath(args.before), "devices": counts, "cold_devices": cold_counts,
              "batch_size": args.batch_size, "cluster": args.cluster, "repeat": args.repeat,
              "cold_repeat": args.cold_repeat, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    path = write_result(args.out, args.name, config, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
