"""Tiny models for the FSDP / tensor-parallel stage tests (no dropout or BatchNorm: pipelined training equals
plain single-process training to fp32 rounding), and the hand-written plans they run under.

A plan is written as the stages' op-name prefixes, devices and layouts (tp, shard); :func:`hand_plan` turns that
into a validated plan with the 1f1b (or another) schedule, as a person editing a plan's JSON would.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 8
WIDTH = 16


class MLPChain(nn.Module):
    """Two Megatron-style MLP blocks (column-wise then row-wise) and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, WIDTH)
        self.block0 = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.block1 = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        h = h + self.block0(h)
        h = h + self.block1(h)
        return self.head(h)


class Branchy(nn.Module):
    """Two MLP branches over one stem, joined by a head: branches can take different layouts."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, WIDTH)
        self.left = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))
        self.right = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(2 * WIDTH, 3)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        return self.head(torch.cat([self.left(h), self.right(h)], dim=-1))


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(BATCH, 6, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)


def _ce(out, labels):
    return F.cross_entropy(out, labels)


def mlp_chain():
    torch.manual_seed(0)
    return MLPChain(), _data()[0], _ce, _data()[1]


def branchy():
    torch.manual_seed(0)
    return Branchy(), _data()[0], _ce, _data()[1]


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def llama():
    """A tiny Hugging Face Llama (GQA: 4 heads, 2 KV heads), loss = next-token cross-entropy on fixed ids."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    ids = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(7))
    return _Logits(model), ids, _next_token, ids


def gpt2():
    """A tiny Hugging Face GPT-2 (its layers are ``Conv1D``: ``addmm`` on ``(in, out)`` weights; the fused q/k/v
    projection), dropout off, embeddings tied to the head; loss = next-token cross-entropy on fixed ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    ids = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(7))
    return _Logits(GPT2LMHeadModel(cfg)), ids, _next_token, ids


def gpt2_dropout():
    """The same GPT-2 with dropout on (0.2 on the embeddings, the residual branches and the attention)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.2,
                     embd_pdrop=0.2, attn_pdrop=0.2, use_cache=False)
    ids = torch.randint(0, 64, (BATCH, 12), generator=torch.Generator().manual_seed(7))
    return _Logits(GPT2LMHeadModel(cfg)), ids, _next_token, ids


def _next_token(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def hand_plan(spec: str, stages: list[tuple], *, batch: int = BATCH,
              micro_batch_size: int = 4, schedule: str = "1f1b", devices: int | None = None,
              shared_devices: bool = False, sequence_parallel: bool = False, keep_gathered: bool = False):
    """A plan of ``spec`` with the stages written by hand: ``(op-name prefixes, devices, tp, shard)`` each, and
    optionally a fifth item, a dict of other :class:`~graphpipe.stages.Stage` fields (``replica_mode``,
    ``reshard_after_forward``, ``micro_batch_size``...); every op goes to the first stage one of whose prefixes
    starts its name (``""`` takes the rest); with ``sequence_parallel`` every stage of tp 2 or more runs
    sequence parallel (keeping its gathered inputs whole with ``keep_gathered``)."""
    from dataclasses import replace

    from graphpipe.cluster import preset
    from graphpipe.sched.generators import make_schedule
    from graphpipe.search.common import SearchOptions
    from graphpipe.search.planner import make_plan
    from graphpipe.stages import Stage, StageGraph

    stages = [(*st, {}) if len(st) == 4 else tuple(st) for st in stages]
    num_devices = devices or max(d for _, ds, _, _, _ in stages for d in ds) + 1
    source = _loaded(spec)
    base = make_plan(source.model_id, source.graph, preset("v100", num_devices), batch, "gpipe",
                     SearchOptions(micro_batch_size=micro_batch_size))
    graph = base.stage_graph.graph
    owner: dict[int, int] = {}
    for op_id, op in enumerate(graph.ops):
        owner[op_id] = next(i for i, (prefixes, *_) in enumerate(stages)
                            if any(op.name.startswith(p) for p in prefixes))
    built = [Stage(i, tuple(o for o, s in owner.items() if s == i), tuple(ds),
                   **{"micro_batch_size": micro_batch_size, "tp": tp, "shard": shard,
                      "sequence_parallel": sequence_parallel and tp > 1, "keep_gathered": keep_gathered and tp > 1,
                      **fields})
             for i, (_, ds, tp, shard, fields) in enumerate(stages)]
    sg = StageGraph.build(graph, built, batch, num_devices, allow_shared_devices=shared_devices)
    return replace(base, stage_graph=sg, schedule=make_schedule(schedule, sg), predicted={}, strategy="custom")


@functools.lru_cache(maxsize=None)
def _loaded(spec: str):
    """The captured model of ``spec``, once per process (a capture takes seconds)."""
    from graphpipe.models import load_model

    return load_model(spec)


class _Writer(nn.Module):
    """Writes its own projection into the first columns of the tensor it is given, in place, and returns it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, 4)

    def forward(self, y, h):
        y[:, :4] = self.proj(h)
        return y


class WritesAcrossOps(nn.Module):
    """A value one op makes (``a``'s output) is written into by another op (``writer``, a slice assignment)
    and read after the write by a third (``head``): the write must reach that reader, as eagerly."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, WIDTH)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.writer = _Writer()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        y = self.a(h)
        self.writer(y, h)
        return self.head(torch.tanh(y))


def writes_across_ops():
    torch.manual_seed(0)
    return WritesAcrossOps(), _data()[0], _ce, _data()[1]
