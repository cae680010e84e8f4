"""Held-out models for ``graphpipe run --compile --check`` (docs/limits.md, "Compiled stages"): tiny configs
built in code (hidden 32, 2 layers, random weights, nothing downloaded), each a ``file.py:factory``.

Hugging Face: decoders (mistral .. cohere, bloom, mamba), encoders (distilbert .. mpnet), vision (convnext ..
siglip), audio (whisper, wav2vec2, wav2vec2_mask with SpecAugment's time masking, hubert). Own modules:
``custom`` (a custom autograd.Function whose backward is the derivative, ``torch.utils.checkpoint``, in-place ops,
a parameter used twice), ``tied`` (a weight tied across two stages), ``ste`` (a straight-through estimator:
refused at capture), ``weightnorm`` (a weight-normed convolution).

Usage (CPU, 2 ranks; a model compiles in 1-3 minutes on 2 cores)::

    graphpipe plan evals/compile_heldout_models.py:hubert --devices 2 --batch-size 8 --strategy gpipe \
        --micro-batch-size 2 --out p.json
    graphpipe run p.json --compile --check --steps 2
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["mistral", "phi", "phi3", "stablelm", "gptj", "gptneo", "olmo2", "smollm3", "qwen3", "glm", "cohere",
           "distilbert", "roberta", "albert", "deberta", "electra", "mpnet", "convnext", "deit", "dinov2",
           "mobilevit", "regnet", "resnet", "siglip", "whisper", "wav2vec2", "wav2vec2_mask", "hubert", "mamba",
           "custom", "tied", "ste", "bloom", "weightnorm"]

B = 8
V = 64


def _T():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def _ids(length=8):
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, V, (B, length), generator=g), torch.randint(3, V, (B, length), generator=g)


def lm_loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def cls_loss(out, target):
    return F.cross_entropy(out.logits.float(), target)


def _lm(cls_name, cfg_name, **kw):
    T = _T()
    torch.manual_seed(0)
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V)
    base.update(kw)
    cfg = getattr(T, cfg_name)(**base)
    ids, target = _ids()
    return getattr(T, cls_name)(cfg), {"input_ids": ids}, lm_loss, target


def mistral():
    return _lm("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=4, attention_dropout=0.1)


def phi():
    return _lm("PhiForCausalLM", "PhiConfig", partial_rotary_factor=0.5, resid_pdrop=0.1, embd_pdrop=0.1)


def phi3():
    return _lm("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0)


def stablelm():
    return _lm("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=2, hidden_dropout=0.1)


def gptj():
    T = _T()
    torch.manual_seed(0)
    cfg = T.GPTJConfig(n_embd=32, n_head=4, n_layer=2, vocab_size=V, rotary_dim=4, n_positions=32)
    ids, target = _ids()
    return T.GPTJForCausalLM(cfg), {"input_ids": ids}, lm_loss, target


def gptneo():
    T = _T()
    torch.manual_seed(0)
    cfg = T.GPTNeoConfig(hidden_size=32, num_heads=4, num_layers=2, vocab_size=V, attention_types=[[["global", "local"], 1]],
                         window_size=4, max_position_embeddings=32)
    ids, target = _ids()
    return T.GPTNeoForCausalLM(cfg), {"input_ids": ids}, lm_loss, target


def olmo2():
    return _lm("Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=2, pad_token_id=0)


def smollm3():
    return _lm("SmolLM3ForCausalLM", "SmolLM3Config", num_key_value_heads=2, pad_token_id=0, no_rope_layers=[1, 0])


def qwen3():
    return _lm("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8)


def glm():
    return _lm("GlmForCausalLM", "GlmConfig", num_key_value_heads=2, head_dim=8, pad_token_id=0)


def cohere():
    return _lm("CohereForCausalLM", "CohereConfig", num_key_value_heads=2, pad_token_id=0)


def _enc(cls_name, cfg_name, **kw):
    T = _T()
    torch.manual_seed(0)
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=V,
                num_labels=3)
    base.update(kw)
    cfg = getattr(T, cfg_name)(**base)
    ids, _ = _ids()
    target = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    return getattr(T, cls_name)(cfg), {"input_ids": ids, "attention_mask": mask}, cls_loss, target


def distilbert():
    T = _T()
    torch.manual_seed(0)
    cfg = T.DistilBertConfig(dim=32, hidden_dim=64, n_heads=4, n_layers=2, vocab_size=V, num_labels=3)
    ids, _ = _ids()
    target = torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(3))
    return T.DistilBertForSequenceClassification(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, \
        cls_loss, target


def roberta():
    return _enc("RobertaForSequenceClassification", "RobertaConfig", pad_token_id=1, max_position_embeddings=40)


def albert():
    return _enc("AlbertForSequenceClassification", "AlbertConfig", embedding_size=16, num_hidden_layers=4)


def deberta():
    return _enc("DebertaV2ForSequenceClassification", "DebertaV2Config", relative_attention=True,
                pos_att_type=["p2c", "c2p"], max_relative_positions=16, position_buckets=8)


def electra():
    return _enc("ElectraForSequenceClassification", "ElectraConfig", embedding_size=16)


def mpnet():
    return _enc("MPNetForSequenceClassification", "MPNetConfig")


def _img(n=3, size=32):
    return torch.randn(B, n, size, size, generator=torch.Generator().manual_seed(2))


def _cls_target(k=3):
    return torch.randint(0, k, (B,), generator=torch.Generator().manual_seed(3))


def _vision(cls_name, cfg_name, size=32, **kw):
    T = _T()
    torch.manual_seed(0)
    cfg = getattr(T, cfg_name)(num_labels=3, **kw)
    return getattr(T, cls_name)(cfg), {"pixel_values": _img(size=size)}, cls_loss, _cls_target()


def convnext():
    return _vision("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1],
                   num_stages=2, drop_path_rate=0.1)


def deit():
    return _vision("DeiTForImageClassification", "DeiTConfig", image_size=32, patch_size=8, hidden_size=32,
                   intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, hidden_dropout_prob=0.1)


def dinov2():
    return _vision("Dinov2ForImageClassification", "Dinov2Config", image_size=32, patch_size=8, hidden_size=32,
                   num_attention_heads=4, num_hidden_layers=2, mlp_ratio=2, drop_path_rate=0.1)


def mobilevit():
    return _vision("MobileViTForImageClassification", "MobileViTConfig", image_size=32, patch_size=2,
                   hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=2,
                   hidden_dropout_prob=0.1)


def regnet():
    return _vision("RegNetForImageClassification", "RegNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                   depths=[1, 1], groups_width=8)


def resnet():
    return _vision("ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                   depths=[1, 1], layer_type="basic")


def siglip():
    T = _T()
    torch.manual_seed(0)
    cfg = T.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                               num_attention_heads=4, num_hidden_layers=2)
    return T.SiglipForImageClassification(T.SiglipConfig(vision_config=cfg.to_dict(), num_labels=3)), \
        {"pixel_values": _img()}, cls_loss, _cls_target()


def whisper():
    T = _T()
    torch.manual_seed(0)
    cfg = T.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
                          num_mel_bins=8, max_source_positions=8, max_target_positions=16, dropout=0.1,
                          pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)
    feats = torch.randn(B, 8, 16, generator=torch.Generator().manual_seed(2))
    ids, target = _ids()
    return T.WhisperForConditionalGeneration(cfg), {"input_features": feats, "decoder_input_ids": ids}, lm_loss, target


def _audio(cls_name, cfg_name, **kw):
    T = _T()
    torch.manual_seed(0)
    cfg = getattr(T, cfg_name)(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                               conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
                               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=3,
                               layerdrop=0.0, **kw)
    wav = torch.randn(B, 400, generator=torch.Generator().manual_seed(2))
    return getattr(T, cls_name)(cfg), {"input_values": wav}, cls_loss, _cls_target()


def wav2vec2():
    return _audio("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", mask_time_prob=0.0)


def wav2vec2_mask():
    return _audio("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", mask_time_prob=0.2, mask_time_length=2)


def hubert():
    return _audio("HubertForSequenceClassification", "HubertConfig", mask_time_prob=0.0)


def mamba():
    T = _T()
    torch.manual_seed(0)
    cfg = T.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2, vocab_size=V, expand=2, conv_kernel=4,
                        use_mambapy=True)
    ids, target = _ids()
    return T.MambaForCausalLM(cfg), {"input_ids": ids}, lm_loss, target


# ---- custom modules -------------------------------------------------------------------------------

class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class Custom(nn.Module):
    """custom autograd.Function, torch.utils.checkpoint, in-place ops, a parameter used in two places."""

    def __init__(self, d=16):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(d, d) for _ in range(4))
        self.shared = nn.Parameter(torch.randn(d) * 0.1)
        self.head = nn.Linear(d, 3)

    def block(self, h):
        return torch.tanh(self.l2(h))

    def forward(self, x):
        h = self.l1(x) + self.shared
        h = Cube.apply(h * 0.5)
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        h = self.l3(h)
        h.mul_(2.0)
        h[:, 0] += 1.0
        h.relu_()
        h = self.l4(h) * self.shared
        return self.head(h)


def custom():
    torch.manual_seed(0)
    x = torch.randn(B, 16, generator=torch.Generator().manual_seed(2))
    return Custom(), (x,), lambda o, y: F.cross_entropy(o, y), _cls_target()


class Tied(nn.Module):
    """One weight used by the first and the last layer (two stages)."""

    def __init__(self, d=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.mid = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(3)])
        self.out = nn.Linear(d, d)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(self.mid(self.inp(x))).sum(-1)


def tied():
    torch.manual_seed(0)
    x = torch.randn(B, 16, generator=torch.Generator().manual_seed(2))
    return Tied(), (x,), lambda o, y: F.mse_loss(o, y), torch.randn(B, generator=torch.Generator().manual_seed(3))


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding (quantization-aware training): round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class Quant(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(RoundSTE.apply(x)))
        return self.head(x)


def ste():
    torch.manual_seed(0)
    x = torch.randn(B, 16, generator=torch.Generator().manual_seed(2))
    return Quant(), (x,), lambda o, y: F.cross_entropy(o, y), _cls_target()


def bloom():
    T = _T()
    torch.manual_seed(0)
    cfg = T.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=V)
    ids, target = _ids()
    return T.BloomForCausalLM(cfg), {"input_ids": ids}, lm_loss, target


class WN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 8, 3, padding=1), dim=2)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.b(h.mean(1))


def weightnorm():
    torch.manual_seed(0)
    return WN(), (torch.randn(B, 5, 8, generator=torch.Generator().manual_seed(2)),), \
        lambda o, y: F.cross_entropy(o, y), _cls_target()
