"""Train a branchy classifier on scikit-learn's digits (shipped inside scikit-learn: no download) with graphpipe.

The model reads an 8x8 digit two ways at once: a row branch (each image row as a token, an MLP over the
flattened rows) and a column branch (the transposed image), joined by a head. A gpp plan puts the two branches
on different devices.

Plan it, train it on 4 CPU ranks, and train the same model in one process for comparison::

    graphpipe plan examples/digits.py:factory --devices 4 --batch-size 64 --micro-batch-size 16 --out digits.json
    torchrun --nproc-per-node 4 examples/digits.py train digits.json --epochs 8 --out digits-pipe.json
    python examples/digits.py single --epochs 8 --out digits-single.json
    python examples/digits.py plot digits-pipe.json digits-single.json --out digits.png

Each run writes its per-epoch mean training loss and its test accuracy; the two runs train the same algorithm
(no dropout, no BatchNorm), so the curves agree to fp32 rounding.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 64


class TwoViews(nn.Module):
    """Rows and columns of the image as two branches, concatenated into a classifier head."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.rows = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.cols = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, image):
        flat_rows = image.flatten(1)
        flat_cols = image.transpose(1, 2).flatten(1)
        return self.head(torch.cat([self.rows(flat_rows), self.cols(flat_cols)], dim=-1))


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def dataset():
    """``(train_x, train_y, test_x, test_y)``: the 1,797 digits scaled to [0, 1], a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def factory():
    """The ``file.py:factory`` the planner captures: the model, an example batch, the loss and example labels."""
    torch.manual_seed(0)
    x, y, _, _ = dataset()
    return TwoViews(), x[:BATCH], loss_fn, y[:BATCH]


def batches(x, y, epoch: int):
    """Whole mini-batches of a per-epoch shuffle (the last partial batch is dropped)."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + epoch))
    for i in range(0, len(x) - BATCH + 1, BATCH):
        idx = order[i:i + BATCH]
        yield x[idx], y[idx]


def train(args) -> None:
    import torch.distributed as dist

    import graphpipe

    torch.manual_seed(0)
    pipe = graphpipe.Pipeline(args.plan, TwoViews(), loss_fn)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    tx, ty, vx, vy = dataset()
    curve = []
    for epoch in range(args.epochs):
        losses = []
        for xb, yb in batches(tx, ty, epoch):
            losses.append(pipe.step(xb, yb).item())  # .item() waits for the device: a real loop logs less often
            pipe.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        sched.step()
        curve.append(sum(losses) / len(losses))
    accuracy = float((pipe.forward(vx).argmax(-1) == vy).float().mean())
    if dist.get_rank() == 0:
        _write(args.out, {"mode": "pipeline", "plan": args.plan, "loss": curve, "accuracy": accuracy})
        print(f"pipeline: accuracy {accuracy:.4f}, loss per epoch {' '.join(f'{v:.4f}' for v in curve)}")
    pipe.close()  # every rank meets, then the process group goes


def single(args) -> None:
    torch.manual_seed(0)
    model = TwoViews()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    tx, ty, vx, vy = dataset()
    curve = []
    for epoch in range(args.epochs):
        losses = []
        for xb, yb in batches(tx, ty, epoch):
            loss = loss_fn(model(xb), yb)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        sched.step()
        curve.append(sum(losses) / len(losses))
    with torch.no_grad():
        accuracy = float((model.eval()(vx).argmax(-1) == vy).float().mean())
    _write(args.out, {"mode": "single", "loss": curve, "accuracy": accuracy})
    print(f"single process: accuracy {accuracy:.4f}, loss per epoch {' '.join(f'{v:.4f}' for v in curve)}")


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for path in args.runs:
        with open(path) as f:
            run = json.load(f)
        ax.plot(range(1, len(run["loss"]) + 1), run["loss"], marker="o" if run["mode"] == "single" else "x",
                label=f"{run['mode']} (test accuracy {run['accuracy']:.3f})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean training loss")
    ax.set_title("digits: graphpipe on 4 CPU ranks vs one process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


def _write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="under torchrun: train through a plan")
    t.add_argument("plan")
    t.add_argument("--epochs", type=int, default=8)
    t.add_argument("--out", default="digits-pipe.json")
    s = sub.add_parser("single", help="the same training in one process")
    s.add_argument("--epochs", type=int, default=8)
    s.add_argument("--out", default="digits-single.json")
    p = sub.add_parser("plot", help="loss curves of runs")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="digits.png")
    args = parser.parse_args()
    {"train": train, "single": single, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
