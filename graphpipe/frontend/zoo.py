"""The model zoo: named, configurable ``nn.Module``s for planning and training.

A *spec* names a model and its size: ``NAME[:TOKEN,TOKEN,...]`` where a token
is ``small`` or ``paper`` (the preset; a bare name means ``paper``) or
``key=value`` overriding one config field. Paper presets follow GraphPipe
(ASPLOS'25) Appendix A.2; ``small`` presets train on a CPU in milliseconds.

========== =================================================================
name        paper preset
========== =================================================================
mmt         4 branches x 8 transformer layers, seq 256, hidden 1024,
            16 heads, FFN 4096, concat, classifier head (1000 classes)
dlrm        7 dense branches (4 FF layers, hidden 4096, 512 input features,
            last layer -> 64) + 7 embedding-bag branches (1M rows, dim 64,
            bag 100), dot interaction, 3-layer top MLP
candle-uno  7 branches x 4 FF layers (hidden 4096, 1024 input features),
            concat, 3-layer MLP head
transformer GPT-style chain: token+position embedding, 32 causal layers
            (hidden 1024, seq 256, 16 heads, FFN 4096), LM head (vocab 32000)
            -- about the size of GPT-2 medium doubled in depth
twobranch   the case-study model: shared embedding, 2 branches x 8 causal
            layers (hidden 1024, seq 256), concat, LM head (vocab 32000)
========== =================================================================

The unspecified sizes (DLRM/Uno input features, heads' widths, vocab) are
not given in the paper; they are chosen to keep the branches the dominant
cost, as in the paper's description.

Planning never allocates weights: :func:`load_graph` builds on the meta
device (a 1M-row table costs nothing there). The loss of every model is
``output.float().pow(2).mean()``: a scalar mean over the batch that depends on
each sample's output alone, so micro-batched training (loss scaled by the
micro-batch's share) reproduces full-batch gradients exactly.

Example
-------
>>> canonical_spec("mmt:small,layers=2,branches=2")
'mmt:small'
>>> built = build("candle-uno:small,branches=3")
>>> len(built.example_inputs)
3
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from graphpipe import zoo_configs as zc
from graphpipe.cluster import DeviceSpec, preset
from graphpipe.errors import InputError
from graphpipe.graph import OpGraph

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

__all__ = ["MODELS", "ModelSpec", "BuiltModel", "parse_spec", "canonical_spec", "option_names", "build", "load_graph",
           "mean_square_loss", "EXAMPLE_BATCH_SIZE"]

log = logging.getLogger(__name__)

EXAMPLE_BATCH_SIZE = 4
"""Batch size of ``BuiltModel.example_inputs`` (capture divides sizes by it)."""

MODELS: dict[str, str] = {
    "mmt": "multi-modal transformer: k transformer branches, concat, classifier head",
    "dlrm": "DLRM: dense MLP branches + embedding-bag branches, dot interaction, top MLP",
    "candle-uno": "CANDLE-Uno: k feature-encoder MLP branches, concat, MLP head",
    "transformer": "GPT-style sequential transformer (a chain; SPP sanity case)",
    "twobranch": "the paper's 2-branch case-study transformer: embed, 2 branches, concat, head",
}


@dataclass(frozen=True, slots=True)
class _Family:
    """How to build one zoo name: config class, presets, module class (its name in :mod:`graphpipe.frontend.zoo_models`,
    imported with torch only when a model is built), inputs."""

    config: type
    presets: dict[str, Any]
    module: str
    inputs: Callable[[Any, int, torch.Generator | None, torch.device], tuple[torch.Tensor, ...]]
    num_branches: Callable[[Any], int]


def _randn(shape, gen, device) -> torch.Tensor:
    import torch

    if device.type == "meta":
        return torch.empty(shape, device=device)
    return torch.randn(shape, generator=gen).to(device)


def _randint(high: int, shape, gen, device) -> torch.Tensor:
    import torch

    if device.type == "meta":
        return torch.empty(shape, dtype=torch.int64, device=device)
    return torch.randint(0, high, shape, generator=gen).to(device)


def _mmt_inputs(cfg: zc.MMTConfig, b, gen, device):
    return tuple(_randn((b, cfg.seq, cfg.hidden), gen, device) for _ in range(cfg.branches))


def _dlrm_inputs(cfg: zc.DLRMConfig, b, gen, device):
    dense = [_randn((b, cfg.features), gen, device) for _ in range(cfg.branches)]
    sparse = [_randint(cfg.rows, (b, cfg.bag), gen, device) for _ in range(cfg.branches)]
    return tuple(dense + sparse)


def _uno_inputs(cfg: zc.UnoConfig, b, gen, device):
    return tuple(_randn((b, cfg.features), gen, device) for _ in range(cfg.branches))


def _token_inputs(cfg, b, gen, device):
    return (_randint(cfg.vocab, (b, cfg.seq), gen, device),)


_FAMILIES: dict[str, _Family] = {
    "mmt": _Family(
        zc.MMTConfig,
        {"paper": dict(branches=4, layers=8, seq=256, hidden=1024, heads=16, ffn=4096, classes=1000),
         "small": dict(branches=2, layers=2, seq=16, hidden=32, heads=4, ffn=64, classes=10)},
        "MMT", _mmt_inputs, lambda c: c.branches),
    "dlrm": _Family(
        zc.DLRMConfig,
        {"paper": dict(branches=7, layers=4, hidden=4096, features=512, dim=64, bag=100, rows=1_000_000, top_layers=3),
         "small": dict(branches=2, layers=2, hidden=32, features=16, dim=8, bag=4, rows=100, top_layers=2)},
        "DLRM", _dlrm_inputs, lambda c: 2 * c.branches),
    "candle-uno": _Family(
        zc.UnoConfig,
        {"paper": dict(branches=7, layers=4, hidden=4096, features=1024, head_layers=3),
         "small": dict(branches=2, layers=2, hidden=32, features=16, head_layers=2)},
        "CandleUno", _uno_inputs, lambda c: c.branches),
    "transformer": _Family(
        zc.GPTConfig,
        {"paper": dict(layers=32, seq=256, hidden=1024, heads=16, ffn=4096, vocab=32000),
         "small": dict(layers=4, seq=16, hidden=32, heads=4, ffn=64, vocab=100)},
        "GPT", _token_inputs, lambda c: 1),
    "twobranch": _Family(
        zc.TwoBranchConfig,
        {"paper": dict(branches=2, layers=8, seq=256, hidden=1024, heads=16, ffn=4096, vocab=32000),
         "small": dict(branches=2, layers=2, seq=16, hidden=32, heads=4, ffn=64, vocab=100)},
        "TwoBranch", _token_inputs, lambda c: c.branches),
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A parsed spec: zoo ``name``, ``preset`` ('paper'|'small') and the resolved ``config``."""

    name: str
    preset: str
    config: Any

    @property
    def num_branches(self) -> int:
        return _FAMILIES[self.name].num_branches(self.config)

    def canonical(self) -> str:
        """``name[:small][,key=value ...]`` with only fields that differ from the preset, in field order."""
        base = _FAMILIES[self.name].presets[self.preset]
        tokens = ["small"] if self.preset == "small" else []
        for f in dataclasses.fields(self.config):
            value = getattr(self.config, f.name)
            if value != base[f.name]:
                tokens.append(f"{f.name}={value}")
        return self.name + (":" + ",".join(tokens) if tokens else "")


@dataclass(frozen=True, slots=True)
class BuiltModel:
    """A zoo model instantiated on a device, with deterministic inputs.

    make_inputs(batch_size, seed) -> tuple of tensors on the model's device;
    equal arguments give equal tensors (a seeded ``torch.Generator``).
    """

    name: str
    """Canonical spec."""
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    make_inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    spec: ModelSpec


def mean_square_loss(output: torch.Tensor) -> torch.Tensor:
    """``output.float().pow(2).mean()``: scalar mean over the batch, per-sample separable."""
    return output.float().pow(2).mean()


MAX_OPTION = 1 << 24
"""Largest value of any ``key=N`` option (16,777,216): larger sizes overflow tensor shapes."""
MAX_LAYERS = 1024
"""Most layers (branches x layers) a zoo model may have: capture costs ~20 ms per layer and planning grows faster."""


def parse_spec(spec: str) -> ModelSpec:
    """Parse ``NAME[:small|paper][,key=value...]``; errors list what is known.

    >>> parse_spec("mmt:small,branches=3").config.branches
    3
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"empty model spec {spec!r}; known models: {', '.join(MODELS)}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in _FAMILIES:
        raise InputError(f"unknown model {name!r}; known models: {', '.join(MODELS)} "
                         "(or a graph JSON, a PipeDream graph.txt, or file.py:factory)")
    family = _FAMILIES[name]
    keys = [f.name for f in dataclasses.fields(family.config)]
    chosen = "paper"
    overrides: dict[str, int] = {}
    for token in (t.strip() for t in rest.split(",") if t.strip()):
        if token in family.presets:
            chosen = token
            continue
        key, eq, value = token.partition("=")
        key = key.strip()
        if not eq or key not in keys:
            raise InputError(f"unknown option {token!r} for model {name!r}; known: "
                             f"{', '.join(family.presets)}, {', '.join(k + '=N' for k in keys)}")
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"option {key} of model {name!r} must be an integer, got {value!r}") from None
        if number < 1:
            raise InputError(f"option {key} of model {name!r} must be >= 1, got {number}")
        if number > MAX_OPTION:
            raise InputError(f"option {key} of model {name!r} is {number}, more than the limit of {MAX_OPTION}")
        overrides[key] = number
    config = family.config(**{**family.presets[chosen], **overrides})
    layers = (getattr(config, "branches", 1) * getattr(config, "layers", 1) + getattr(config, "head_layers", 0)
              + getattr(config, "top_layers", 0))
    if layers > MAX_LAYERS:
        raise InputError(f"model {spec.strip()!r} has about {layers} layers (branches x layers), more than the "
                         f"limit of {MAX_LAYERS}: capturing and planning it would not finish; use fewer")
    heads = getattr(config, "heads", None)
    if heads is not None and config.hidden % heads:
        raise InputError(f"model {name!r}: hidden ({config.hidden}) must be divisible by heads ({heads}); "
                         "change hidden= or heads=")
    return ModelSpec(name, chosen, config)


def option_names(name: str) -> tuple[str, ...]:
    """The ``key=`` options of zoo model ``name`` (its config fields), in order."""
    if name not in _FAMILIES:
        raise InputError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return tuple(f.name for f in dataclasses.fields(_FAMILIES[name].config))


def canonical_spec(spec: str) -> str:
    """The stable spelling of ``spec`` (same model <=> same string).

    >>> canonical_spec("mmt:paper"), canonical_spec("mmt:small,layers=3")
    ('mmt', 'mmt:small,layers=3')
    """
    return parse_spec(spec).canonical()


def build(spec: str, device: str | torch.device = "cpu", seed: int = 0) -> BuiltModel:
    """Instantiate the model of ``spec`` on ``device`` with weights from ``seed``.

    ``device="meta"`` allocates nothing (planning, parameter counting).
    Otherwise the module is initialised on the CPU under ``torch.manual_seed(seed)``
    inside ``fork_rng`` (the caller's RNG state is untouched) and then moved,
    so the same seed gives the same weights on every device.
    """
    import torch

    from graphpipe.frontend import zoo_models
    parsed = parse_spec(spec)
    family = _FAMILIES[parsed.name]
    make_module = getattr(zoo_models, family.module)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown torch device {device!r}; use cpu, cuda, cuda:N or meta") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: CUDA is not available here; use cpu (or meta for planning)")
    if dev.type == "meta":
        with torch.device("meta"):
            module = make_module(parsed.config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = make_module(parsed.config)
        if dev.type != "cpu":  # built on the CPU already (moving would refuse parameters built on meta)
            module = module.to(dev)

    def make_inputs(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch size must be a positive integer, got {batch_size!r}")
        gen = torch.Generator().manual_seed(seed)
        return family.inputs(parsed.config, batch_size, gen, dev)

    return BuiltModel(parsed.canonical(), module, make_inputs(EXAMPLE_BATCH_SIZE, seed), mean_square_loss,
                      make_inputs, parsed)


@functools.lru_cache(maxsize=32)
def _load_graph_cached(canonical: str, device: DeviceSpec, precision: str = "fp32", granularity: str | None = None) -> OpGraph:
    from graphpipe.frontend.graph_cache import cached_graph

    def captured() -> OpGraph:  # torch is imported here, on a cache miss only
        from graphpipe.frontend.capture import Granularity, capture

        from graphpipe.progress import slow_notice

        with slow_notice(f"capturing {canonical} (torch.export; cached for the next command)"):
            built = build(canonical, device="meta")
            return capture(built.module, built.example_inputs, name=canonical, device=device, loss_fn=built.loss_fn,
                           precision=precision, granularity=Granularity.parse(granularity)).graph

    return cached_graph(("zoo", canonical, device, precision, granularity), captured)


def load_graph(spec: str, device: DeviceSpec | None = None, precision: str = "fp32",
               granularity: str | None = None) -> OpGraph:
    """The captured :class:`OpGraph` of ``spec`` with analytical costs for ``device``.

    Built on the meta device (no weights); ``device`` defaults to the v100
    preset's; activation bytes are measured at ``precision``; ``granularity``
    is :meth:`graphpipe.frontend.capture.Granularity.parse`'s text. Cached per
    (canonical spec, device, precision, granularity): the graph is immutable;
    in this process and on disk (:mod:`graphpipe.frontend.graph_cache`).
    """
    device = device if device is not None else preset("v100").device
    # the capture reads the device's costs, never its memory: each --memory-gb must not capture the model anew
    from dataclasses import replace

    costs_only = replace(device, memory_bytes=MEMORY_KEY_BYTES)
    return _load_graph_cached(canonical_spec(spec), costs_only, precision, granularity)


MEMORY_KEY_BYTES = 1.0
"""The device memory every cached capture is keyed at: captures differ by costs only (graph_cache)."""
