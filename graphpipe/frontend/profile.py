"""Measured op costs: time every op, fit ``t(b) = alpha + beta * b``, apply to a graph.

docs/design.md, "The cost model": an op's time is affine in the micro-batch size (fixed kernel
overhead plus per-sample work). Analytical costs (:mod:`graphpipe.frontend.capture`)
estimate alpha and beta from FLOPs; a profile measures them.

How an op is timed: the captured GraphModule is split with
``split_module`` into one submodule per op (exactly the pieces the runtime
runs, at finer grain). For each micro-batch size ``b`` the split model is run
once on a batch of ``b`` samples to record each submodule's real inputs; then
``warmup + repeats`` training passes replay them: every submodule's forward
(autograd on) in topological order, then every submodule's backward in
reverse order (``torch.autograd.backward`` of its outputs into its
non-input tensors and parameters), each timed alone
(``torch.cuda.synchronize`` around each on CUDA); an op's time is the median
over the timed passes. Two things make this match what a pipeline stage
pays, where timing one op back to back would not: the ops run in training
order, so an op's weights are not still in cache from its own previous run
(on a CPU a 4 MB weight matrix costs more to stream than a small
micro-batch costs to multiply), and the weight gradients *accumulate* into
``.grad`` as they do over micro-batches (an extra read and write of every
gradient per micro-batch). alpha and beta are then the non-negative least-squares fit over the
batch sizes (``scipy.optimize.nnls``): a negative overhead or slope is
physically meaningless and would make planners prefer odd micro-batch sizes.

Each repeat runs two such passes. The first times an op's backward as one
call (``torch.autograd.backward``), as a stage runs it under GPipe, 1F1B and
graph-1F1B: that is ``bwd_s``. The second times it split, as a zero-bubble
stage runs it (:mod:`graphpipe.frontend.split_backward`, torch's
``stage_backward_input`` / ``stage_backward_weight``): first I, the input
gradients (``torch.autograd.grad`` of the outputs into the op's inputs,
graph retained, capturing the gradient that reaches each
parameter-consuming node), then W, the weight gradients from those nodes
into ``.grad``. The weight-gradient time (``wgrad_s``, zero bubble's W,
:attr:`graphpipe.graph.Op.wgrad`) is W's share of that split applied to
``bwd_s``: ``bwd_s * W / (I + W)``, so I + W = B as the cost model has it.
Timing B as I + W instead overstated it on a GPU, where each split call
carries its own autograd overhead: on an H100 (paper-size mmt, micro-batch
16), per-op I + W summed to 1.7x (fp32) and 2.7x (bf16) the whole model's
backward, while the per-op forwards summed to within 10% of its forward.
An op without parameters has no W and no ``wgrad_s`` (its backward is all
I); an op whose inputs are model inputs has no I (its backward is all W).
Profiles and graphs without ``wgrad_s`` take
:data:`graphpipe.costs.WEIGHT_GRAD_SHARE` of the backward instead.

File format ``graphpipe.profile/1``::

    {"format": "graphpipe.profile/1", "model": "transformer:small", "device": "cpu",
     "batch_sizes": [1, 2, 4, 8],
     "ops": {"layer0": {"fwd_s": [alpha, beta], "bwd_s": [alpha, beta], "wgrad_s": [alpha, beta]},
             "relu0": {"fwd_s": [alpha, beta], "bwd_s": [alpha, beta]}, ...}}

``wgrad_s`` is optional (ops with parameters; older profiles have none).

Example
-------
>>> fit_affine([1, 2, 4], [0.003, 0.004, 0.006])
Affine(alpha=0.002, beta=0.001)
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from graphpipe.errors import FormatError, GraphpipeError, InputError, user_code_error
from graphpipe.graph import Affine, OpGraph, affine_field, read_json_file, write_json_atomic

__all__ = [
    "PROFILE_FORMAT",
    "Profile",
    "OpTimings",
    "fit_affine",
    "time_ops",
    "profile_captured",
    "profile_model",
    "profile_to_dict",
    "profile_from_dict",
    "read_profile",
    "write_profile",
    "apply_profile",
    "resize_batch",
]

log = logging.getLogger(__name__)

PROFILE_FORMAT = "graphpipe.profile/1"


PROFILE_PRECISIONS = ("fp32", "bf16")
"""Precisions ``graphpipe profile --precision`` times ops at."""


@dataclass(frozen=True, slots=True)
class Profile:
    """Fitted per-op time models of one model on one device."""

    model: str
    device: str
    batch_sizes: tuple[int, ...]
    ops: Mapping[str, tuple[Affine, Affine]]
    """op name -> (forward, backward) time model in seconds."""
    precision: str = "fp32"
    """Precision the ops were timed at: ``fp32``, or ``bf16`` under ``torch.autocast``."""
    wgrad: Mapping[str, Affine] = field(default_factory=dict)
    """op name -> weight-gradient part of the backward (zero bubble's W), for the ops with parameters that
    were timed split; ops not named here take :data:`graphpipe.costs.WEIGHT_GRAD_SHARE` of their backward."""


@dataclass(frozen=True, slots=True)
class OpTimings:
    """Median measured seconds of one op, one entry per batch size."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    """The whole backward: I + W for an op with parameters."""
    wgrad_s: tuple[float, ...] | None = None
    """The weight-gradient part W of ``bwd_s``; None for an op without parameters."""


def fit_affine(batch_sizes: Sequence[float], times: Sequence[float]) -> Affine:
    """Least-squares ``alpha + beta * b`` with alpha, beta >= 0 (``scipy.optimize.nnls``).

    >>> fit_affine([1, 2, 3], [1.0, 1.0, 1.0])
    Affine(alpha=1.0, beta=0.0)
    """
    import numpy as np
    from scipy.optimize import nnls

    if len(batch_sizes) != len(times) or not batch_sizes:
        raise InputError(f"fit_affine needs one time per batch size, got {len(batch_sizes)} sizes and {len(times)} times")
    if any(not (math.isfinite(t) and t >= 0) for t in times):
        raise InputError(f"measured times must be finite and >= 0, got {list(times)}")
    a = np.column_stack([np.ones(len(batch_sizes)), np.asarray(batch_sizes, dtype=float)])
    (alpha, beta), _ = nnls(a, np.asarray(times, dtype=float))
    # nnls returns numpy floats; round off float noise below a picosecond
    return Affine(round(float(alpha), 15), round(float(beta), 15))


def resize_batch(inputs: Sequence[Any], batch_size: int) -> tuple[Any, ...]:
    """Inputs with ``batch_size`` rows, repeating the example rows cyclically (dim 0)."""
    import torch

    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            idx = torch.arange(batch_size, device=x.device) % x.shape[0]
            out.append(x.index_select(0, idx))
        else:
            out.append(x)
    return tuple(out)


def _record_submodule_args(split, inputs: Sequence[Any]) -> dict[str, tuple[Any, ...]]:
    """Run the split model once; return each ``submod_*`` call's positional args."""
    import torch
    import torch.fx as fx

    recorded: dict[str, tuple[Any, ...]] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            recorded[str(target)] = tuple(args)
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Recorder(split).run(*inputs)
    return recorded


def time_ops(captured, make_inputs: Callable[[int], Sequence[Any]], batch_sizes: Sequence[int],
             repeats: int = 5, warmup: int = 2, timer: Callable[[], float] = time.perf_counter,
             progress: Callable[[str], None] | None = None, precision: str = "fp32") -> dict[str, OpTimings]:
    """Median forward, backward and (ops with parameters) weight-gradient seconds of every op at every batch size.

    ``make_inputs(b)`` gives model inputs with ``b`` samples on the module's
    device. ``timer`` is injectable so tests can drive a fake clock.
    ``progress(text)`` is called after each of the ``len(batch_sizes) * (warmup
    + repeats)`` training passes.
    """
    from graphpipe.frontend.capture import split_by_ops

    if repeats < 1 or warmup < 0:
        raise InputError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    names = [op.name for op in captured.graph.ops]
    split = split_by_ops(captured, {name: i for i, name in enumerate(names)})
    fwd: dict[str, list[float]] = {name: [] for name in names}
    bwd: dict[str, list[float]] = {name: [] for name in names}
    wgrad: dict[str, list[float]] = {name: [] for name in names}
    for b in batch_sizes:
        prepared = _prepare_ops(split, names, make_inputs(b))
        times = _Times(names)
        for i in range(warmup + repeats):
            # Two training passes at batch b: every forward in topological order, then every backward in
            # reverse, so each op finds the caches as a stage does between micro-batches. The first pass
            # times the backward as one call (B); the second times zero bubble's I and W (module docstring).
            for split_pass in (False, True):
                with _autocast(precision, make_inputs):  # bf16: the run's torch.autocast
                    _training_pass(prepared, split_pass, i >= warmup, timer, times)
            if progress is not None:
                progress(f"micro-batch {b}")
        for _, sub, _, _, _ in prepared:
            for p in sub.parameters():
                p.grad = None
        times.medians_into(fwd, bwd, wgrad)
    # an op is timed split at every batch size or at none (its parameters and inputs do not change with b)
    return {name: OpTimings(tuple(fwd[name]), tuple(bwd[name]),
                            tuple(wgrad[name]) if len(wgrad[name]) == len(batch_sizes) else None) for name in names}


class _Times:
    """Every timed repeat of one batch size: forward, backward (B), and the split backward's I and W, per op."""

    def __init__(self, names: Sequence[str]) -> None:
        self.f: dict[str, list[float]] = {name: [] for name in names}
        self.b: dict[str, list[float]] = {name: [] for name in names}
        self.i: dict[str, list[float]] = {name: [] for name in names}
        self.w: dict[str, list[float]] = {name: [] for name in names}

    def medians_into(self, fwd, bwd, wgrad) -> None:
        """Append this batch size's medians; W's share of B as the split measured it."""
        for name in self.f:
            fwd[name].append(statistics.median(self.f[name]))
            bwd[name].append(statistics.median(self.b[name]))
            if self.w[name]:
                i_s, w_s = statistics.median(self.i[name]), statistics.median(self.w[name])
                wgrad[name].append(bwd[name][-1] * w_s / (i_s + w_s) if i_s + w_s > 0 else 0.0)


def _prepare_ops(split, names: Sequence[str], inputs: Sequence[Any]) -> list[tuple]:
    """``(name, submodule, args, leaves, wrt)`` per op: its recorded inputs, activations from other ops as
    fresh leaves needing grads, and what its backward differentiates (those leaves, then its parameters)."""
    import torch

    recorded = _record_submodule_args(split, inputs)
    call_nodes = {str(n.target): n for n in split.graph.nodes if n.op == "call_module"}
    prepared = []
    for op_id, name in enumerate(names):
        target = f"submod_{op_id}"
        sub = getattr(split, target)
        args, leaves, read_params = [], [], []
        for value, node in zip(recorded[target], call_nodes[target].args):
            # activations from other ops need grads; model inputs and parameters keep theirs
            if isinstance(value, torch.Tensor) and isinstance(node, torch.fx.Node) and node.op not in ("placeholder", "get_attr"):
                value = value.detach().requires_grad_(value.is_floating_point())
                if value.requires_grad:
                    leaves.append(value)
            elif isinstance(node, torch.fx.Node) and node.op == "get_attr" and isinstance(value, torch.nn.Parameter) \
                    and value.requires_grad and all(value is not p for p in read_params):
                read_params.append(value)  # split_module passes the parameters an op reads as arguments
            args.append(value)
        wrt = leaves + [p for p in sub.parameters() if p.requires_grad] + read_params
        prepared.append((name, sub, args, leaves, wrt))
    return prepared


def _sync(values) -> None:
    """Wait for the GPU a value lives on (a no-op on CPU)."""
    import torch
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


def _training_pass(prepared, split_pass: bool, timed: bool, timer, times: _Times) -> None:
    """Every op's forward in order, then every backward in reverse: B as one call, or (``split_pass``) I then W."""
    import torch
    from torch.utils._pytree import tree_leaves

    from graphpipe.frontend.split_backward import backward_input, backward_weight

    outs: dict[str, list[Any]] = {}
    for name, sub, args, _, _ in prepared:
        _sync(args)
        t0 = timer()
        out = sub(*args)
        _sync(out)
        if timed:
            times.f[name].append(timer() - t0)
        outs[name] = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    for name, sub, args, leaves, wrt in reversed(prepared):
        tensors = outs.pop(name)
        params = wrt[len(leaves):]
        if not split_pass and (not tensors or not wrt):
            if timed:
                times.b[name].append(0.0)
            continue
        if split_pass and (not tensors or not params):
            continue  # nothing to split: its graph goes with its outputs
        grads = [torch.ones_like(t) for t in tensors]
        _sync(tensors)
        t0 = timer()
        if not split_pass:
            torch.autograd.backward(tensors, grads, inputs=wrt)
            _sync(wrt)
            if timed:
                times.b[name].append(timer() - t0)
        else:
            _, pending = backward_input(tensors, grads, leaves, params)
            _sync(tensors)
            t_input = timer()
            backward_weight(pending)  # into .grad, as the runtime does
            _sync(params)
            if timed:
                times.i[name].append(t_input - t0)
                times.w[name].append(timer() - t_input)
        for leaf in leaves:
            leaf.grad = None


def _autocast(precision: str, make_inputs):
    """``torch.autocast`` to bfloat16 on the inputs' device for ``bf16``; a no-op for ``fp32``."""
    import torch
    from torch.utils._pytree import tree_leaves

    device = next((t.device.type for t in tree_leaves(list(make_inputs(1))) if isinstance(t, torch.Tensor)), "cpu")
    return torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")


def profile_captured(captured, make_inputs: Callable[[int], Sequence[Any]], model: str, device: str,
                     batch_sizes: Sequence[int] = (1, 2, 4, 8), repeats: int = 5, warmup: int = 2,
                     timer: Callable[[], float] = time.perf_counter,
                     progress: Callable[[str], None] | None = None, precision: str = "fp32") -> Profile:
    """Time every op of ``captured`` (see :func:`time_ops`) and fit its affine models."""
    sizes = _check_batch_sizes(batch_sizes)
    timings = time_ops(captured, make_inputs, sizes, repeats=repeats, warmup=warmup, timer=timer, progress=progress,
                       precision=precision)
    ops = {name: (fit_affine(sizes, t.fwd_s), fit_affine(sizes, t.bwd_s)) for name, t in timings.items()}
    wgrad = {name: fit_affine(sizes, t.wgrad_s) for name, t in timings.items() if t.wgrad_s is not None}
    _warn_poor_fits(sizes, timings, ops, wgrad)
    return Profile(model, device, sizes, ops, precision, wgrad)


# An op's fit is poor when it misses the measured times by more than this
# share (root-mean-square, relative to the mean time); only ops that carry at
# least POOR_FIT_SHARE of the model's time are worth a warning.
POOR_FIT_ERROR = 0.25
POOR_FIT_SHARE = 0.05


def _warn_poor_fits(sizes, timings: Mapping[str, OpTimings], ops, wgrad=None) -> list[str]:
    total = sum(sum(t.fwd_s) + sum(t.bwd_s) for t in timings.values()) or 1.0
    wgrad = wgrad or {}
    poor = []
    for name, t in timings.items():
        fits = [("forward", t.fwd_s, ops[name][0]), ("backward", t.bwd_s, ops[name][1])]
        if name in wgrad:
            fits.append(("weight gradient", t.wgrad_s, wgrad[name]))
        for kind, times, model in fits:
            mean = sum(times) / len(times)
            if mean <= 0 or sum(times) < POOR_FIT_SHARE * total:
                continue
            rms = math.sqrt(sum((model(b) - x) ** 2 for b, x in zip(sizes, times)) / len(times))
            if rms > POOR_FIT_ERROR * mean:
                poor.append(f"{name} {kind} ({100 * rms / mean:.0f}%)")
    if poor:
        log.warning("t(b) = alpha + beta*b fits %d op time(s) poorly (rms error vs mean): %s%s; "
                    "more --repeats or other --batch-sizes may help", len(poor), ", ".join(poor[:4]),
                    " ..." if len(poor) > 4 else "")
    return poor


def profile_model(spec: str, device: str = "cpu", batch_sizes: Sequence[int] = (1, 2, 4, 8), repeats: int = 5,
                  warmup: int = 2, seed: int = 0, progress: Callable[[str], None] | None = None,
                  precision: str = "fp32") -> Profile:
    """Profile a zoo spec or ``file.py:factory`` on ``device`` ('cpu', 'cuda', 'cuda:1') at ``precision``."""
    import torch

    if precision not in PROFILE_PRECISIONS:
        raise InputError(f"--precision must be one of {', '.join(PROFILE_PRECISIONS)}, got {precision!r}")

    from graphpipe.frontend import capture as cap
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here; use --device cpu")
    if precision == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise InputError(f"--precision bf16: {torch.cuda.get_device_name(dev)} has no bfloat16 support; "
                         "use --precision fp32")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu or cuda, got {device!r}")
    if spec.endswith(".py"):
        from graphpipe.models import missing_factory

        raise InputError(missing_factory(spec))
    if ".py:" in spec:
        with torch.random.fork_rng(devices=[]):  # the weights the runtime builds from the same seed
            torch.manual_seed(seed)
            made = cap.load_factory(spec)
        module, model_id = made.module.to(dev), spec
        # captured as the planner does (with the loss and its target), so the op names are the plan's
        captured = cap.capture(module, made.example_inputs, name=model_id, user_file=spec.rpartition(":")[0],
                               loss_fn=made.loss_fn, example_target=made.example_target)
        args, kwargs = cap.normalize_inputs(made.example_inputs)
        flat = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x
                     for x in captured.io.flat_inputs(args, kwargs, made.example_target))

        def make_inputs(b: int):
            return resize_batch(flat, b)
    else:
        from graphpipe.frontend import zoo
        built = zoo.build(spec, device=dev, seed=seed)
        module, example, model_id = built.module, built.example_inputs, built.name

        def make_inputs(b: int):
            return built.make_inputs(b, seed)
        captured = cap.capture(module, example, name=model_id)
    name = "cpu" if dev.type == "cpu" else f"cuda ({torch.cuda.get_device_name(dev)})"
    user_file = spec.rpartition(":")[0] if ".py:" in spec else None
    try:
        return profile_captured(captured, make_inputs, model_id, name, batch_sizes, repeats, warmup, progress=progress,
                                precision=precision)
    except GraphpipeError:
        raise
    except Exception as exc:
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)
        if user_file is None or not any(os.path.realpath(f.filename) == os.path.realpath(user_file) for f in frames):
            raise  # not the user's code: our bug, reported as such
        raise user_code_error(exc, "running the module while profiling it", user_file) from exc


def _check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(batch_sizes)
    if len(sizes) < 2 or any(not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        raise InputError(f"need at least two distinct positive batch sizes to fit alpha and beta, got {list(sizes)}")
    return sizes


# ------------------------------------------------------------------------ I/O
def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The ``graphpipe.profile/1`` document."""
    return {
        "format": PROFILE_FORMAT,
        "model": profile.model,
        "device": profile.device,
        "batch_sizes": list(profile.batch_sizes),
        "precision": profile.precision,
        "ops": {name: {"fwd_s": [f.alpha, f.beta], "bwd_s": [b.alpha, b.beta],
                       **({"wgrad_s": [profile.wgrad[name].alpha, profile.wgrad[name].beta]}
                          if name in profile.wgrad else {})}  # only ops timed split
                for name, (f, b) in profile.ops.items()},
    }


def profile_from_dict(doc: Any, where: str = "profile") -> Profile:
    """Parse a ``graphpipe.profile/1`` document; other formats are refused."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: expected a JSON object")
    if doc.get("format") != PROFILE_FORMAT:
        raise FormatError(f"{where}: unsupported format {doc.get('format')!r}; expected {PROFILE_FORMAT!r} "
                          "(write one with `graphpipe profile MODEL --out FILE`)")
    from graphpipe import files as f

    ops, wgrad = {}, {}
    for name, entry in f.mapping(doc.get("ops"), f"{where}.ops").items():
        at = f"{where}.ops.{name}"
        f.mapping(entry, at)
        pair = []
        for key in ("fwd_s", "bwd_s"):
            coeffs = f.array(entry.get(key), f"{at}.{key}")
            if len(coeffs) != 2:
                raise FormatError(f"{where}: op {name!r}: fwd_s and bwd_s must be [alpha, beta]")
            pair.append(Affine(*(float(f.number(v, f"{at}.{key}[{k}]", 0)) for k, v in enumerate(coeffs))))
        ops[name] = (pair[0], pair[1])
        if "wgrad_s" in entry:  # optional: older profiles time only B
            wgrad[name] = affine_field(entry["wgrad_s"], f"{at}.wgrad_s")
    sizes = tuple(f.integer(b, f"{where}.batch_sizes[{i}]", 1)
                  for i, b in enumerate(f.array(doc.get("batch_sizes", []), f"{where}.batch_sizes")))
    precision = f.string(doc.get("precision", "fp32"), f"{where}.precision")  # older profiles: fp32
    if precision not in PROFILE_PRECISIONS:
        raise FormatError(f"{where}: precision must be one of {', '.join(PROFILE_PRECISIONS)}, got {precision!r}")
    return Profile(f.string(doc.get("model", ""), f"{where}.model"), f.string(doc.get("device", ""), f"{where}.device"),
                   sizes, ops, precision, wgrad)


def read_profile(path: str) -> Profile:
    """Read a profile JSON file."""
    return profile_from_dict(read_json_file(path, "profile file"), where=path)


def write_profile(path: str, profile: Profile) -> None:
    """Write atomically (temporary file + rename)."""
    write_json_atomic(path, profile_to_dict(profile))


def apply_profile(graph: OpGraph, profile: Profile, model: str | None = None) -> OpGraph:
    """``graph`` with the forward/backward models of every op named in ``profile``.

An op's weight-gradient model (:attr:`graphpipe.graph.Op.wgrad`) becomes
the profile's, or None where the profile did not time it split: a W
measured with other backward figures does not describe the new ones.

    Ops the profile does not name keep their costs (a warning says how
    many); a profile op the graph lacks is an error (a profile of another
    model or config). ``model``, the spec being planned, is compared with the
    profile's: a profile of ``mmt:small`` applied to ``mmt`` names the same
    ops but measured other sizes, so it is accepted with a warning.
    """
    from dataclasses import replace

    names = {op.name for op in graph.ops}
    unknown = [name for name in profile.ops if name not in names]
    if unknown:
        raise InputError(f"profile of {profile.model!r} names ops not in graph {graph.name!r}: "
                         f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}; "
                         "profile the same model spec you plan")
    if model is not None and profile.model and not _same_model(model, profile.model):
        log.warning("the profile was measured on %r, not %r: its op names match but its costs are of another "
                    "configuration (profile the model you plan)", profile.model, model)
    missing = [op.name for op in graph.ops if op.name not in profile.ops]
    if missing:
        log.warning("the profile has no entry for %d of %d ops of %s (%s%s); they keep analytical costs",
                    len(missing), graph.num_ops, graph.name, ", ".join(missing[:3]), " ..." if len(missing) > 3 else "")
    ops = [replace(op, fwd=profile.ops[op.name][0], bwd=profile.ops[op.name][1], wgrad=profile.wgrad.get(op.name))
           if op.name in profile.ops else op for op in graph.ops]
    return graph.with_ops(ops)


def _same_model(a: str, b: str) -> bool:
    """Two MODEL specs name the same model: equal zoo specs, or the same factory file and function."""
    import os

    def norm(spec: str) -> str:
        if ".py:" in spec:
            path, _, func = spec.rpartition(":")
            return os.path.realpath(path) + ":" + func
        try:
            from graphpipe.frontend.zoo import canonical_spec

            return canonical_spec(spec)
        except (InputError, ImportError):
            return spec
    return norm(a) == norm(b)
