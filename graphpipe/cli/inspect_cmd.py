"""``graphpipe inspect MODEL [--json]``: what the planner will see of a model.

Prints the op table (id, name, kind, forward/backward seconds per sample at
micro-batch size 1, i.e. ``t(1) = alpha + beta``, parameter and activation
bytes; for a zoo or factory model a note says what alpha and beta are made of:
with the analytical costs alpha, the device's fixed cost per layer call, is the
same for every op and dominates small ones), the edge count, totals, whether the graph is series-parallel (the
shape GraphPipe's partitioner needs, docs/design.md, "Series-parallel decomposition") and how many parallel
branches its widest parallel node has. A non-SP graph is reported as such,
with the regions that planning would contract.

Examples::

    graphpipe inspect data/pipedream-profiles/resnet50
    graphpipe inspect mmt:small --json
    graphpipe inspect model.json --device a100
"""

from __future__ import annotations

import sys
from typing import Any

from graphpipe.cli.common import add_capture_arguments, add_model_argument, load_model, print_json
from graphpipe.graph import OpGraph

__all__ = ["register", "inspect_summary"]


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a model's op graph, costs and series-parallel structure",
                       description="Print the op graph of MODEL: ops with per-sample costs at micro-batch 1, "
                                   "totals, series-parallel or not, number of parallel branches.")
    add_model_argument(p)
    add_capture_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--device", default="v100", metavar="CLUSTER",
                   help="device preset (v100, a100, h100, cpu) or cluster JSON for the analytical costs of "
                        "zoo/factory models (default v100)")
    p.add_argument("--pipedream-batch-size", type=int, default=128, metavar="B",
                   help="batch size a PipeDream profile was taken at (default 128, the published image profiles')")
    p.set_defaults(func=run)


def inspect_summary(graph: OpGraph) -> dict[str, Any]:
    """The facts ``inspect`` reports about ``graph``, as one JSON-ready dict."""
    from graphpipe.costs import tp_rule
    from graphpipe.sp import decompose, is_series_parallel, num_branches

    series_parallel = is_series_parallel(graph)
    tree = decompose(graph)
    all_ops = range(graph.num_ops)
    return {
        "name": graph.name,
        "num_ops": graph.num_ops,
        "num_edges": graph.num_edges,
        "num_sources": len(graph.sources()),
        "num_sinks": len(graph.sinks()),
        "param_bytes": graph.param_bytes,
        "fwd_s_per_sample": graph.fwd_time(all_ops, 1),
        "bwd_s_per_sample": graph.bwd_time(all_ops, 1),
        "act_bytes_per_sample": sum(op.act_bytes for op in graph.ops),
        "series_parallel": series_parallel,
        "num_branches": num_branches(tree),
        "num_ops_after_contraction": tree.graph.num_ops,
        "merged": {name: list(names) for name, names in tree.merged.items()},
        "batchnorm_ops": [op.name for op in graph.ops if op.batchnorm],
        "ops": [
            {"id": i, "name": op.name, "kind": op.kind, "fwd_s": op.fwd(1), "bwd_s": op.bwd(1),
             "param_bytes": op.param_bytes, "act_bytes": op.act_bytes, "out_bytes": op.out_bytes,
             "preds": list(graph.preds(i)), "succs": list(graph.succs(i)),
             "tp": _BATCHNORM_CELL if op.batchnorm else _tp_cell(tp_rule(op.kind, op.param_bytes))}
            for i, op in enumerate(graph.ops)
        ],
    }


_BATCHNORM_CELL = "replicated: holds a BatchNorm (the model plans tp 1, shard none)"
"""An op with BatchNorm: its statistics merge over whole copies only, so the whole model plans without layouts."""


def _tp_cell(rule: tuple[int, int, str]) -> str:
    """How tensor parallelism treats an op: ``split, F/B all-reduces a/b``, or why it is replicated."""
    forward, backward, why = rule
    return why or f"split, {forward}/{backward} all-reduces (forward/backward)"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def _table(summary: dict[str, Any]) -> str:
    ops = summary["ops"]
    name_w = max([4] + [len(o["name"]) for o in ops])
    kind_w = max([4] + [len(o["kind"]) for o in ops])
    lines = [f"{'id':>5}  {'name':<{name_w}}  {'kind':<{kind_w}}  {'fwd s/sample':>12}  {'bwd s/sample':>12}  "
             f"{'params':>11}  {'act/sample':>11}  tensor parallel"]
    for o in ops:
        lines.append(f"{o['id']:>5}  {o['name']:<{name_w}}  {o['kind']:<{kind_w}}  {o['fwd_s']:>12.4g}  "
                     f"{o['bwd_s']:>12.4g}  {_bytes(o['param_bytes']):>11}  {_bytes(o['act_bytes']):>11}  {o['tp']}")
    s = summary
    lines += [
        "",
        f"model              {s['name']}",
        f"ops                {s['num_ops']}",
        f"edges              {s['num_edges']}",
        f"sources / sinks    {s['num_sources']} / {s['num_sinks']}",
        f"parameters         {_bytes(s['param_bytes'])} ({s['param_bytes']:.0f} bytes)",
        f"forward / sample   {s['fwd_s_per_sample']:.6g} s (at micro-batch 1)",
        f"backward / sample  {s['bwd_s_per_sample']:.6g} s (at micro-batch 1)",
        f"series-parallel    {'yes' if s['series_parallel'] else 'no'}",
        f"parallel branches  {s['num_branches']}",
    ]
    if s["batchnorm_ops"]:
        first = s["batchnorm_ops"][0]
        lines.append(f"layouts            whole copies only (tp 1, shard none): {len(s['batchnorm_ops'])} op(s) hold a "
                     f"BatchNorm ({first}{', ...' if len(s['batchnorm_ops']) > 1 else ''})")
    if s["merged"]:
        lines.append(f"planning contracts {len(s['merged'])} non-SP region(s) -> {s['num_ops_after_contraction']} ops:")
        for name, names in s["merged"].items():
            lines.append(f"  {name}: {' '.join(names)}")
    return "\n".join(lines)


CAPTURE_PRECISION_NOTE = {
    "fp32": ("traced at fp32 (torch.export runs the module's code once); a bf16 run traces its own program under "
             "bf16 torch.autocast, so code reading a tensor's dtype (torch.finfo(h.dtype), a branch on h.dtype) "
             "takes its bf16 path there (graphpipe.frontend.export_inputs.traced_at)"),
    "bf16": ("traced at bf16 under torch.autocast, as the run replays it: code reading a tensor's dtype "
             "(torch.finfo(h.dtype), a branch on h.dtype) is recorded as it runs at bf16; activation bytes measured "
             "at bf16"),
}
"""What ``inspect`` says about the precision a captured module's program was traced at."""


def run(args) -> int:
    from graphpipe.cluster import load_cluster

    device = load_cluster(args.device, 1).device
    source = load_model(args.model, device=device, pipedream_batch_size=args.pipedream_batch_size,
                        precision=args.precision or "fp32", granularity=args.granularity)
    summary = inspect_summary(source.graph)
    summary = {"model_id": source.model_id, "source": source.kind, **summary}
    if source.kind in ("factory", "zoo"):  # a module captured here: the precision its program was traced at
        summary["notes"] = [CAPTURE_PRECISION_NOTE[args.precision or "fp32"]]
    if source.kind == "pipedream":
        from graphpipe.importers.pipedream_txt import read_zeroed_inputs

        summary["notes"] = [f"Input node {node}'s forward time {fwd:g} ms (data loading) was zeroed, as the real "
                            f"PipeDream optimizer does" + (f"; backward {bwd:g} ms too" if bwd else "")
                            for node, fwd, bwd in read_zeroed_inputs(args.model)]
    if source.kind in ("zoo", "factory"):  # analytical costs: say what the per-op figure is made of
        alpha = device.op_overhead_s
        flat = sum(abs(o["fwd_s"] - alpha) < 0.1 * alpha for o in summary["ops"])
        summary.setdefault("notes", []).append(
            f"fwd s/sample is the analytical t(1) = alpha + beta: alpha = {alpha:g} s, {device.name}'s fixed cost of "
            f"one layer call (--device), the same for every op, plus beta = the op's FLOPs per sample / "
            f"({device.peak_flops:.3g} FLOP/s x mfu {device.mfu:g}); bwd is twice that"
            + (f". At this size alpha is most of it for {flat} of {len(summary['ops'])} ops, so they read alike"
               if flat > len(summary["ops"]) // 2 else "")
            + "; `graphpipe profile` measures the ops instead")
    if args.json:
        print_json(summary)
    else:
        sys.stdout.write(_table(summary) + "\n" + "".join(f"note: {n}\n" for n in summary.get("notes", ())))
    return 0
