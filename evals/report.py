"""Generate ``REPORT.md`` from the result files (and nothing else).

Every number in the report is formatted from a result file by :func:`fmt`;
``tests/test_evals.py`` parses the report's tables back and checks they agree
with the results.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from .common import read_result

__all__ = ["fmt", "build_report", "write_report", "TABLE_COLUMNS"]

PAPER = {
    "throughput": "up to 1.6x over PipeDream and Piper; 1.25-1.61x at 32 GPUs (Fig. 6)",
    "search-time": "GraphPipe's search is 9-21x faster than Piper; Piper finds no strategy for DLRM and CANDLE-Uno (Table 1)",
    "branches": "CANDLE-Uno's gain grows with the branch count, up to 2x at 16 branches (Fig. 7)",
    "ablation": "concurrent stages alone 1.12-1.40x over SPP; full GraphPipe 1.25-1.61x (Fig. 9, 32 GPUs)",
    "case-study": "2-branch transformer on 8 devices: depth 8 -> 4, micro-batch 2 -> 4, +20% throughput (Figs. 8/10)",
    "memory": "GPP's shallower pipeline keeps fewer micro-batches in flight, so less activation memory (Sec. 3)",
    "fidelity": "(no paper figure; our target: simulator error under 20% once calibrated with `graphpipe profile`)",
    "zero-bubble": "(Zero Bubble, Qi et al. ICLR'24: ZB-H1 cuts 1F1B's bubble to a third at 1F1B's peak activation "
                   "memory; no paper schedules zero bubble on a graph of stages)",
    "async-throughput": ("PipeDream (SOSP'19): no pipeline flush, so no fill/drain bubble; 1F1B with weight stashing "
                         "keeps up to K-i weight versions on stage i of K (Sec. 3.3). PipeDream-2BW (ICML'21): "
                         "throughput of the asynchronous pipeline with only 2 weight versions per stage (Sec. 3.1)"),
    "staleness": ("PipeDream (SOSP'19, Fig. 10 and Sec. 3.3): weight stashing is needed for correct gradients and "
                  "reaches the flushing pipeline's accuracy per epoch, faster in wall-clock time; without stashing "
                  "training is inconsistent. 2BW (ICML'21, Fig. 6): its delay-1 update W(t+1) = W(t) - lr grad(W(t-1)) "
                  "matches the loss curve of synchronous training"),
    "bench_gpp": "(no paper figure; our target: gpp's `make_plan` under 1 s at 32 devices, and "
                 "16-branch candle-uno on 1024 devices under 10 s, on a 2-core machine)",
    "bench_scale": "(no paper figure; our target: `graphpipe plan MODEL --devices N --batch-size 16N` for "
                   "every zoo paper model at 128-1024 devices under 10 s and 2 GB for gpp, pipedream and gpipe, "
                   "piper finishing or stopping cleanly; no kernel kill, no traceback: "
                   "`python -m graphpipe.evals.bench_scale`)",
    "bench_llm": "(no paper figure; our target: a Llama-3-70B-shaped Hugging Face model built on the meta "
                 "device planned with `graphpipe plan ... --devices 512 --batch-size 2048 --cluster h100` (and 1024 "
                 "devices): search under 10 s, the whole cold command under 40 s: "
                 "`python -m graphpipe.evals.bench_llm --before DIR`)",
    "stage_parallel": ("published systems, their figures: Llama 3 (Dubey et al. 2024, Table 4) trains the 405B "
                       "model at 38-43% MFU on 8,192-16,384 H100s with 4D parallelism (TP 8 inside a node, PP 16, "
                       "FSDP/DP across); torchtitan (Liang et al. 2024) reports 2D (FSDP+TP) and 3D (+PP) gains over "
                       "FSDP alone for Llama 3.1 8B-405B at 8-512 GPUs, with one uniform mesh for all stages. Their "
                       "MFU counts measured model FLOPs; our efficiency is simulated throughput over the plan's own "
                       "per-sample op costs spread over every device, so the two are not the same measure"),
    "bench_llm_configs": "(no paper figure; a held-out check: Hugging Face decoders and an "
                         "encoder-decoder nobody tuned for, at their published shapes on the meta device, planned "
                         "with the same bars as Llama-3-70B: search under 10 s at 512 and 1024 devices, the whole "
                         "cold command under 40 s: `python -m graphpipe.evals.bench_llm_configs`)",
    "memory-runtime": "(no paper figure; our target: measured activation bytes within 10% of the prediction on "
                      "every device, and lower with re-materialization)",
    "stage-parallel-run": "(no paper figure; torchtitan composes pipeline stages with FSDP and TP inside them: the same "
                      "model and ranks as a pipeline only, with FSDP stages and with TP stages, measured side by side "
                      "in one run: `python -m graphpipe.evals.stage_parallel_run --out evals`)",
    "varying-shapes": "(no paper figure; torch.distributed.pipelining runs one shape only (pytorch#159942), so a "
                      "padded batch is what it trains on: the same model and lengths, each step at its own length "
                      "and padded to the longest, in one run: `python -m graphpipe.evals.varying_shapes --out evals`)",
    "rank-rss": "(no paper figure; our target: each rank's peak host RSS is its stages' state plus a fixed "
                "per-process base, for a model too big for one rank: `python -m graphpipe.evals.rank_rss --out evals`)",
    "ill-conditioned": "(no paper figure; our target: `--check` on EfficientNet-B0 and Inception-v3 at small "
                       "images and micro-batch 4 passes on correct runs and still fails a wrong gradient: "
                       "`python -m graphpipe.evals.ill_conditioned --out evals`)",
    "capture_time": "(no paper figure; `torch.export` capture of Hugging Face / timm models and meta-device Llama "
                    "shapes, medians of 3: `python -m graphpipe.evals.capture_time`)",
    "clip": "(no paper figure; a real two-tower model, Hugging Face CLIP: gpp against PipeDream, Piper, GPipe and "
            "torch.distributed.pipelining measured on CPU ranks beside the simulator, and CLIP ViT-B/16's shape "
            "simulated on 8-64 V100s: `python -m graphpipe.evals.clip_pipelines --out evals`)",
    "bench_api": "(no paper figure; our target: `graphpipe.Pipeline`'s step at >= 0.98x a plain PyTorch loop "
                 "with the same micro-batching and AdamW: `python -m graphpipe.evals.bench_api`)",
    "bench_api-bf16": "(the same at bf16, one autocast region per step in both: "
                      "`python -m graphpipe.evals.bench_api --precision bf16`)",
    "bench_api-cuda": "(our GPU targets: the API's step at >= 0.98x a plain PyTorch loop and >= 1.0x "
                      "torch.distributed.pipelining's ScheduleGPipe with one stage, on one GPU: "
                      "`python -m graphpipe.evals.bench_api --model mmt --batch-size 64 --micro-batch-size 8`)",
    "bench_api-bf16-cuda": "(the same at bf16, one autocast region per step in all three: "
                           "`python -m graphpipe.evals.bench_api --model mmt --batch-size 64 --micro-batch-size 8 "
                           "--precision bf16`)",
    "bench_api-compile": "(our target: the API with compiled stages at >= 1.0x a torch.compile'd plain loop and "
                         "above the eager API, side by side in one run: "
                         "`python -m graphpipe.evals.bench_api --compile --no-torch`)",
    "bench_api-compile-cuda": "(our GPU target: compiled API >= 1.0x a torch.compile'd plain loop on one GPU "
                              "and above eager: `bash evals/gpu_check.sh`)",
    "bench_api-compile-bf16-cuda": "(the same at bf16: `bash evals/gpu_check.sh`)",
    "bench_launch": "(no paper figure; a run's start-up on a small host: ranks spawned afresh, forked by a preloaded "
                    "forkserver, and forked and given the launcher's capture instead of exporting the model, for a "
                    "fresh `graphpipe run` command of a small model and for a later launch in one process, medians "
                    "in alternating order: `python -m graphpipe.evals.bench_launch --out evals`)",
    "overlap_sends": "(our check: receives posted one action ahead on CUDA ranks against posted at use, two GPUs: "
                     "`python -m graphpipe.evals.overlap_sends`)",
    "bench_api-torch": "(our target: >= 1.0x torch.distributed.pipelining on CPU ranks with the same "
                       "partition; other schedules run from the same CSV in torch's _PipelineScheduleRuntime: "
                       "`python -m graphpipe.evals.bench_api --ranks 4 --schedules 1f1b,zb-h1`)",
}


def fmt(value: Any, digits: int = 3) -> str:
    """The one number formatter of the report (the agreement test uses it too)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if isinstance(value, (list, tuple)):
        return "/".join(fmt(v, digits) for v in value)
    return str(value).replace("|", "/")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    return "\n".join(lines)


# Columns of each experiment's main table: (header, key in the row).
TABLE_COLUMNS: dict[str, list[tuple[str, str]]] = {
    "throughput": [("model", "model"), ("devices", "devices"), ("batch", "batch_size"), ("strategy", "strategy"),
                   ("samples/s", "throughput"), ("iteration (s)", "iteration_time_s"), ("stages", "num_stages"),
                   ("depth", "depth"), ("micro-batch", "micro_batch_sizes"), ("search (s)", "search_time_s")],
    "search-time": [("kind", "kind"), ("model", "model"), ("devices", "devices"), ("strategy", "strategy"),
                    ("search time (s)", "search_time_s"), ("repeats", "repeats"), ("feasible", "feasible")],
    "branches": [("series", "series"), ("branches", "branches"), ("devices", "devices"), ("strategy", "strategy"),
                 ("samples/s", "throughput"), ("depth", "depth"), ("micro-batch", "micro_batch_sizes")],
    "ablation": [("model", "model"), ("variant", "variant"), ("samples/s", "throughput"), ("x best SPP", "speedup"),
                 ("depth", "depth"), ("micro-batch", "micro_batch_sizes")],
    "case-study": [("strategy", "strategy"), ("depth", "depth"), ("stages", "num_stages"),
                   ("micro-batch", "micro_batch_sizes"), ("samples/s", "throughput"), ("iteration (s)", "iteration_time_s")],
    "memory": [("model", "model"), ("strategy", "strategy"), ("peak GB (fullest device)", "peak_memory_gb"),
               ("max in-flight", "max_in_flight"), ("depth", "depth"), ("samples/s", "throughput")],
    "fidelity": [("model", "model"), ("strategy", "strategy"), ("schedule", "schedule"), ("devices", "devices"),
                 ("predicted (s)", "predicted_s"), ("measured (s)", "measured_s"), ("error", "error_frac"),
                 ("memory error", "memory_error_frac")],
    "zero-bubble": [("model", "model"), ("devices", "devices"), ("schedule", "schedule"), ("samples/s", "throughput"),
                    ("gain", "gain"), ("bubble", "mean_bubble_fraction"), ("peak GB", "peak_memory_gb"),
                    ("memory ratio", "memory_ratio"), ("max in-flight", "max_in_flight"), ("depth", "depth"),
                    ("cpsat gap", "cpsat_gap")],
    "async-throughput": [("source", "source"), ("model", "model"), ("devices", "devices"), ("schedule", "schedule"),
                         ("samples/s", "throughput"), ("x 1f1b", "x_1f1b"), ("peak GB", "peak_memory_gb"),
                         ("stashed GB (fullest device)", "stashed_gb"), ("replicated stage", "replicated")],
    "staleness": [("schedule", "schedule"), ("first loss", "first_loss"), ("final loss (last 10%)", "final_loss"),
                  ("wall-clock (s)", "wall_clock_s"), ("steady iteration (ms)", "steady_iteration_ms"),
                  ("stashed bytes (fullest device)", "stashed_weight_bytes"),
                  ("predicted peak bytes", "peak_memory_bytes_predicted")],
    "bench_gpp": [("case", "case"), ("devices", "devices"), ("batch", "batch_size"),
                  ("before median (s)", "before_median_s"), ("after median (s)", "after_median_s"),
                  ("after min-max (s)", "after_range_s"), ("speedup", "speedup"), ("calls before", "before_calls"),
                  ("calls after", "after_calls"), ("same plan throughput", "same_throughput")],
    "bench_scale": [("model", "model"), ("strategy", "strategy"), ("devices", "devices"), ("batch", "batch_size"),
                    ("median search (s)", "median_search_s"), ("min-max (s)", "search_range_s"), ("runs", "runs"),
                    ("peak RSS (GB)", "peak_rss_gb"), ("outcome", "outcome"), ("samples/s", "throughput")],
    "stage-parallel-run": [("layout", "layout"), ("tp", "tp"), ("shard", "shard"), ("iteration (s)", "iteration_s"),
                       ("samples/s", "samples_per_s"), ("vs pipeline only", "vs_pp"),
                       ("params per rank", "params_per_rank"), ("reps (s)", "reps_s")],
    "varying-shapes": [("steps", "mode"), ("time per real token (us)", "us_per_token"),
                       ("padded / this", "padded_over_this"), ("real tokens", "tokens"),
                       ("reps (us per token)", "reps_us_per_token")],
    "rank-rss": [("layout", "layout"), ("rank", "rank"), ("stages", "stages"), ("peak RSS (MB)", "rss_mb"), ("expected (MB)", "expected_mb"),
                 ("stages' weights+grads+activations (MB)", "stage_state_mb"),
                 ("stages' weights+grads unsharded (MB)", "whole_stage_state_mb"),
                 ("RSS - tiny model's rank (MB)", "rss_minus_tiny_mb"), ("error vs expected", "error_vs_expected")],
    "ill-conditioned": [("model", "model"), ("check", "variant"), ("verdict", "verdict"), ("expected", "expected"),
                        ("max abs diff", "max_abs_diff"), ("mismatched elements", "mismatches"),
                        ("reference's fp32-vs-fp64 spread", "fp64_spread"),
                        ("eager fp32-vs-fp64", "eager_spread")],
    "bench_llm": [("measure", "measure"), ("devices", "devices"), ("batch", "batch_size"), ("runs", "repeat"),
                  ("before wall (s)", "before_median_wall_s"), ("after wall (s)", "after_median_wall_s"),
                  ("wall ratio", "ratio_wall_s"), ("before CPU (s)", "before_median_cpu_s"),
                  ("after CPU (s)", "after_median_cpu_s"), ("CPU ratio", "ratio_cpu_s"),
                  ("before search (s)", "before_median_search_s"), ("after search (s)", "after_median_search_s"),
                  ("search ratio", "ratio_search_s"), ("same plan", "same_plan")],
    "stage_parallel": [("model", "model"), ("devices", "devices"), ("batch", "batch_size"), ("variant", "variant"),
                       ("efficiency", "efficiency"), ("= used", "used_share"), ("x balance", "balance"),
                       ("x busy", "busy_share"), ("devices used", "devices_used"), ("stages", "stages"),
                       ("layouts", "layouts"), ("peak memory (GB)", "peak_memory_gb"),
                       ("search CPU (s)", "search_cpu_s"), ("outcome", "outcome")],
    "bench_llm_configs": [("config", "config"), ("devices", "devices"), ("runs", "runs"),
                          ("cold wall (s)", "median_wall_s"), ("cold CPU (s)", "median_cpu_s"),
                          ("search (s)", "median_search_s"), ("peak RSS (GB)", "median_peak_rss_gb"),
                          ("stages", "stages"), ("repeated blocks cut", "shortcut"), ("outcome", "outcome"),
                          ("command", "command")],
    "memory-runtime": [("model", "model"), ("strategy", "strategy"), ("schedule", "schedule"),
                       ("recompute", "recompute"), ("check", "check"), ("measured KB (fullest device)", "measured_kb"),
                       ("predicted KB", "predicted_kb"), ("memory error (worst device)", "memory_error"),
                       ("below none", "below_none")],
    "capture_time": [("case", "case"), ("capture (s)", "capture_s"), ("of which export (s)", "export_s"),
                     ("ops", "ops"), ("parameter bytes", "param_bytes"), ("max RSS (GB)", "max_rss_gb")],
    "clip": [("part", "part"), ("strategy", "strategy"), ("devices", "devices"), ("batch", "batch_size"),
             ("stages", "stages"), ("depth", "depth"), ("measured samples/s", "measured_throughput"),
             ("simulated samples/s", "predicted_throughput")],
    "bench_api": [("model", "model"), ("precision", "precision"), ("device", "device"), ("batch", "batch_size"),
                  ("micro-batch", "micro_batch_size"), ("API ms/step", "api_ms"), ("loop ms/step", "loop_ms"),
                  ("API / loop throughput", "throughput_ratio")],
    "bench_api-torch": [("schedule", "schedule"), ("ranks", "ranks"), ("torch runs", "torch_runs"),
                        ("ours ms", "ours_median_ms"), ("torch ms", "torch_median_ms"),
                        ("ours / torch throughput", "throughput_ratio")],
}
TABLE_COLUMNS["bench_api-bf16"] = TABLE_COLUMNS["bench_api"]
TABLE_COLUMNS["bench_api-cuda"] = TABLE_COLUMNS["bench_api"][:2] + [("GPU", "device_name"), ("torch", "torch_version")] + \
    TABLE_COLUMNS["bench_api"][3:] + [("torch 1-stage ms/step", "torch_ms"), ("API / torch throughput", "throughput_ratio_vs_torch")]
TABLE_COLUMNS["bench_api-bf16-cuda"] = TABLE_COLUMNS["bench_api-cuda"]
TABLE_COLUMNS["bench_api-compile"] = TABLE_COLUMNS["bench_api"][:3] + [("torch", "torch_version")] + \
    TABLE_COLUMNS["bench_api"][3:] + [("API compiled ms/step", "api_compiled_ms"), ("loop compiled ms/step", "loop_compiled_ms"),
                                      ("compiled API / compiled loop", "compiled_api_vs_compiled_loop"),
                                      ("compiled API / eager API", "compiled_api_vs_eager_api")]
TABLE_COLUMNS["bench_api-compile-cuda"] = TABLE_COLUMNS["bench_api-compile"]
TABLE_COLUMNS["bench_api-compile-bf16-cuda"] = TABLE_COLUMNS["bench_api-compile"]
TABLE_COLUMNS["bench_launch"] = [("launch", "launch"), ("start method", "start_method"), ("ranks", "ranks"),
                                 ("median (s)", "median_s"), ("min-max (s)", "range_s"), ("runs", "runs")]
TABLE_COLUMNS["overlap_sends"] = [("model", "model"), ("GPU", "device_name"), ("batch", "batch_size"),
                                  ("posted early ms", "early_ms"), ("posted at use ms", "at_use_ms"),
                                  ("gain (at use / early)", "gain_ratio"), ("same loss", "losses_equal")]
BENCH_API = ("bench_api", "bench_api-bf16", "bench_api-cuda", "bench_api-bf16-cuda")
COMPILED = ("bench_api-compile", "bench_api-compile-cuda", "bench_api-compile-bf16-cuda")


def _cli_line(res: dict[str, Any]) -> str:
    """bench_scale's whole-command figures (``--cli``): cold (no graph cache) and cached medians per model."""
    cli = [r for r in res["config"].get("cli") or [] if "median_wall_s" in r]
    if not cli:
        return ""
    worst = max(cli, key=lambda r: r["median_wall_s"])
    cold = [r for r in cli if r.get("median_cold_wall_s") is not None]
    worst_cold = max(cold, key=lambda r: r["median_cold_wall_s"]) if cold else None
    counts = sorted({r["devices"] for r in cli})
    return (f". Whole `graphpipe plan` at {', '.join(map(str, counts))} devices (table below): with the model's "
            f"graph cached, "
            f"medians {fmt(min(r['median_wall_s'] for r in cli))}-{fmt(worst['median_wall_s'])} s (slowest "
            f"{worst['model']} {worst['strategy']})"
            + (f"; capturing the model first (no cache), slowest median {worst_cold['model']} {worst_cold['strategy']} "
               f"{fmt(worst_cold['median_cold_wall_s'])} s" if worst_cold else ""))


CLI_COLUMNS = [("model", "model"), ("strategy", "strategy"), ("devices", "devices"),
               ("cold median (s)", "median_cold_wall_s"), ("cold max (s)", "max_cold_wall_s"),
               ("cached median (s)", "median_wall_s"), ("cached max (s)", "max_wall_s"), ("exit", "rc"),
               ("search (s)", "search_s")]


def _rows_for_table(name: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [dict(r) for r in res["rows"]]
    if name == "memory":
        for r in rows:
            r["peak_memory_gb"] = r["peak_memory_bytes"] / 1e9 if r.get("peak_memory_bytes") else None
    if name == "bench_gpp":
        for r in rows:
            r["after_range_s"] = [r["after_min_s"], r["after_max_s"]] if "after_min_s" in r else None
    if name == "bench_scale":
        for r in rows:
            r["search_range_s"] = [r["min_search_s"], r["max_search_s"]]
    if name in BENCH_API + COMPILED:
        for r in rows:
            r["api_ms"], r["loop_ms"] = r["api_step_s"] * 1e3, r["loop_step_s"] * 1e3
            r["torch_ms"] = r["torch_step_s"] * 1e3 if "torch_step_s" in r else None
    if name in COMPILED:
        for r in rows:
            r["api_compiled_ms"], r["loop_compiled_ms"] = r["api_compiled_step_s"] * 1e3, r["loop_compiled_step_s"] * 1e3
    if name == "overlap_sends":
        for r in rows:
            r["early_ms"], r["at_use_ms"] = r["early_median_s"] * 1e3, r["at_use_median_s"] * 1e3
    if name == "memory-runtime":
        for r in rows:
            r["measured_kb"], r["predicted_kb"] = r["peak_measured_bytes"] / 1e3, r["peak_predicted_bytes"] / 1e3
    return rows


def _errors(res: dict[str, Any]) -> list[str]:
    seen, out = set(), []
    for r in res["rows"]:
        if r.get("error") and r["error"] not in seen:
            seen.add(r["error"])
            tag = ", ".join(str(r[k]) for k in ("model", "config", "strategy", "variant") if r.get(k))
            out.append(f"- {tag}: {r['error']}")
    return out


def _headline(name: str, res: dict[str, Any]) -> str:
    s = res.get("summary") or {}
    if name == "bench_launch":
        by = {(r["launch"], r["start_method"]): r["median_s"] for r in res["rows"]}
        ways = ", ".join(f"{'a fresh `graphpipe run`' if w == 'command' else 'a later launch in one process'} "
                         f"{fmt(by[(w, 'spawn')])} / {fmt(by[(w, 'forkserver')])} / {fmt(by[(w, 'shipped')])} s "
                         f"({fmt(s[f'{w}_spawn_over_shipped'])}x / {fmt(s[f'{w}_forkserver_over_shipped'])}x)"
                         for w in ("command", "repeated"))
        return (f"{res['config']['spec']} on {res['config']['ranks']} CPU ranks, 2 steps, spawned / forked / forked "
                f"with the launcher's capture shipped (ratios to shipped): {ways}")
    if name == "stage-parallel-run":
        by = {r["layout"]: r for r in res["rows"]}
        c = res["config"]
        return (f"{c['blocks']} MLP blocks of width {c['width']}, 2 stages x 2 CPU ranks, batch {c['batch']}: "
                f"pipeline only {fmt(by['pp']['samples_per_s'])} samples/s, with FSDP stages "
                f"{fmt(by['pp-fsdp']['samples_per_s'])} ({fmt(by['pp-fsdp']['vs_pp'])}x) resharded per op"
                + (f", {fmt(by['pp-fsdp-step']['samples_per_s'])} ({fmt(by['pp-fsdp-step']['vs_pp'])}x) gathered "
                   "once per step" if "pp-fsdp-step" in by else "") +
                f", with TP 2 stages "
                f"{fmt(by['pp-tp']['samples_per_s'])} ({fmt(by['pp-tp']['vs_pp'])}x), each sharded rank holding "
                f"half its stage's parameters (median of {c['reps']} interleaved reps)")
    if name == "varying-shapes":
        by = {r["mode"]: r for r in res["rows"]}
        c = res["config"]
        return (f"{c['blocks']} MLP blocks of width {c['width']} per token, 2 stages on 2 CPU ranks, batch {c['batch']}, "
                f"lengths drawn in {c['lengths'][0]}..{c['lengths'][1]}: each step at its own length "
                f"{fmt(by['varying']['us_per_token'])} us per real token, padded to {c['lengths'][1]} "
                f"{fmt(by['padded']['us_per_token'])} us ({fmt(by['varying']['padded_over_this'])}x faster unpadded; "
                f"median of {c['reps']} interleaved reps). Shape work per step on a rank: "
                f"{fmt(s['bind_us'])} us to bind and check the step's sizes, {fmt(s['size_values_us'])} us to size "
                f"the values crossing the cut at a new length, {fmt(s['partial_routing_us'])} us to route a new "
                f"partial batch (both cached after)")
    if name == "rank-rss":
        rows = [r for r in res["rows"] if r.get("layout", "pipeline") == "pipeline"]
        text = (f"{res['config']['spec']} ({fmt(s['whole_model_weight_bytes'] / 1e6)} MB of weights, too big for one "
                f"device of {res['config']['memory_gb']} GB) on {len(rows)} CPU ranks: peak RSS "
                f"{fmt(min(r['rss_mb'] for r in rows))}-{fmt(max(r['rss_mb'] for r in rows))} MB per rank, a tiny "
                f"model's rank {fmt(s['tiny_rank_median_bytes'] / 1e6)} MB; measured within "
                f"{fmt(100 * max(abs(r['error_vs_expected']) for r in rows))}% of the launcher's estimate")
        if s.get("fsdp_share"):
            text += (f". As two FSDP stages of two ranks, each rank's RSS above the tiny rank is "
                     f"{fmt(min(s['fsdp_share']))}-{fmt(max(s['fsdp_share']))} of its stage's unsharded weights and "
                     "gradients (0.5 if it held exactly its half)")
        if s.get("unet_max_error_vs_expected") is not None:
            text += (f"; a diffusers UNet on 3 ranks within {fmt(100 * s['unet_max_error_vs_expected'])}% of the "
                     "estimate")
        return text
    if name == "ill-conditioned":
        return (f"{s['as_expected']}/{s['runs']} `graphpipe run --check` runs gave the expected verdict on "
                f"{res['config']['ranks']} CPU ranks (batch {res['config']['batch_size']}, micro-batch "
                f"{res['config']['micro_batch_size']}): correct runs PASSED, the wrong gradient FAILED")
    if name == "throughput":
        ups = [x for x in s.get("speedup_vs_best_spp", []) if x["speedup"]]
        if not ups:
            return "no feasible gpp/SPP pair"
        top_n = max(x["devices"] for x in ups)
        at_top = [x for x in ups if x["devices"] == top_n]
        parts = ", ".join(f"{x['model']} {fmt(x['speedup'])}x (vs {x['best_spp']})" for x in at_top)
        return f"gpp / best SPP at {top_n} devices: {parts}; over all points {fmt(min(x['speedup'] for x in ups))}-{fmt(max(x['speedup'] for x in ups))}x"
    if name == "search-time":
        ratios = [x for x in s.get("baseline_over_gpp", []) if x["baseline"] == "piper" and x["ratio"]]
        if not ratios:
            return "piper did not finish on any configuration (refused past its downset limit)"
        return "piper / gpp search time: " + ", ".join(f"{x['model']} @{x['devices']} {fmt(x['ratio'])}x" for x in ratios)
    if name == "branches":
        norm = [x for x in s.get("normalised_to_pipedream", []) if x["series"] == "candle-uno" and x["strategy"] == "gpp"]
        return "candle-uno gpp / pipedream: " + ", ".join(f"{x['branches']} branches {fmt(x['normalised'])}x" for x in norm)
    if name == "case-study":
        if not s:
            return "one of the plans was infeasible"
        return (f"depth {s['depth_spp']} -> {s['depth_gpp']}, micro-batch {fmt(s['micro_batch_spp'])} -> "
                f"{fmt(s['micro_batch_gpp'])}, throughput x{fmt(s['throughput_gain'])}")
    if name == "fidelity":
        return (f"median |predicted - measured| / measured = {fmt(s.get('median_error'))}"
                + (f"; activation memory: worst device per plan, median {fmt(s['median_memory_error'])}"
                   if s.get("median_memory_error") is not None else ""))
    if name == "zero-bubble":
        gains = [x for x in s.get("gain_over_reference", []) if x["gain"]]
        if not gains:
            return "no feasible pair"
        top_n = max(x["devices"] for x in gains)
        parts = ", ".join(f"{x['model']} {x['schedule']} {fmt(x['gain'])}x (memory x{fmt(x['memory_ratio'])})"
                          for x in gains if x["devices"] == top_n)
        return (f"throughput over graph-1f1b (zb-h1: over 1f1b) at {top_n} devices: {parts}; over all points "
                f"{fmt(min(x['gain'] for x in gains))}-{fmt(max(x['gain'] for x in gains))}x")
    if name == "async-throughput":
        measured = ", ".join(f"{m} {fmt(x)}x" for m, x in (s.get("async_over_flush_measured") or {}).items())
        return (f"simulated 1f1b-async / 1f1b >= {fmt(s.get('min_async_over_flush_simulated'))}x at every point; "
                f"measured on 4 CPU ranks: {measured}")
    if name == "staleness":
        return "final loss: " + ", ".join(f"{k} {fmt(v)}" for k, v in (s.get("final_loss") or {}).items()) + \
            "; wall-clock speed vs 1f1b: " + ", ".join(f"{k} {fmt(v)}x" for k, v in (s.get("speed_vs_flush") or {}).items())
    if name == "bench_gpp":
        rows = [r for r in res["rows"] if r.get("speedup")]
        if not rows:
            return "no side-by-side rows (run with --before)"
        return ("gpp `make_plan` time, before / after (medians, side by side): "
                + ", ".join(f"{r['case']} {fmt(r['before_median_s'])} / {fmt(r['after_median_s'])} s" for r in rows)
                + f"; load average during the run {fmt(list(res['config'].get('load_average') or []))}")
    if name == "bench_scale":
        rows = res["rows"]
        top = max(r["devices"] for r in rows)
        slowest = max((r for r in rows if r["strategy"] != "piper"), key=lambda r: r["median_search_s"], default=None)
        bad = [r for r in rows if r["outcome"] in ("timeout", "killed", "traceback")]
        return (f"largest median search of gpp, pipedream and gpipe: {fmt(slowest and slowest['median_search_s'])} s "
                f"({slowest and slowest['model']} {slowest and slowest['strategy']} at {slowest and slowest['devices']} "
                f"devices); largest peak RSS {fmt(max(r['peak_rss_gb'] for r in rows))} GB; "
                f"{sum(r['outcome'] == 'ok' for r in rows)} plans, {sum(r['outcome'] == 'refused' for r in rows)} "
                f"one-line refusals, {len(bad)} timeouts, kills or tracebacks (up to {top} devices); load average "
                f"during the run {fmt(list(res['config'].get('load_average') or []))}" + _cli_line(res))
    if name == "bench_llm":
        return ("before / after, medians side by side (wall; CPU): " + ", ".join(
            f"{r['measure']} at {r['devices']} devices {fmt(r['before_median_wall_s'])} / "
            f"{fmt(r['after_median_wall_s'])} s; {fmt(r['before_median_cpu_s'])} / {fmt(r['after_median_cpu_s'])} s"
            for r in res["rows"]) + f"; load average during the run {fmt(list(res['config'].get('load_average') or []))}")
    if name == "stage_parallel":
        ok = [r for r in res["rows"] if r["outcome"] == "ok"]
        parts = []
        for model in dict.fromkeys(r["model"] for r in ok):
            for n in sorted({r["devices"] for r in ok if r["model"] == model}):
                by = {r["variant"]: r for r in ok if r["model"] == model and r["devices"] == n}
                if "per-stage" in by and "pp-only" in by:
                    parts.append(f"{model} at {n}: {fmt(by['per-stage']['efficiency'])} "
                                 f"({fmt(by['per-stage']['efficiency'] / by['pp-only']['efficiency'])}x PP-only's "
                                 f"{fmt(by['pp-only']['efficiency'])}"
                                 + (f", uniform {fmt(by['uniform']['efficiency'])}" if "uniform" in by else "") + ")")
        return "simulated efficiency, per-stage layouts (x PP-only): " + "; ".join(parts)
    if name == "bench_llm_configs":
        rows = res["rows"]
        ok = [r for r in rows if r["outcome"] == "ok"]
        worst_search = max(ok, key=lambda r: r["median_search_s"], default=None)
        worst_cold = max(ok, key=lambda r: r["median_cpu_s"], default=None)
        return (f"{len(ok)}/{len(rows)} plans ({len({r['config'] for r in rows})} configurations); longest median "
                f"search {fmt(worst_search and worst_search['median_search_s'])} s "
                f"({worst_search and worst_search['config']} at {worst_search and worst_search['devices']} devices), "
                f"longest cold command {fmt(worst_cold and worst_cold['median_cpu_s'])} CPU s "
                f"({worst_cold and worst_cold['config']}), largest peak RSS "
                f"{fmt(max((r['median_peak_rss_gb'] for r in rows), default=None))} GB; repeated blocks cut in "
                f"{sum(r['shortcut'].startswith('yes') for r in rows)}/{len(rows)}; load average during the run "
                f"{fmt(list(res['config'].get('load_average') or []))}")
    if name == "memory-runtime":
        if not s.get("runs"):
            return "no run"
        return (f"{s['within_10pct']}/{s['runs']} runs within 10% of the predicted activation bytes on every device "
                f"(worst {fmt(s['worst_memory_error'])}, {s['worst_run']}); --check passed in "
                f"{s['checks_passed']}/{s['runs']}; recompute all below none on the fullest device in "
                f"{s['all_below_none']}/{s['pairs']} plan pairs")
    if name in BENCH_API:
        r = res["rows"][0]
        text = f"the API's training step at {fmt(r['throughput_ratio'])}x the plain loop's throughput"
        if "throughput_ratio_vs_torch" in r:
            text += f" and {fmt(r['throughput_ratio_vs_torch'])}x torch's one-stage ScheduleGPipe"
        where = r.get("device_name", r["device"])
        where += f", torch {r['torch_version']}" if "torch_version" in r else ""
        return text + f" ({r['precision']} on {where}, median of {r['steps']} steps in alternating order)"
    if name in COMPILED:
        r = res["rows"][0]
        return (f"compiled stages at {fmt(r['compiled_api_vs_compiled_loop'])}x a torch.compile'd plain loop's "
                f"throughput, {fmt(r['compiled_api_vs_eager_api'])}x the eager API and "
                f"{fmt(r['compiled_api_vs_eager_loop'])}x the eager loop ({r['precision']} on "
                f"{r.get('device_name', r['device'])}, torch {r['torch_version']}, median of {r['steps']} steps in "
                "alternating order)")
    if name == "overlap_sends":
        r = res["rows"][0]
        return (f"receives posted one action ahead: {fmt(r['gain_ratio'])}x the step throughput of posting them at "
                f"use (2 x {r['device_name']}, median of {r['steps_each']} alternating steps each; same loss: "
                f"{r['losses_equal']})")
    if name == "bench_api-torch":
        return "; ".join(f"{r['schedule']}: ours {fmt(r['throughput_ratio'])}x torch ({r['ranks']} CPU ranks, median "
                         f"of {r['rounds']} paired rounds)" for r in res["rows"])
    if name == "clip":
        cpu = {r["strategy"]: r for r in res["rows"] if r["part"] == "cpu" and "measured_throughput" in r}
        top = max((r["devices"] for r in res["rows"] if r["part"] == "paper"), default=None)
        paper = {r["strategy"]: r for r in res["rows"] if r["part"] == "paper" and r["devices"] == top
                 and "predicted_throughput" in r}
        if "gpp" not in cpu:
            return "gpp did not run"
        text = "measured on CPU ranks, gpp / " + ", ".join(
            f"{k} {fmt(cpu['gpp']['measured_throughput'] / r['measured_throughput'])}x" for k, r in cpu.items() if k != "gpp")
        if "gpp" in paper:
            text += f"; simulated at {top} V100s, gpp / " + ", ".join(
                f"{k} {fmt(paper['gpp']['predicted_throughput'] / r['predicted_throughput'])}x"
                for k, r in paper.items() if k != "gpp")
        return text
    if name == "capture_time":
        return "; ".join(f"{r['case']} {fmt(r['capture_s'])} s" for r in res["rows"])
    if name == "ablation":
        parts = []
        for r in res["rows"]:
            if r["variant"] != "best spp" and r.get("speedup"):
                parts.append(f"{r['model']} {r['variant']} {fmt(r['speedup'])}x")
        return "; ".join(parts)
    return ""


def build_report(out: str, notes: dict[str, str] | None = None) -> str:
    notes = notes or {}
    quick = any((read_result(out, name) or {}).get("config", {}).get("quick") for name in TABLE_COLUMNS)
    command = "graphpipe eval all --quick" if quick else "graphpipe eval all --out evals"  # evals: the committed one
    sections = ["# graphpipe evaluation report", "",
                f"Generated by `{command}` from the result files in `results/`; every number below is "
                "read from them (a test checks this). Simulated figures use the `v100` cluster preset "
                "(the paper's Summit nodes) unless a section says otherwise.", ""]
    env = None
    for name in TABLE_COLUMNS:
        res = read_result(out, name)
        if res is None:
            continue
        env = env or res["environment"]
        cols = TABLE_COLUMNS[name]
        sections += [f"## {name}", "", f"**Paper:** {PAPER[name]}", "", f"**Ours:** {_headline(name, res)}", ""]
        if os.path.exists(os.path.join(out, f"{name}.png")):
            sections += [f"![{name}]({name}.png)", ""]
        if os.path.exists(os.path.join(out, f"{name}-gantt.png")):
            sections += [f"![{name} Gantt charts]({name}-gantt.png)", ""]
        sections += [_table([c[0] for c in cols], ([r.get(c[1]) for c in cols] for r in _rows_for_table(name, res))), ""]
        if name == "bench_scale" and res["config"].get("cli"):
            sections += ["Whole `graphpipe plan` command (wall time, Python start and exit included; cold: "
                         "`GRAPHPIPE_CACHE_DIR=off`, the model captured with torch.export in each run):", "",
                         _table([c[0] for c in CLI_COLUMNS], ([r.get(c[1]) for c in CLI_COLUMNS]
                                                              for r in res["config"]["cli"])), ""]
        errors = _errors(res)
        if errors:
            sections += ["Refusals and failures:", ""] + errors + [""]
        if notes.get(name):
            sections += ["**Where we differ and why:** " + notes[name], ""]
        sections += [f"Config: `{_config_line({k: v for k, v in res['config'].items() if k != 'cli'})}`", ""]
    if env:
        sections += ["## environment", "", _table(["key", "value"], sorted(env.items())), ""]
    return "\n".join(sections)


def _config_line(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def write_report(out: str, notes: dict[str, str] | None = None) -> str:
    path = os.path.join(out, "REPORT.md")
    text = build_report(out, notes)
    from graphpipe.files import write_text_atomic

    write_text_atomic(path, text)
    return path
