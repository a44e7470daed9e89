"""An LSTM language model that carries its hidden state from batch to batch, word-language-model style.

The token stream is cut into ``BSZ`` columns and read ``BPTT`` tokens at a
time; the hidden state at the end of one chunk is where the next chunk
starts (detached, so backpropagation stops at the chunk's edge). That
hidden state is training state like the weights: lose it at a restart and
the next chunk starts from zeros. ``resume`` restores a tensor value, or a
tuple of them like this ``(h, c)``, in place, so ``hidden`` holds the saved
pair after it; each save hands the current pair, since the loop reassigns
it every step. examples/before/loop_lstm.py is the loop without
checkpoints; this file changes five lines of it (``tests/test_recipes.py``
counts them): the manager, the restore, the start step (a modified line, 2)
and the save:

    python -m ckpt_lesson resume-test -- python examples/loop_lstm.py

``--mistake hidden`` starts from zeros after the restore (the lines marked
MISTAKE); the step after a restart then differs,
and ``resume-test`` names the metric ``hidden_in`` (the norm of the state a
step starts from, logged for exactly this reason) in its diagnosis.

The position in the data is a function of the step (chunk ``i`` of epoch
``e``), as in the classic example, so nothing else needs saving for it.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import ckpt_lesson as cl

VOCAB, BSZ, BPTT = 24, 4, 8


class RNNModel(nn.Module):
    def __init__(
        self, vocab: int, emb: int = 32, hid: int = 48, layers: int = 2, dropout: float = 0.2
    ) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hid, layers, dropout=dropout)
        self.decoder = nn.Linear(hid, vocab)
        self.layers, self.hid = layers, hid

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(out)), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.layers, bsz, self.hid), torch.zeros(self.layers, bsz, self.hid)


def make_corpus(seed: int, n: int = 1200) -> torch.Tensor:
    # A stream with structure to learn: each token mostly follows from the previous one.
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(VOCAB, (VOCAB, 3), generator=g)
    tokens = [0]
    for _ in range(n - 1):
        tokens.append(int(table[tokens[-1], torch.randint(3, (1,), generator=g)]))
    stream = torch.tensor(tokens)
    cols = len(stream) // BSZ
    return stream[: cols * BSZ].view(BSZ, cols).t().contiguous()  # (time, batch): "batchify"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mistake", choices=("hidden",), help="start from zeros at a restart")  # MISTAKE
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1111)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    data = make_corpus(args.seed)
    chunks = (data.size(0) - 1) // BPTT  # chunks per epoch
    model = RNNModel(VOCAB)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    hidden = model.init_hidden(BSZ)
    mgr = cl.CheckpointManager(every_steps=10)  # into $CKPT_LESSON_CKPT_DIR if set, else checkpoints/
    start, state = mgr.resume(model=model, optimizer=optimizer, hidden=hidden)  # in place, hidden too
    if args.mistake == "hidden":  # MISTAKE: a resumed run starts its next chunk from zeros
        hidden = model.init_hidden(BSZ)  # MISTAKE

    model.train()
    for step in range(start + 1, args.steps + 1):
        chunk = (step - 1) % chunks
        if chunk == 0:
            hidden = model.init_hidden(BSZ)  # a new epoch starts from zeros, as in the classic example
        i = chunk * BPTT
        x, y = data[i : i + BPTT], data[i + 1 : i + 1 + BPTT]
        hidden_in = float(sum(h.norm() for h in hidden))
        hidden = tuple(h.detach() for h in hidden)  # "repackage": gradients stop at the chunk's edge
        output, hidden = model(x, hidden)
        loss = nn.functional.cross_entropy(output.view(-1, VOCAB), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        hidden = tuple(h.detach() for h in hidden)
        cl.log_step(step, loss.item(), sample_ids=[i], hidden_in=hidden_in)
        mgr.save_if_due(step, {**state, "hidden": hidden})  # every 10 steps, with this step's hidden state
    return 0


if __name__ == "__main__":
    sys.exit(main())
