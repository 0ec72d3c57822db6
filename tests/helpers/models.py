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


class Aborting(Bigram):
    """Dies as a native library's fatal error does (gloo's uncaught IoException: SIGABRT), its last words on stderr."""

    def forward(self, tokens):
        import os
        import sys

        print("aborting: the test model's last words", file=sys.stderr, flush=True)
        os.abort()


def aborting(vocab: int = 256) -> nn.Module:
    return Aborting(vocab)


def not_a_module():
    return torch.zeros(3)


# The layout families the training-feature tests run on 2 gloo ranks: name -> (model family, layout).
TWO_RANK_LAYOUTS = {
    "gpt-dp2": ("gpt", {"dp": 2}),
    "gpt-dp2-zero3": ("gpt", {"dp": 2, "zero": 3}),
    "llama-tp2": ("llama", {"tp": 2}),
    "llama-pp2": ("llama", {"pp": 2, "pp_schedule": "1f1b"}),
}
