"""Parallelism inside stages: simulated efficiency against devices, per-stage layouts vs one layout vs PP-only.

    python -m graphpipe.evals.stage_parallel --graphs DIR [--devices 64,512,4096,16384] [--out evals]

For each model and device count, three gpp plans on H100s (``graphpipe plan ... --cluster h100``):

* ``per-stage``: ``--tp auto --shard auto``, each stage (branch) free to re-pick its layout;
* ``uniform``: the same search with one layout for every stage (torchtitan's choice:
  ``SearchOptions(per_stage_layouts=False)``);
* ``pp-only``: ``--tp 1 --shard none``, whole copies (the plans before layouts existed).

Efficiency = predicted throughput / (devices / sum over ops of per-sample forward + backward seconds)
(:func:`graphpipe.search.layouts.efficiency`), the share of perfect scaling the plan's own costs allow.

Models: Llama-3-70B and Llama-3.1-405B shapes as captured from their Hugging Face classes on the meta device
(``--graphs DIR`` holds their graph JSON files, ``llama70b.json`` and ``llama405b.json``, captured into it
from :data:`LLM_SPECS` when missing: capturing takes minutes, so it is done once), with 128-token samples, or
``N`` tokens for a name ``NAME@sN`` (``llama70b@s2048``), and a multimodal shape built here
analytically (:func:`multimodal_graph`): a ViT-L-sized vision tower (24 layers, hidden 1024, 256 patches) beside
the text embedding of a 7B-sized decoder (32 layers, hidden 4096, 256 image + 512 text tokens), one image-text
pair per sample; ``mmt``, the paper's multi-modal transformer as graphpipe's zoo builds it (paper config),
costed for the H100 like the others; and any :mod:`evals.llm_configs` architecture by name (shapes nobody tuned
for). Each row also splits its efficiency into three factors
(:func:`graphpipe.search.layouts.efficiency_factors`). Batches: 2048 samples per 512 devices (4 per device), at
least 256 and at most 32,768 (the batch a 405B run at 16,384 devices is planned with: 2 per device).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from typing import Any
from unittest import mock

from graphpipe.cluster import preset
from graphpipe.graph import Affine, Op, OpGraph

from .common import write_result

__all__ = ["main", "multimodal_graph", "run_one", "VARIANTS"]

VARIANTS = ("per-stage", "uniform", "pp-only")
BATCH_RULE = "min(max(256, 4 x devices), 32768)"


def batch_for(devices: int) -> int:
    """The batch a device count is planned with (:data:`BATCH_RULE`)."""
    return min(max(256, 4 * devices), 32768)


def _layer(name: str, hidden: int, seq: int, flops_per_s: float, ffn: int | None = None) -> Op:
    """A transformer layer's analytical costs per sample: 2 FLOPs per multiply-add over the QKV/output
    projections (4 h^2 per token), the MLP (2 h f), attention scores (2 s h), backward twice forward;
    fp32 weights; saved activations ~34 s h bytes at 16-bit (Korthikanti et al. 2022, Table 2, no recompute)."""
    ffn = ffn or 4 * hidden
    flops = 2 * seq * (4 * hidden * hidden + 2 * hidden * ffn + 2 * seq * hidden)
    params = (4 * hidden * hidden + 2 * hidden * ffn) * 4.0
    return Op(name, "transformer", Affine(2e-5, flops / flops_per_s), Affine(4e-5, 2 * flops / flops_per_s), params,
              34.0 * seq * hidden, 4.0 * seq * hidden)


def multimodal_graph(flops_per_s: float) -> OpGraph:
    """A LLaVA-shaped image-text model: vision tower and text embedding in parallel, then the decoder."""
    vis_h, vis_seq, txt_h, txt_seq, vocab = 1024, 256, 4096, 512, 32000
    seq = vis_seq + txt_seq
    ops = [Op("vision.patch_embed", "linear", Affine(1e-5, 2 * vis_seq * 588 * vis_h / flops_per_s),
              Affine(2e-5, 4 * vis_seq * 588 * vis_h / flops_per_s), 588 * vis_h * 4.0, 4.0 * vis_seq * 588,
              4.0 * vis_seq * vis_h)]
    ops += [_layer(f"vision.layers.{i}", vis_h, vis_seq, flops_per_s) for i in range(24)]
    ops += [Op("projector", "linear", Affine(1e-5, 2 * vis_seq * vis_h * txt_h / flops_per_s),
               Affine(2e-5, 4 * vis_seq * vis_h * txt_h / flops_per_s), vis_h * txt_h * 4.0, 4.0 * vis_seq * vis_h,
               4.0 * vis_seq * txt_h),
            Op("text.embed", "embedding", Affine(1e-5, 1e-7), Affine(1e-5, 2e-7), vocab * txt_h * 4.0, 0.0,
               4.0 * txt_seq * txt_h)]
    ops += [_layer(f"decoder.layers.{i}", txt_h, seq, flops_per_s, ffn=11008) for i in range(32)]
    ops += [Op("lm_head", "linear", Affine(1e-5, 2 * txt_seq * txt_h * vocab / flops_per_s),
               Affine(2e-5, 4 * txt_seq * txt_h * vocab / flops_per_s), vocab * txt_h * 4.0,
               4.0 * txt_seq * (txt_h + vocab), 4.0)]
    edges = [("vision.patch_embed", "vision.layers.0", 4.0 * vis_seq * vis_h)]
    edges += [(f"vision.layers.{i}", f"vision.layers.{i + 1}", 4.0 * vis_seq * vis_h) for i in range(23)]
    edges += [("vision.layers.23", "projector", 4.0 * vis_seq * vis_h),
              ("projector", "decoder.layers.0", 4.0 * vis_seq * txt_h),
              ("text.embed", "decoder.layers.0", 4.0 * txt_seq * txt_h)]
    edges += [(f"decoder.layers.{i}", f"decoder.layers.{i + 1}", 4.0 * seq * txt_h) for i in range(31)]
    edges += [("decoder.layers.31", "lm_head", 4.0 * seq * txt_h)]
    return OpGraph.build("multimodal-vitl-7b", ops, edges)


LLM_SPECS = {"llama70b": "evals/bench_llm.py:factory", "llama405b": "evals/llm_configs.py:llama31_405b"}
"""The factories the LLM shapes are captured from (Hugging Face classes on the meta device)."""


def llm_graph(name: str, folder: str) -> OpGraph:
    """``folder/NAME.json``; when missing, captured from :data:`LLM_SPECS` or, for any other name, the
    :mod:`evals.llm_configs` architecture of that name (a few minutes) and written there. ``NAME@sN`` is the
    same architecture with ``N`` tokens per sample (``GRAPHPIPE_LLM_SEQ=N`` while it is captured; 128 without)."""
    from graphpipe.files import write_json_atomic
    from graphpipe.graph import graph_to_dict, read_graph_json
    from graphpipe.models import load_model

    path = os.path.join(folder, f"{name}.json")
    if os.path.exists(path):
        return read_graph_json(path)

    arch, tagged, seq = name.partition("@s")
    if tagged and not (seq.isascii() and seq.isdigit() and int(seq) > 0):
        raise ValueError(f"{name!r}: a sequence length is NAME@sN with N a positive integer (llama70b@s2048)")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = os.path.join(here, LLM_SPECS.get(arch, f"evals/llm_configs.py:{arch}"))
    with mock.patch.dict(os.environ, {"GRAPHPIPE_LLM_SEQ": seq or "128"}):
        graph = load_model(spec, preset("h100", 8).device).graph
    os.makedirs(folder, exist_ok=True)
    write_json_atomic(path, graph_to_dict(graph))
    return graph


def run_one(name: str, graph: OpGraph, devices: int, batch_size: int, variant: str) -> dict[str, Any]:
    """One plan: its efficiency, devices used, layouts and search time (CPU seconds of this process)."""
    from dataclasses import replace

    from graphpipe.errors import GraphpipeError
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.layouts import efficiency, efficiency_factors
    from graphpipe.search.planner import make_plan

    cluster = preset("h100", devices)
    options = {"per-stage": SearchOptions(tp="auto", shard="auto"),
               "uniform": SearchOptions(tp="auto", shard="auto", per_stage_layouts=False),
               "pp-only": SearchOptions()}[variant]
    row: dict[str, Any] = {"model": name, "devices": devices, "batch_size": batch_size, "variant": variant}
    cpu = time.process_time()
    try:
        plan = make_plan(name, graph, cluster, batch_size, "gpp", replace(options))
    except GraphpipeError as exc:
        row.update(outcome="refused", error=str(exc).splitlines()[0], search_cpu_s=time.process_time() - cpu)
        return row
    sg = plan.stage_graph
    layouts = sorted({(s.tp, s.shard + (" round-robin" if s.round_robin else "")
                       + (f" groups of {s.split}" if s.split > 1 else "")) for s in sg.stages})
    row.update(outcome="ok", search_cpu_s=time.process_time() - cpu, throughput=plan.predicted.throughput,
               efficiency=efficiency(plan.predicted.throughput, devices, graph),
               **(efficiency_factors(plan, devices) or {}),
               devices_used=len(sg.devices_used()), stages=sg.num_stages,
               layouts=", ".join(f"tp{t}/{s}" for t, s in layouts),
               peak_memory_gb=plan.predicted.max_peak_memory_bytes / 1e9,
               max_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    return row


def plot(out: str) -> str | None:
    """``stage_parallel.png`` from the result file only: efficiency against devices, one panel per model."""
    from .common import read_result
    from .plots import _save, plt

    res = read_result(out, "stage_parallel")
    if res is None:
        return None
    ok = [r for r in res["rows"] if r["outcome"] == "ok"]
    models = list(dict.fromkeys(r["model"] for r in ok))
    cols = min(4, max(1, len(models)))
    rows = -(-max(1, len(models)) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models):
        for variant, marker, color in zip(VARIANTS, "osv", ("tab:blue", "tab:orange", "tab:green")):
            pts = sorted((r["devices"], r["efficiency"]) for r in ok if r["model"] == model and r["variant"] == variant)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=variant)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.set_title(model)
        ax.set_xlabel("devices (H100)")
        ax.set_ylabel("simulated efficiency")
        ax.grid(alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:  # a run whose first model was refused has nothing to label
        axes[0][0].legend()
    fig.tight_layout()
    return _save(fig, out, "stage_parallel")


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(prog="python -m graphpipe.evals.stage_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--graphs", required=True,
                   help="folder of llama70b.json and llama405b.json (captured into it when missing, minutes each)")
    p.add_argument("--devices", default="64,512,4096,16384")
    p.add_argument("--models", default="llama70b,llama405b,multimodal",
                   help="any of llama70b, llama405b or an evals/llm_configs.py name (graph files in --graphs), "
                        "each with @sN for N tokens per sample (128 without: llama70b@s2048), "
                        "multimodal, mmt (the zoo's, paper config)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=None,
                   help=f"one batch for every device count, rows labelled MODEL@bBATCH (default {BATCH_RULE})")
    p.add_argument("--out", default="evals")
    p.add_argument("--rows", default=None, help="merge these JSON-lines files of rows instead of planning")
    args = p.parse_args(argv)
    if args.rows:  # rows printed by earlier runs (one per line), merged into one result file and plotted
        rows = [json.loads(line) for path in args.rows.split(",") for line in open(path, encoding="utf-8")
                if line.startswith("{")]
        config = {"cluster": "h100", "batch": BATCH_RULE, "strategy": "gpp", "variants": list(VARIANTS),
                  "merged_from": args.rows, "load_average": list(os.getloadavg())}
        write_result(args.out, "stage_parallel", config, rows)
        plot(args.out)
        return 0
    flops = preset("h100", 1).device
    graphs = {}
    for name in args.models.split(","):
        if name == "multimodal":
            graphs[name] = multimodal_graph(flops.peak_flops * flops.mfu)
        elif name == "mmt":  # the paper's multi-modal transformer as the zoo builds it, costed on the H100 it is
            # planned on (as `graphpipe plan mmt --cluster h100` costs it), not the zoo's default V100
            from graphpipe.models import load_model

            graphs[name] = load_model("mmt", flops).graph
        else:
            graphs[name] = llm_graph(name, args.graphs)
    rows = []
    for name, graph in graphs.items():
        for n in (int(x) for x in args.devices.split(",")):
            for variant in args.variants.split(","):
                row = run_one(name if not args.batch else f"{name}@b{args.batch}", graph, n, args.batch or batch_for(n), variant)
                print(json.dumps(row), flush=True)
                rows.append(row)
    config = {"cluster": "h100", "devices": args.devices, "batch": args.batch or BATCH_RULE, "strategy": "gpp",
              "variants": list(VARIANTS), "load_average": list(os.getloadavg())}
    write_result(args.out, "stage_parallel", config, rows)
    plot(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
