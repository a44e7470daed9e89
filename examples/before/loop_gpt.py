"""The loop of examples/loop_gpt.py as a nanoGPT-style script writes it, before ckpt_lesson.

``torch.compile``, gradient accumulation, and the next micro-batch fetched
before the current one's backward (the "prefetch"); ``iter_num = 0`` and a
``while`` loop, as nanoGPT's train.py has. It logs each step with
``cl.log_step`` so that ``resume-test`` can compare runs; that call is the
only ckpt_lesson in it. ``tests/test_recipes.py`` counts the lines
examples/loop_gpt.py changes.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F

import ckpt_lesson as cl

BLOCK, BATCH, ACCUM = 16, 8, 2
TEXT = (
    "first citizen: before we proceed any further, hear me speak. all: speak, speak. "
    "first citizen: you are all resolved rather to die than to famish? all: resolved. "
) * 8


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, dim: int = 32, layers: int = 2, heads: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(BLOCK, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(dim, heads, dropout) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def get_lr(step: int, steps: int, base: float = 3e-3, warmup: int = 5) -> float:
    # The schedule is a function of the step, as in most GPT scripts: nothing to save for it.
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.1 * base + 0.45 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a fixed thread count: reductions add up in the same order every run
    torch.manual_seed(args.seed)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])

    def get_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))  # drawn from the global generator
        x = torch.stack([data[i : i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
        return x, y, ix

    model = torch.compile(GPT(len(chars)), backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    step = 0  # nanoGPT's iter_num

    model.train()
    x, y, ix = get_batch()  # the first batch, fetched before the loop
    while step < args.steps:
        step += 1
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step, args.steps)
        seen, total = [], 0.0
        for _ in range(ACCUM):
            loss = model(x, y) / ACCUM
            seen += ix.tolist()
            x, y, ix = get_batch()  # prefetch: the next micro-batch, while this one's backward is pending
            loss.backward()
            total += loss.item()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cl.log_step(step, total, sample_ids=seen, lr=optimizer.param_groups[0]["lr"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
