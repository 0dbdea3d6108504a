#!/usr/bin/env python3
"""The model zoo of the prediction benchmark (predict_bench.py): training loops made of the
pinned PyTorch's own modules, nothing downloaded.

    python benchmarks/predict_zoo.py NAME BATCH OPTIMIZER STEPS
    python benchmarks/predict_zoo.py --list

Trains configuration NAME (``--list`` prints them, one JSON object per line: name, family,
the three batch sizes the benchmark uses) on batch size BATCH with OPTIMIZER (``sgd``:
SGD with momentum; ``adam``: Adam) for STEPS steps on ``cuda``, and prints ``step N``
after each. Batches are made on the device (no host copies); mixed-precision
configurations train under ``torch.autocast`` (bfloat16, or float16 with a GradScaler).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Config:
    family: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets)
    batches: tuple[int, int, int]
    amp: torch.dtype | None = None  # autocast's dtype; float16 trains with a GradScaler
    lm: bool = False  # the loss is over every position of a sequence


def mlp(widths: list[int]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    return build


def classes(n_in: tuple[int, ...], n_classes: int) -> Callable[[int], Any]:
    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, *n_in, device="cuda")
        return x, torch.randint(0, n_classes, (b,), device="cuda")

    return batch


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        mid = cout // 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet(
    block: type[nn.Module], depths: list[int], width: int, n_classes: int
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = [
            nn.Conv2d(3, width, 3, 1, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        ]
        cin = width
        for i, depth in enumerate(depths):
            cout = width * (2**i) * (4 if block is Bottleneck else 1)
            for j in range(depth):
                layers.append(block(cin, cout, 2 if j == 0 and i > 0 else 1))
                cin = cout
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, n_classes)]
        return nn.Sequential(*layers)

    return build


def vgg(channels: list[int], n_classes: int, side: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        cin = 3
        for c in channels:
            layers += [nn.Conv2d(cin, c, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2)]
            cin = c
        s = side // 2 ** len(channels)
        layers += [nn.Flatten(), nn.Linear(cin * s * s, 512), nn.ReLU(), nn.Linear(512, n_classes)]
        return nn.Sequential(*layers)

    return build


class Encoder(nn.Module):
    """A transformer encoder over sequences of vectors, classifying each sequence."""

    def __init__(self, d: int, heads: int, layers: int, n_classes: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=1))


class Decoder(nn.Module):
    """A decoder-only language model: token embeddings, causal self-attention, LM head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.seq = seq

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(self.seq, device=tokens.device)
        h = self.tok(tokens) + self.pos
        return self.head(self.body(h, mask=mask, is_causal=True))


def tokens(vocab: int, seq: int) -> Callable[[int], Any]:
    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, vocab, (b, seq), device="cuda")
        return t, torch.randint(0, vocab, (b, seq), device="cuda")

    return batch


class Bag(nn.Module):
    """A recommender's shape: a large embedding table summed into bags, then an MLP."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum")
        self.top = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 2))
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.table(ids))


def bags(rows: int, per_bag: int) -> Callable[[int], Any]:
    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, rows, (b, per_bag), device="cuda")
        return ids, torch.randint(0, 2, (b,), device="cuda")

    return batch


class Pooled(nn.Module):
    """A large vocabulary in and out: embeddings averaged, then a softmax over the vocabulary."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(dim=1))


def pooled(vocab: int, seq: int) -> Callable[[int], Any]:
    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (b, seq), device="cuda")
        return ids, torch.randint(0, vocab, (b,), device="cuda")

    return batch


BF16 = torch.bfloat16
FP16 = torch.float16

CONFIGS: dict[str, Config] = {
    "mlp-s": Config("mlp", mlp([512, 512, 512, 10]), classes((512,), 10), (64, 256, 1024)),
    "mlp-m": Config(
        "mlp", mlp([1024, 4096, 4096, 4096, 1000]), classes((1024,), 1000), (64, 256, 1024)
    ),
    "mlp-wide": Config("mlp", mlp([4096, 8192, 4096]), classes((4096,), 4096), (32, 128, 512)),
    "mlp-deep": Config("mlp", mlp([1024] * 17), classes((1024,), 1024), (64, 256, 1024)),
    "vgg-s": Config("cnn", vgg([64, 128, 256], 10, 32), classes((3, 32, 32), 10), (32, 64, 128)),
    "resnet-s": Config(
        "cnn", resnet(Basic, [1, 1, 1, 1], 32, 10), classes((3, 32, 32), 10), (32, 64, 128)
    ),
    "resnet-m": Config(
        "cnn", resnet(Basic, [2, 2, 2, 2], 64, 100), classes((3, 64, 64), 100), (16, 32, 64)
    ),
    "resnet-b": Config(
        "cnn", resnet(Bottleneck, [1, 2, 2, 1], 16, 100), classes((3, 64, 64), 100), (16, 32, 64)
    ),
    "enc-s": Config(
        "transformer", lambda: Encoder(256, 4, 2, 10), classes((128, 256), 10), (8, 16, 32)
    ),
    "enc-m": Config(
        "transformer", lambda: Encoder(512, 8, 4, 10), classes((256, 512), 10), (4, 8, 16)
    ),
    "dec-s": Config(
        "transformer", lambda: Decoder(8000, 256, 4, 2, 128), tokens(8000, 128), (4, 8, 16), lm=True
    ),
    "dec-m": Config(
        "transformer",
        lambda: Decoder(16000, 512, 8, 4, 256),
        tokens(16000, 256),
        (2, 4, 8),
        lm=True,
    ),
    "bag": Config("embedding", lambda: Bag(500_000, 64), bags(500_000, 20), (256, 1024, 4096)),
    "pooled": Config("embedding", lambda: Pooled(50_000, 256), pooled(50_000, 32), (32, 64, 128)),
    "mlp-m-bf16": Config(
        "mixed", mlp([1024, 4096, 4096, 4096, 1000]), classes((1024,), 1000), (64, 256, 1024), BF16
    ),
    "resnet-s-bf16": Config(
        "mixed", resnet(Basic, [1, 1, 1, 1], 32, 10), classes((3, 32, 32), 10), (32, 64, 128), BF16
    ),
    "enc-m-bf16": Config(
        "mixed", lambda: Encoder(512, 8, 4, 10), classes((256, 512), 10), (4, 8, 16), BF16
    ),
    "dec-s-bf16": Config(
        "mixed", lambda: Decoder(8000, 256, 4, 2, 128), tokens(8000, 128), (4, 8, 16), BF16, lm=True
    ),
    "resnet-m-fp16": Config(
        "mixed", resnet(Basic, [2, 2, 2, 2], 64, 100), classes((3, 64, 64), 100), (16, 32, 64), FP16
    ),
    "dec-m-fp16": Config(
        "mixed",
        lambda: Decoder(16000, 512, 8, 4, 256),
        tokens(16000, 256),
        (2, 4, 8),
        FP16,
        lm=True,
    ),
}
OPTIMIZERS = ("sgd", "adam")


def train(name: str, batch: int, optimizer: str, steps: int) -> None:
    c = CONFIGS[name]
    torch.manual_seed(0)
    model = c.build().cuda()
    params = model.parameters()
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(params, lr=1e-3)
    )
    scaler = torch.amp.GradScaler("cuda") if c.amp is FP16 else None
    for step in range(steps):
        x, y = c.batch(batch)
        with torch.autocast("cuda", dtype=c.amp or torch.float32, enabled=c.amp is not None):
            out = model(x)
            loss = (
                F.cross_entropy(out.flatten(0, 1), y.flatten()) if c.lm else F.cross_entropy(out, y)
            )
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step} {time.monotonic():.6f}", flush=True)


def main(argv: list[str]) -> int:
    if argv == ["--list"]:
        for name, c in CONFIGS.items():
            print(json.dumps({"name": name, "family": c.family, "batches": list(c.batches)}))
        return 0
    if len(argv) != 4 or argv[0] not in CONFIGS or argv[2] not in OPTIMIZERS:
        print(__doc__, file=sys.stderr)
        return 2
    train(argv[0], int(argv[1]), argv[2], int(argv[3]))
    return 0


def end(code: int) -> None:
    """Exit without finalizing the interpreter. PyTorch's autograd thread frees the last
    backward pass's graph after the backward call has returned, taking the GIL for the
    Python objects in it; a script that ends at once can start finalizing first, and
    CPython (before 3.14) ends a thread that takes the GIL then with pthread_exit, which
    unwinds through the autograd thread's noexcept frames: std::terminate, SIGABRT after
    the last step (about 1 run in 20 on a loaded host)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    end(main(sys.argv[1:]))
