"""EfficientNet-B0 and Inception-v3, written from their papers in plain PyTorch, random weights, no downloads.

``file.py:factory`` entries for :mod:`graphpipe.evals.ill_conditioned` and the
tests. At the small images and micro-batches a CPU run can afford, both are
*ill-conditioned*: their BatchNorms normalise over a handful of values per
channel (EfficientNet's last stages see 1x1 maps, Inception's last blocks too),
so fp32 rounding alone moves some gradients by more than their own size, and
plain eager PyTorch at fp32 already differs from fp64 by that much
(:mod:`graphpipe.runtime.numerics`).

* :func:`efficientnet_b0`: Tan & Le (2019), table 1: a 3x3 stem, sixteen
  MBConv blocks (inverted bottleneck, depthwise 3x3/5x5, squeeze-and-excite
  at a quarter of the block's input width, SiLU) and a 1x1 head of 1280, on
  32x32 images, 10 classes;
* :func:`efficientnet_small`: the same blocks at a quarter of the width and
  one block per stage (a test-sized model that is still ill-conditioned);
* :func:`inception_v3`: Szegedy et al. (2016) as trained on ImageNet
  (modules 5b-7c, factorised 1x7/7x1 and 1x3/3x1 convolutions, BatchNorm
  eps 1e-3, no auxiliary head), on 75x75 images, the smallest its strides
  take, 10 classes.

The loss is cross-entropy against class targets (the factories' fourth item).
Dropout before the classifier is off (``p=0``) so ``--check`` compares
deterministic numbers; drop-path is left out for the same reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EfficientNet", "InceptionV3", "efficientnet_b0", "efficientnet_small", "inception_v3", "BATCH"]

BATCH = 16
CLASSES = 10


def _conv_bn(cin: int, cout: int, kernel, stride=1, groups: int = 1, eps: float = 1e-5, padding=None) -> list:
    pad = tuple(k // 2 for k in kernel) if isinstance(kernel, tuple) else kernel // 2
    return [nn.Conv2d(cin, cout, kernel, stride, pad if padding is None else padding, groups=groups, bias=False),
            nn.BatchNorm2d(cout, eps=eps)]


class MBConv(nn.Module):
    """Inverted bottleneck: expand 1x1, depthwise kxk, squeeze-and-excite, project 1x1; a residual when shapes keep."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int):
        super().__init__()
        mid = cin * expand
        self.expand = nn.Sequential(*_conv_bn(cin, mid, 1), nn.SiLU()) if expand != 1 else nn.Identity()
        self.depthwise = nn.Sequential(*_conv_bn(mid, mid, kernel, stride, groups=mid), nn.SiLU())
        squeeze = max(1, cin // 4)
        self.se_reduce = nn.Conv2d(mid, squeeze, 1)
        self.se_expand = nn.Conv2d(squeeze, mid, 1)
        self.project = nn.Sequential(*_conv_bn(mid, cout, 1))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = self.depthwise(self.expand(x))
        s = torch.sigmoid(self.se_expand(F.silu(self.se_reduce(h.mean((2, 3), keepdim=True)))))
        h = self.project(h * s)
        return x + h if self.residual else h


B0_STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
             (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
"""(expansion, kernel, stride, output channels, blocks) per stage: table 1 of the EfficientNet paper."""


class EfficientNet(nn.Module):
    def __init__(self, width: float = 1.0, max_blocks: int | None = None, classes: int = CLASSES):
        super().__init__()

        def w(c: int) -> int:
            return max(8, int(c * width + 4) // 8 * 8)

        cin = w(32)
        self.stem = nn.Sequential(*_conv_bn(3, cin, 3, 2), nn.SiLU())
        blocks = []
        for expand, kernel, stride, cout, repeats in B0_STAGES:
            for i in range(min(repeats, max_blocks or repeats)):
                blocks.append(MBConv(cin, w(cout), expand, kernel, stride if i == 0 else 1))
                cin = w(cout)
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(*_conv_bn(cin, w(1280), 1), nn.SiLU())
        self.classifier = nn.Linear(w(1280), classes)

    def forward(self, x):
        return self.classifier(self.head(self.blocks(self.stem(x))).mean((2, 3)))


def _basic(cin: int, cout: int, kernel, stride=1, padding=None) -> nn.Sequential:
    return nn.Sequential(*_conv_bn(cin, cout, kernel, stride, eps=1e-3, padding=padding), nn.ReLU())


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool: int):
        super().__init__()
        self.b1 = _basic(cin, 64, 1)
        self.b5 = nn.Sequential(_basic(cin, 48, 1), _basic(48, 64, 5))
        self.b3 = nn.Sequential(_basic(cin, 64, 1), _basic(64, 96, 3), _basic(96, 96, 3))
        self.bp = _basic(cin, pool, 1)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(F.avg_pool2d(x, 3, 1, 1))], 1)


class InceptionB(nn.Module):  # grid reduction 35 -> 17 in the paper
    def __init__(self, cin: int):
        super().__init__()
        self.b3 = _basic(cin, 384, 3, 2, padding=0)
        self.b33 = nn.Sequential(_basic(cin, 64, 1), _basic(64, 96, 3), _basic(96, 96, 3, 2, padding=0))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b33(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionC(nn.Module):  # factorised 7x7
    def __init__(self, cin: int, c7: int):
        super().__init__()
        self.b1 = _basic(cin, 192, 1)
        self.b7 = nn.Sequential(_basic(cin, c7, 1), _basic(c7, c7, (1, 7)), _basic(c7, 192, (7, 1)))
        self.b77 = nn.Sequential(_basic(cin, c7, 1), _basic(c7, c7, (7, 1)), _basic(c7, c7, (1, 7)),
                                 _basic(c7, c7, (7, 1)), _basic(c7, 192, (1, 7)))
        self.bp = _basic(cin, 192, 1)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b7(x), self.b77(x), self.bp(F.avg_pool2d(x, 3, 1, 1))], 1)


class InceptionD(nn.Module):  # grid reduction 17 -> 8 in the paper
    def __init__(self, cin: int):
        super().__init__()
        self.b3 = nn.Sequential(_basic(cin, 192, 1), _basic(192, 320, 3, 2, padding=0))
        self.b7 = nn.Sequential(_basic(cin, 192, 1), _basic(192, 192, (1, 7)), _basic(192, 192, (7, 1)),
                                _basic(192, 192, 3, 2, padding=0))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, 2)], 1)


class InceptionE(nn.Module):  # expanded filter bank, 1x3 and 3x1 side by side
    def __init__(self, cin: int):
        super().__init__()
        self.b1 = _basic(cin, 320, 1)
        self.b3 = _basic(cin, 384, 1)
        self.b3a, self.b3b = _basic(384, 384, (1, 3)), _basic(384, 384, (3, 1))
        self.b33 = nn.Sequential(_basic(cin, 448, 1), _basic(448, 384, 3))
        self.b33a, self.b33b = _basic(384, 384, (1, 3)), _basic(384, 384, (3, 1))
        self.bp = _basic(cin, 192, 1)

    def forward(self, x):
        h3, h33 = self.b3(x), self.b33(x)
        return torch.cat([self.b1(x), self.b3a(h3), self.b3b(h3), self.b33a(h33), self.b33b(h33),
                          self.bp(F.avg_pool2d(x, 3, 1, 1))], 1)


class InceptionV3(nn.Module):
    def __init__(self, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(_basic(3, 32, 3, 2, padding=0), _basic(32, 32, 3, padding=0), _basic(32, 64, 3),
                                  nn.MaxPool2d(3, 2), _basic(64, 80, 1), _basic(80, 192, 3, padding=0),
                                  nn.MaxPool2d(3, 2))
        self.mixed = nn.Sequential(InceptionA(192, 32), InceptionA(256, 64), InceptionA(288, 64), InceptionB(288),
                                   InceptionC(768, 128), InceptionC(768, 160), InceptionC(768, 160),
                                   InceptionC(768, 192), InceptionD(768), InceptionE(1280), InceptionE(2048))
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        return self.fc(self.mixed(self.stem(x)).mean((2, 3)))


def _example(model: nn.Module, size: int):
    x = torch.randn(BATCH, 3, size, size)
    target = torch.arange(BATCH) % CLASSES  # the runtime draws class indices in [min, max] of the example
    return model, (x,), F.cross_entropy, target


def efficientnet_b0():
    torch.manual_seed(0)
    return _example(EfficientNet(), 32)


def efficientnet_small():
    torch.manual_seed(0)
    return _example(EfficientNet(width=0.25, max_blocks=1), 32)


def inception_v3():
    torch.manual_seed(0)
    return _example(InceptionV3(), 75)
