"""Capturing a stack of identical blocks once (graphpipe.frontend.capture_repeats): the oracle is the whole capture."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphpipe.frontend import zoo
from graphpipe.frontend.capture import capture
from graphpipe.frontend.capture_repeats import KEPT, Stack, capture_graph, repeated_stacks, same_blocks, unrolled_capture
from graphpipe.evals.check_unrolled import IN_SUITE, check


def _whole(module, inputs, **kw):
    return capture(module, inputs, **kw).graph


def _tiny_llama(layers: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    return model, {"input_ids": ids}, dict(name="llama", loss_fn=loss_fn, example_target=ids.clone())


@pytest.mark.parametrize("layers", [9, 12])
def test_tiny_llama_unrolled_equals_whole_capture(layers):
    model, inputs, kw = _tiny_llama(layers)
    assert repeated_stacks(model) == [Stack("model.layers", tuple(str(i) for i in range(layers)))]
    unrolled = unrolled_capture(model, inputs, **kw)
    assert unrolled is not None
    whole = _whole(model, inputs, **kw)
    assert unrolled == whole  # names, kinds, costs, bytes, edges and ids
    assert [op.name for op in whole.ops][1:layers + 1] == [f"model.layers.{i}" for i in range(layers)]
    assert len(model.model.layers) == layers  # the cut stack is restored


def _tiny_lm(family: str):
    """A 10-layer causal LM of another family: (module, inputs, capture kwargs)."""
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=10, num_attention_heads=4, vocab_size=128,
                  max_position_embeddings=64)
    cls, config = {
        "qwen2": lambda: (transformers.Qwen2ForCausalLM,
                          transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)),
        "mistral": lambda: (transformers.MistralForCausalLM,
                            transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, **common)),
        "gpt-neox": lambda: (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**common)),
        "gpt2": lambda: (transformers.GPT2LMHeadModel,
                         transformers.GPT2Config(n_embd=64, n_layer=10, n_head=4, vocab_size=128, n_positions=64,
                                                 bos_token_id=0, eos_token_id=0)),
    }[family]()
    with torch.device("meta"):
        model = cls(config)

    def loss_fn(out, labels):
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    return model, {"input_ids": ids}, dict(name=family, loss_fn=loss_fn, example_target=ids.clone())


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt-neox", "gpt2"])
def test_other_lm_families_unrolled_equal_whole_capture(family):
    """Not Llama-specific: Qwen2 (tied head), Mistral (sliding window), GPT-NeoX and GPT-2 stacks unroll exactly."""
    model, inputs, kw = _tiny_lm(family)
    assert len(repeated_stacks(model)) == 1
    unrolled = unrolled_capture(model, inputs, **kw)
    assert unrolled is not None and unrolled == _whole(model, inputs, **kw)


def test_tiny_llama_bf16_unrolled_equals_whole_capture():
    model, inputs, kw = _tiny_llama(9)
    assert unrolled_capture(model, inputs, precision="bf16", **kw) == _whole(model, inputs, precision="bf16", **kw)


def test_zoo_transformer_branches_unrolled_equal_whole_capture():
    built = zoo.build("mmt:branches=2,layers=9,hidden=64,heads=4,ffn=128,seq=16", device="meta")
    stacks = repeated_stacks(built.module)
    assert [s.path for s in stacks] == ["branch0", "branch1"]
    kw = dict(name="mmt", loss_fn=built.loss_fn)
    unrolled = unrolled_capture(built.module, built.example_inputs, **kw)
    assert unrolled is not None and unrolled == _whole(built.module, built.example_inputs, **kw)


class _Block(nn.Module):
    def __init__(self, width: int, layer_idx: int, extra: bool = False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.layer_idx = layer_idx
        self.extra = extra

    def forward(self, x):
        x = torch.relu(self.fc(x))
        if self.layer_idx % 3 == 2:  # a forward that branches on its index: every third block does more
            x = self.fc(x)
        return x


class _Stack(nn.Module):
    def __init__(self, widths, every_third=False, count=None):
        super().__init__()
        self.inp = nn.Linear(8, widths[0])
        self.layers = nn.ModuleList(_Block(w, i if every_third else 0) for i, w in enumerate(widths))
        self.count = count

    def forward(self, x):
        x = self.inp(x)
        if self.count is not None:  # indexes the stack by a count of its own
            for i in range(self.count):
                x = self.layers[i](x)
            return x
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


def _mse(out):
    return (out ** 2).mean()


def test_blocks_of_different_shapes_are_not_merged():
    model = _Stack([16] * 5 + [32] + [16] * 4)  # the sixth block has other parameter shapes
    assert not same_blocks(list(model.layers)) and repeated_stacks(model) == []
    x = torch.randn(4, 8)
    assert unrolled_capture(model, (x,), loss_fn=_mse) is None


def test_block_attributes_must_match_except_a_counter():
    a, b = _Block(8, 0), _Block(8, 1)
    assert same_blocks([a, b, _Block(8, 2)])  # layer_idx counts the blocks
    assert not same_blocks([a, b, _Block(8, 7)])  # not a counter
    assert not same_blocks([a, _Block(8, 1, extra=True)])  # a plain attribute differs


def test_forward_branching_on_the_index_falls_back_to_the_whole_capture():
    model = _Stack([16] * 10, every_third=True)
    assert repeated_stacks(model)  # the blocks look identical...
    x = torch.randn(4, 8)
    assert unrolled_capture(model, (x,), loss_fn=_mse) is None  # ...but their ops are not periodic
    assert capture_graph(model, (x,), loss_fn=_mse) == _whole(model, (x,), loss_fn=_mse)


def test_forward_indexing_the_stack_by_its_own_count_falls_back():
    model = _Stack([16] * 10, count=10)
    x = torch.randn(4, 8)
    assert unrolled_capture(model, (x,), loss_fn=_mse) is None
    assert len(model.layers) == 10
    assert capture_graph(model, (x,), loss_fn=_mse) == _whole(model, (x,), loss_fn=_mse)


def test_tied_blocks_are_not_cut():
    model = _Stack([16] * 10)
    model.layers[3].fc.weight = model.layers[0].fc.weight
    assert repeated_stacks(model) == []


def test_short_stacks_are_left_whole():
    model = _Stack([16] * (2 * KEPT - 1))
    assert repeated_stacks(model) == []


# --- held-out architectures (evals/llm_configs.py at tiny widths): the oracle is the whole capture of the same model;
# evals/check_unrolled.py runs every case, the suite one per kind of stack (IN_SUITE)
@pytest.mark.slow
@pytest.mark.parametrize("arch", IN_SUITE)
def test_held_out_llm_unrolled_equals_whole_capture(arch):
    pytest.importorskip("transformers")
    check(arch)  # the stacks found, the unrolled graph equal to the whole capture, the stacks restored


class _Other(nn.Module):
    """Another kind of block (a different class): periodic stacks interleave it with :class:`_Block`."""

    def __init__(self, width: int, layer_idx: int = 0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.layer_idx = layer_idx

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x


class _Mixed(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("prefix, period, units", [(0, 2, 8), (3, 1, 9), (1, 3, 8), (2, 2, 9)])
def test_periodic_stack_with_a_prefix_unrolls_exactly(prefix, period, units):
    """A prefix of other blocks, then a unit of ``period`` blocks of two kinds repeated: found and unrolled exactly."""
    torch.manual_seed(0)
    blocks = [nn.Linear(16, 16) for _ in range(prefix)]  # a prefix of other modules
    layout = [_Other if j == period - 1 else _Block for j in range(period)]
    blocks += [(layout[j](16, prefix + u * period + j) if layout[j] is _Other else _Block(16, 0))
               for u in range(units) for j in range(period)]
    model = _Mixed(blocks)
    x = torch.randn(4, 16)
    stacks = repeated_stacks(model)
    assert [(s.start, s.period, s.units) for s in stacks] == [(prefix, period, units)]
    unrolled = unrolled_capture(model, (x,), loss_fn=_mse)
    assert unrolled is not None and unrolled == _whole(model, (x,), loss_fn=_mse)


def test_a_period_the_forward_breaks_falls_back():
    """Blocks alternating in two kinds whose forward also branches every third block: not periodic, whole capture."""
    blocks = [(_Block if i % 2 else _Other)(16, i) for i in range(16)]
    model = _Mixed(blocks)
    assert [(s.start, s.period) for s in repeated_stacks(model)] == [(0, 2)]  # the modules look periodic...
    x = torch.randn(4, 16)
    assert unrolled_capture(model, (x,), loss_fn=_mse) is None  # ...their ops are not
    assert capture_graph(model, (x,), loss_fn=_mse) == _whole(model, (x,), loss_fn=_mse)


def test_a_counter_must_count_with_the_period():
    """Along a period-2 stack, an integer attribute must step by 2 (a layer index), not by 1."""
    good = [(_Block if i % 2 else _Other)(16, i) for i in range(16)]
    assert same_blocks(good[1::2], stride=2) and not same_blocks(good[1::2])
    bad = [(_Block if i % 2 else _Other)(16, i // 2) for i in range(16)]
    assert not same_blocks(bad[1::2], stride=2)
