"""Train a two-tower click model with graphpipe: plan it, then run this file under torchrun.

    graphpipe plan examples/two_tower.py:factory --devices 3 --batch-size 64 --out two_tower.json
    torchrun --nproc-per-node 3 examples/two_tower.py two_tower.json

Start as many ranks as the plan uses: ``plan`` prints the torchrun line. Given
``--devices 4`` it says the fourth device does not help this model at this
batch and writes a plan on 3; a job started with 4 ranks then stops on every
rank, before any collective, with one line naming the 3 and the flag.

The user tower and the item tower are branches: gpp puts them on different
devices, side by side. The data is synthetic (clicks from a fixed random
bilinear teacher), so the script needs no download; swap in your own loader.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpipe

USER_FEATURES, ITEM_FEATURES, BATCH = 32, 48, 64


def tower(features: int, hidden: int = 256, depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers)


class TwoTower(nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.user = tower(USER_FEATURES, hidden)
        self.item = tower(ITEM_FEATURES, hidden)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user, item):
        return self.head(torch.cat([self.user(user), self.item(item)], dim=1)).squeeze(1)


def loss_fn(logits, clicked):
    return F.binary_cross_entropy_with_logits(logits, clicked)


def clicks(num: int, seed: int):
    """``num`` synthetic (user, item, clicked) rows; the teacher is fixed, the rows depend on ``seed``."""
    rows = torch.Generator().manual_seed(seed)
    teacher = torch.randn(USER_FEATURES, ITEM_FEATURES, generator=torch.Generator().manual_seed(1234))
    user = torch.randn(num, USER_FEATURES, generator=rows)
    item = torch.randn(num, ITEM_FEATURES, generator=rows)
    return user, item, ((user @ teacher) * item).sum(dim=1).gt(0).float()


def factory():
    """What `graphpipe plan` captures: the module, example inputs, the loss and an example target."""
    user, item, clicked = clicks(8, seed=0)
    return TwoTower(), (user, item), loss_fn, clicked


def main(plan_path: str, epochs: int = 3) -> None:
    torch.manual_seed(0)  # every rank builds the same weights; each keeps only its stages
    pipe = graphpipe.Pipeline(plan_path, TwoTower(), loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    user, item, clicked = clicks(4096, seed=1)
    for epoch in range(epochs):
        total = 0.0
        for i in range(0, len(user), BATCH):
            total += pipe.step((user[i:i + BATCH], item[i:i + BATCH]), clicked[i:i + BATCH])
            pipe.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        if pipe.rank == 0:
            print(f"epoch {epoch}: mean loss {total / (len(user) // BATCH):.4f}", flush=True)
    pipe.save("two_tower_ckpt", optimizer=opt)  # torch.distributed.checkpoint, one file set for all ranks
    pipe.close()


if __name__ == "__main__":
    main(sys.argv[1])
