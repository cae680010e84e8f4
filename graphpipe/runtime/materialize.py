"""Models built on the meta device: each rank allocates and initialises only its own stages' tensors.

Pipeline parallelism is for models that do not fit on one device, so no
rank may need the whole model. A model built under ``torch.device("meta")``
(or by :func:`params_on_meta`, which keeps buffers and example inputs real)
is captured and cut on the meta device; then :func:`materialize_stages`
gives every parameter and buffer of the stages a rank hosts real storage on
that rank's device and runs the modules' own initialisation on it:

* ``reset_parameters()`` of the module owning the tensor (every
  ``torch.nn`` layer has one), then the root's ``_init_weights(module)``
  (the Hugging Face convention) when the root defines one;
* every in-place random fill (``uniform_``, ``normal_``,
  ``nn.init.kaiming_uniform_``, ...) on a hosted tensor first seeds the
  generator from ``(seed, the tensor's name in the model)``
  (:func:`tensor_seed`), so a tensor's values depend on the seed and its
  name only: never on the rank, on which other tensors that rank hosts, or
  on the order modules are initialised in. Tensors another rank hosts stay
  on the meta device, where the same calls allocate and draw nothing;
* a tied parameter whose copies sit on several stages is initialised from
  its one name on each, so the copies start equal.

A tensor whose owner has no initialiser (a raw ``nn.Parameter`` of a custom
module, a buffer computed in ``__init__``) cannot be rebuilt: it is listed
as *uninitialised*, and :class:`graphpipe.Pipeline` refuses to train until a
checkpoint has filled it (``pipe.load``).

The captured graph may carry the meta device as a literal
(``torch.arange(n, device=x.device)`` traced on meta inputs);
:func:`retarget_devices` rewrites such literals to the run's device.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from graphpipe.frontend.export_inputs import retarget_devices  # noqa: F401 - part of this module's interface
from graphpipe.frontend.exporting import DATA_VALUE

__all__ = ["meta_nonzero", "params_on_meta", "kept_values", "buffers_to_meta", "fake_cpu", "as_traced", "on_meta", "tensor_seed", "materialize_stages", "materialize_unused", "retarget_devices", "meta_copy",
           "model_tensors", "Materialized"]


def meta_nonzero():
    """Let ``nonzero`` (and what is built on it: boolean masks, ``masked_select``) run on meta tensors, as if
    every element were non-zero: a graph run for shapes on meta parameters needs only the rank of such a value,
    whose real size the data decides per step (its messages carry it, :func:`~graphpipe.runtime.comm.send_header`)."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(meta_nonzero_assume_all_nonzero=True)


@contextlib.contextmanager
def params_on_meta() -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Build modules inside this block with their parameters on the meta device (buffers and every other tensor,
    example inputs included, stay where they are built).

    Each parameter is created as its module's code creates it and moved to
    meta at once, so the block holds one real parameter at a time and the
    code's random draws (the example inputs' among them) are the ones an
    eager build makes. A parameter of a module without ``reset_parameters``
    (CLIP's ``logit_scale``, a class token) has no initialiser to run again:
    it stays real until the block ends (its module's constructor may still
    fill it), then moves to meta and its built value is kept in the yielded
    dict, ``id(meta parameter) -> (meta parameter, value)``
    (:func:`kept_values` names them).
    """
    original = nn.Module.register_parameter
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    raw: list[tuple[nn.Module, str]] = []

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.device.type == "meta":
            return
        if _has_initialiser(module):
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        else:
            raw.append((module, name))

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield kept
        moved: dict[int, nn.Parameter] = {}
        for module, name in raw:
            p = module._parameters.get(name)
            if p is None or p.device.type == "meta":
                continue
            if id(p) not in moved:
                meta = moved[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                kept[id(meta)] = (meta, p.detach())
            module._parameters[name] = moved[id(p)]
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _has_initialiser(module: nn.Module) -> bool:
    """Whether ``module`` can fill its parameters again (``reset_parameters``, or ``nn.MultiheadAttention``'s
    ``_reset_parameters``)."""
    return callable(getattr(module, "reset_parameters", None)) or callable(getattr(module, "_reset_parameters", None))


def kept_values(module: nn.Module, kept: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """:func:`params_on_meta`'s kept values by the parameters' names in ``module``."""
    return {name: kept[id(p)][1] for name, p in module.named_parameters() if id(p) in kept}


def buffers_to_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move every buffer of ``module`` to the meta device (in place); returns their built values by name, for
    :func:`materialize_stages`' ``initial`` (buffers such as index tables are computed in ``__init__``, and no
    initialiser rebuilds them)."""
    values = {name: b.detach().clone() for name, b in module.named_buffers() if b.device.type != "meta"}
    moved: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for key, b in sub._buffers.items():
            if b is not None and b.device.type != "meta":
                sub._buffers[key] = moved.setdefault(id(b), b.to("meta"))
    return values


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def meta_copy(value: Any) -> Any:
    """``value`` with every tensor leaf replaced by a meta tensor of its shape and dtype (example inputs)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of the tensor called ``name`` in the model, for run seed ``seed`` (stable across
    processes and Python versions: no ``hash()``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def model_tensors(model: nn.Module) -> dict[int, tuple[nn.Module, str, str, str]]:
    """``id(tensor) -> (owning module, "_parameters" or "_buffers", attribute, name in the model)`` for every
    parameter and buffer of ``model`` (a tensor reached under two names keeps its first)."""
    out: dict[int, tuple[nn.Module, str, str, str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(module, kind).items():
                if t is not None and id(t) not in out:
                    out[id(t)] = (module, kind, attr, f"{path}.{attr}" if path else attr)
    return out


class _SeedPerTensor(TorchFunctionMode):
    """Seeds the global generator from a tensor's name before any in-place call (``uniform_``, ``normal_``,
    ``nn.init.*_``) writing a tensor that has one; storage identifies the tensor, so ``.data`` views count."""

    def __init__(self, names: Mapping[int, str], seed: int):
        super().__init__()
        self.names, self.seed = names, seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "").endswith("_"):
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.device.type != "meta" and target.numel():
                name = self.names.get(target.untyped_storage().data_ptr())
                if name is not None:
                    torch.manual_seed(tensor_seed(self.seed, name))
        return func(*args, **kwargs)


class Materialized:
    """What :func:`materialize_stages` did on one rank: the real tensor of every hosted meta tensor, and the
    names of those no initialiser filled."""

    def __init__(self) -> None:
        self.replaced: dict[int, torch.Tensor] = {}
        """``id(meta tensor) -> real tensor`` (parameters stay parameters), while :attr:`meta` keeps the meta
        tensors alive (an id is unique among live objects only)."""
        self.meta: list[torch.Tensor] = []
        self.uninitialised: set[str] = set()
        """Model names of hosted tensors whose module has no initialiser: they must come from a checkpoint."""


def _holders(modules: Iterable[nn.Module]) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """``(table, key, tensor)`` of every parameter and buffer slot of ``modules`` (shared submodules included)."""
    for root in modules:
        for module in root.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for key, t in table.items():
                    if t is not None:
                        yield table, key, t


def _stage_graphs(prog) -> list[torch.fx.GraphModule]:
    """A stage's modules: its own, and its segments' and assembly's when it has checkpoints (they hold their
    own references to the stage's tensors)."""
    return [prog.module, *(seg.module for seg in prog.segments), *([prog.assemble] if prog.assemble else [])]


def materialize_stages(model: nn.Module | None, programs: Mapping[int, Any], device: torch.device,
                       seed: int, initial: Mapping[str, torch.Tensor] | None = None) -> Materialized:
    """Give every meta parameter and buffer of the stage programs ``programs`` (stage id ->
    :class:`~graphpipe.runtime.stage_modules.StageProgram`, this rank's) storage on ``device`` and initialise
    it (module docstring); nothing else is allocated. Device literals of their graphs move to ``device``.

    ``model``: the module the stages were captured from (its submodules own
    the initialisers; None: no initialiser, every tensor is uninitialised).
    ``initial``: values by model name that replace what the initialisers
    made (:func:`buffers_to_meta`'s).
    Stage modules share tensors with ``model``: the real tensors replace the
    meta ones in both, and a tied copy (named after its original,
    :attr:`StageProgram.param_names`) gets its own parameter, equal to the
    original.
    """
    done = Materialized()
    owners = model_tensors(model) if model is not None else {}
    # model name of every meta tensor the stages hold; a tied copy is named after its original
    wanted: dict[int, str] = {}
    known: dict[int, torch.Tensor] = {}  # a graph constant made from Python data: its values (exporting.DATA_VALUE)
    for prog in programs.values():
        for name, p in prog.module.named_parameters(remove_duplicate=False):
            if p.device.type == "meta" and id(p) not in wanted:
                wanted[id(p)] = owners[id(p)][3] if id(p) in owners else prog.param_names.get(name, name)
                done.meta.append(p)
        for name, b in prog.module.named_buffers(remove_duplicate=False):
            if b.device.type == "meta" and id(b) not in wanted:
                wanted[id(b)] = owners[id(b)][3] if id(b) in owners else name
                done.meta.append(b)
                if id(b) not in owners and getattr(b, DATA_VALUE, None) is not None:
                    known[id(b)] = getattr(b, DATA_VALUE)
    graphs = [gm for prog in programs.values() for gm in _stage_graphs(prog)]
    for gm in graphs:
        if isinstance(gm, torch.fx.GraphModule):
            retarget_devices(gm, device)
    if not wanted:
        return done
    by_name = {entry[3]: entry for entry in owners.values()}
    known_names = {wanted[tid] for tid in known}
    real: dict[str, torch.Tensor] = {}  # model name -> its real tensor (set into the model's own module)
    for name in wanted.values():
        if name in real or name in done.uninitialised:
            continue
        if name not in by_name:  # a tensor of the stage modules only (a graph constant): no initialiser knows it
            if name not in known_names:
                done.uninitialised.add(name)
            continue
        module, kind, attr, _ = by_name[name]
        old = getattr(module, kind)[attr]
        # filled on the CPU and moved after: a CUDA generator draws other values than the CPU's, and the values
        # must not depend on the device (the --check reference runs on the CPU); what no initialiser writes is zero
        new = torch.zeros_like(old, device="cpu")
        if kind == "_parameters":
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        getattr(module, kind)[attr] = new
        done.replaced[id(old)] = new
        done.meta.append(old)
        real[name] = new
    _initialise(model, owners, real, done, seed)
    with torch.no_grad():
        for name, value in (initial or {}).items():
            if name in real:
                real[name].copy_(value)
                done.uninitialised.discard(name)
    if torch.device(device).type != "cpu":
        moved_from = {}
        for name, t in list(real.items()):
            module, kind, attr, _ = by_name[name]
            moved = t.detach().to(device)
            if kind == "_parameters":
                moved = nn.Parameter(moved, requires_grad=t.requires_grad)
            getattr(module, kind)[attr] = moved
            moved_from[id(t)] = moved
            real[name] = moved
        done.replaced = {k: moved_from.get(id(v), v) for k, v in done.replaced.items()}
    for tid, name in wanted.items():  # tied copies: their own parameter, equal to the original
        if tid in done.replaced or name not in real:
            continue
        base = real[name]
        done.replaced[tid] = nn.Parameter(base.detach().clone(), requires_grad=base.requires_grad) \
            if isinstance(base, nn.Parameter) else base.detach().clone()
    for table, key, t in list(_holders(graphs)):
        if id(t) in done.replaced:
            table[key] = done.replaced[id(t)]
        elif id(t) in known:  # a constant made from Python data: the values export saw
            done.replaced[id(t)] = known[id(t)].to(device, copy=True)
            table[key] = done.replaced[id(t)]
        elif id(t) in wanted:  # no owner in the model: storage only, filled by a checkpoint
            fresh = torch.empty_like(t, device=device)
            done.replaced[id(t)] = nn.Parameter(fresh, requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else fresh
            table[key] = done.replaced[id(t)]
    done.replaced, done.meta = {}, []  # ids of meta tensors mean nothing once those are freed
    return done


def materialize_unused(model: nn.Module | None, programs: Iterable[Any], seed: int) -> set[str]:
    """Give the model's meta parameters and persistent buffers that no stage program holds (the forward never
    reads them: a VLM's unused ``post_layernorm``) real CPU storage, initialised as a hosted tensor would be
    (seeded by ``seed`` and the tensor's name, :func:`materialize_stages`), so that a checkpoint of a model built
    without weights is still whole. Returns the names no initialiser filled (they have no values to save).
    """
    if model is None:
        return set()
    held: set[int] = set()
    for prog in programs:
        for module in _stage_graphs(prog):
            held.update(id(t) for _, _, t in _holders([module]))
    persistent = set(model.state_dict(keep_vars=True))
    loose = [(name, t) for name, t in (*model.named_parameters(), *model.named_buffers())
             if t.device.type == "meta" and id(t) not in held and name in persistent]
    if not loose:
        return set()
    holder = nn.Module()  # a stand-in stage holding only these tensors, under any keys (the model names them)
    for i, (_, t) in enumerate(loose):
        if isinstance(t, nn.Parameter):
            holder.register_parameter(f"p{i}", t)
        else:
            holder.register_buffer(f"b{i}", t)
    from types import SimpleNamespace

    stand_in = SimpleNamespace(module=holder, param_names={}, segments=(), assemble=None)
    return materialize_stages(model, {-1: stand_in}, torch.device("cpu"), seed).uninitialised


def _initialise(model: nn.Module | None, owners, real: Mapping[str, torch.Tensor], done: Materialized,
                seed: int) -> None:
    """Run each owning module's initialiser once, every fill seeded by the filled tensor's name."""
    if model is None:
        done.uninitialised.update(real)
        return
    hf_init = getattr(model, "_init_weights", None)
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    modules = dict(model.named_modules(remove_duplicate=False))
    owned: dict[int, tuple[nn.Module, str, list[str]]] = {}  # initialising module -> its path, the tensors it fills
    for module, _, _, full in owners.values():
        if full in real:
            module, path = _initialiser_of(module, paths[id(module)], modules)
            owned.setdefault(id(module), (module, path, []))[2].append(full)
    ptrs = {t.untyped_storage().data_ptr(): name for name, t in real.items() if t.numel()}
    with torch.no_grad(), _SeedPerTensor(ptrs, seed):
        for module, path, tensors in owned.values():
            kept = _others_kept(module, ptrs)
            torch.manual_seed(tensor_seed(seed, path))
            reset = getattr(module, "reset_parameters", getattr(module, "_reset_parameters", None))
            if callable(reset):
                with _through_parametrizations(module):
                    reset()
            if callable(hf_init):  # the model's own scheme, over torch's default where it has one
                hf_init(module)
            elif not callable(reset):
                done.uninitialised.update(tensors)
            for t, value in kept:
                t.copy_(value)


def _others_kept(module: nn.Module, filling: Mapping[int, str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``module``'s own tensors that already hold values and are not being filled now, with copies of them.

    An initialiser fills all of its module's tensors (Hugging Face's ``_init_weights`` of DINOv2's embeddings
    draws ``cls_token`` and ``position_embeddings`` and zeroes ``mask_token``). Materializing one of them later
    (the unused ``mask_token``, for a whole checkpoint) ran it again and redrew the others, unseeded by their
    names: they no longer equaled the reference's, and ``--check`` failed on a correct run. They are put back."""
    kept = []
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if t is not None and t.device.type != "meta" and t.numel() and t.untyped_storage().data_ptr() not in filling:
            kept.append((t, t.detach().clone()))
    return kept


@contextlib.contextmanager
def _through_parametrizations(module: nn.Module) -> Iterator[None]:
    """Let ``module``'s initialiser fill its parametrized tensors (``weight_norm``'s ``weight``: HuBERT's and
    Wav2Vec2's positional convolution).

    Reading a parametrized ``module.weight`` computes a new tensor from the
    stored originals (weight norm's ``g`` and ``v``), so ``reset_parameters``
    filling it in place filled a temporary and left the originals as
    allocated (garbage: the model trained to NaN). Inside this block the name
    reads a plain tensor of its shape; after the initialiser it is assigned
    back, which sets the originals through the parametrization's
    ``right_inverse`` as an eager ``module.weight = ...`` does.
    """
    from torch.nn.utils import parametrize

    if not parametrize.is_parametrized(module):
        yield
        return
    cls = type(module)  # parametrize gave this module a class of its own, holding one property per name
    plain = {name: torch.empty_like(getattr(module, name)) for name in module.parametrizations}
    saved = {name: cls.__dict__[name] for name in plain}
    for name in plain:
        setattr(cls, name, property(lambda self, name=name: plain[name]))
    try:
        yield
    finally:
        for name, prop in saved.items():
            setattr(cls, name, prop)
    for name, value in plain.items():
        setattr(module, name, value)


def _initialiser_of(module: nn.Module, path: str, modules: Mapping[str, nn.Module]) -> tuple[nn.Module, str]:
    """The module whose initialiser fills ``module``'s own tensors: itself when it has ``reset_parameters``
    (or ``nn.MultiheadAttention``'s ``_reset_parameters``), else its nearest ancestor that has one, else itself."""
    here = path
    while True:
        m = modules[here]
        if _has_initialiser(m):
            return m, here
        if not here:
            return module, path
        here = here.rpartition(".")[0]


@contextlib.contextmanager
def as_traced(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> Iterator[Any]:
    """Run the captured ``gm`` at the precision it was traced at inside this block; yields the converter for its
    inputs. A bf16 trace (``gm.meta[PRECISION_KEY]``) holds bf16 constants and branches that only fit the dtypes
    autocast gives (an attention mask made bf16 beside fp32 queries fails outside it), so it runs under bf16
    autocast, on fake CPU tensors when its tensors are on the meta device (:func:`fake_cpu`); an fp32 trace runs
    as it is."""
    from graphpipe.frontend.exporting import PRECISION_KEY

    if gm.meta.get(PRECISION_KEY, "fp32") != "bf16":
        yield lambda x: x
        return
    tensors = [t for t in (*gm.parameters(), *gm.buffers(), *inputs) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in tensors):
        with fake_cpu(gm) as convert, torch.autocast("cpu", dtype=torch.bfloat16):
            yield convert
        return
    with torch.autocast(next((t.device.type for t in tensors), "cpu"), dtype=torch.bfloat16):
        yield lambda x: x


@contextlib.contextmanager
def fake_cpu(gm: torch.fx.GraphModule) -> Iterator[Any]:
    """Run ``gm``, whose tensors are on the meta device, on fake CPU tensors inside this block (for what only
    CPU kernels decide, such as autocast's dtypes); yields the converter for its inputs. Its device literals move
    to the CPU for good (stage modules cut before keep theirs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphpipe.frontend.export_inputs import fake_cpu_copy, restore_state, swap_state

    retarget_devices(gm, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = functools.partial(fake_cpu_copy, mode)
        swapped = swap_state(gm, fake)
        try:
            yield fake
        finally:
            restore_state(gm, swapped)
