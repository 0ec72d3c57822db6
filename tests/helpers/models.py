"""Model factories used by tests through `model: {factory: "tests.helpers.models:..."}`."""
import torch
import torch.nn as nn


class Bigram(nn.Module):
    def __init__(self, vocab: int = 256, hidden: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def bigram(vocab: int = 256, hidden: int = 16) -> nn.Module:
    return Bigram(vocab, hidden)


class Exploding(Bigram):
    def forward(self, tokens):
        raise RuntimeError("boom: this model always fails in forward")


def exploding(vocab: int = 256) -> nn.Module:
    return Exploding(vocab)


def not_a_module():
    return torch.zeros(3)
