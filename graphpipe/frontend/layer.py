"""The base class of one-op layers: what capture keeps whole as one op (docs/design.md, "The op graph").

It lives apart from the zoo so that capture (which must recognise it) and the zoo (whose models are built of it)
do not import each other: both import this module.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["Layer"]


class Layer(nn.Module):
    """Base of every zoo layer: capture keeps it as one fx leaf = one op.

    ``kind`` becomes :attr:`graphpipe.graph.Op.kind`.
    """

    kind = "layer"
