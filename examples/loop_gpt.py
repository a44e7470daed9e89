"""A tiny GPT-style character trainer, in the shape of the popular single-file GPT scripts.

``torch.compile`` on, gradient accumulation, and the next batch fetched while
the current one is still in flight (the "prefetch"). It resumes bit for bit:

    python -m ckpt_lesson resume-test -- python examples/loop_gpt.py

examples/before/loop_gpt.py is the loop without checkpoints, in nanoGPT's
shape (``iter_num = 0``, then ``while``); this file adds four lines
(``tests/test_recipes.py`` counts them). The one that needs thought is the
RNG: batches are drawn from the global generator, and the loop draws step
N+1's batch *before* step N is saved. A save that captured the RNG at save
time would hold a generator that has already drawn that batch, so a resumed
run would skip it. The loop therefore takes a snapshot with
``cl.capture_rng_state()`` just before each prefetch and hands the last one
to ``save_if_due(..., rng=snapshot)``.

``--mistake rng-after-prefetch`` saves without that snapshot (the lines
marked MISTAKE: the RNG as it is at save time); ``resume-test`` then FAILs,
because the first batch after a restart is not the one the uninterrupted run
trained on.

``--backend inductor`` compiles for real (tens of seconds on a small CPU);
the default ``eager`` backend gives the same wrapper, the same ``_orig_mod.``
keys and the same numbers in well under a second.
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
    parser.add_argument("--mistake", choices=("rng-after-prefetch",), help="save the RNG late")  # MISTAKE
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
    mgr = cl.CheckpointManager(every_steps=10)  # into $CKPT_LESSON_CKPT_DIR if set, else checkpoints/
    step, state = mgr.resume(model=model, optimizer=optimizer)  # the compiled model as it is

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
            snapshot = cl.capture_rng_state()  # the generator before it draws the next batch
            x, y, ix = get_batch()  # prefetch: the next micro-batch, while this one's backward is pending
            loss.backward()
            total += loss.item()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cl.log_step(step, total, sample_ids=seen, lr=optimizer.param_groups[0]["lr"])
        if args.mistake == "rng-after-prefetch":  # MISTAKE: the generator as it is at the save, after
            snapshot = None  # MISTAKE: it drew the next batch; a resumed run draws the one after that
        mgr.save_if_due(step, state, rng=snapshot)  # every 10 steps, the RNG as it was before the prefetch
    return 0


if __name__ == "__main__":
    sys.exit(main())
