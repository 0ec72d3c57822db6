"""Layout-invariant token batches: global batch k depends only on (seed, k, global_batch).

Every rank computes the same global batch and keeps its dp slice, so any dp x tp x pp layout
trains on exactly the data the single-process run sees, and a resumed run picks up at any step
with no state to restore beyond the step number.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from workbench.errors import ConfigError

DEFAULT_TEXT = Path(__file__).parent / "assets" / "public_domain.txt"
_FOLLOW_PROB = 0.9  # synthetic stream: chance that the next token follows the hidden rule


def _generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7919 + salt)


class TokenSource:
    """Batches of token sequences of length seq_len + 1 (inputs and shifted targets).

    Args:
        source: "synthetic" or "text".
        vocab: model vocabulary size.
        seq_len: tokens per training sample.
        seed: data seed.
        path: text file for source="text" (default: a small public-domain text).
    """

    def __init__(self, source: str, vocab: int, seq_len: int, seed: int, path: str | None = None):
        self.source, self.vocab, self.seq_len, self.seed = source, vocab, seq_len, seed
        self.path = Path(path) if path else DEFAULT_TEXT
        if source == "text":
            if vocab < 256:
                raise ConfigError(f"data.source=text uses a byte-level tokenizer (256 tokens) but model.vocab={vocab}. Use vocab >= 256.")
            if not self.path.is_file():
                raise ConfigError(f"data.path: {str(self.path)!r} does not exist. Point it at a local text file.")
            if len(self.tokens) < seq_len + 2:
                raise ConfigError(f"data.path: {self.path} has {len(self.tokens)} bytes, fewer than seq_len+2 = {seq_len + 2}.")

    @cached_property
    def tokens(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8).long()

    @cached_property
    def rule(self) -> torch.Tensor:
        """The synthetic stream's hidden next-token rule: a fixed permutation of the vocabulary."""
        return torch.randperm(self.vocab, generator=_generator(self.seed, -1, salt=1))

    def global_batch(self, step: int, global_batch: int) -> torch.Tensor:
        """The (global_batch, seq_len + 1) int64 tokens of optimizer step `step` (1-based)."""
        gen = _generator(self.seed, step)
        n = self.seq_len + 1
        if self.source == "text":
            starts = torch.randint(0, len(self.tokens) - n, (global_batch,), generator=gen)
            return torch.stack([self.tokens[s : s + n] for s in starts.tolist()])
        # Synthetic: each token follows the hidden rule with p=0.9, else is uniform noise. A
        # model can learn the rule, so the loss falls visibly from ln(vocab).
        out = torch.empty(global_batch, n, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (global_batch,), generator=gen)
        follow = torch.rand(global_batch, n, generator=gen) < _FOLLOW_PROB
        noise = torch.randint(0, self.vocab, (global_batch, n), generator=gen)
        for t in range(1, n):
            out[:, t] = torch.where(follow[:, t], self.rule[out[:, t - 1]], noise[:, t])
        return out


def rank_micro_batches(batch: torch.Tensor, dp_rank: int, dp: int, micro_batch: int) -> list[torch.Tensor]:
    """dp rank's contiguous slice of a global batch, split into micro-batches."""
    per_rank = batch.shape[0] // dp
    mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return list(mine.split(micro_batch))


def build_token_source(spec) -> TokenSource:
    m = spec.model
    if m.factory is not None:
        vocab, seq_len = m.vocab, m.seq_len
    else:
        shape = m.shape()
        vocab, seq_len = shape.vocab, shape.seq_len
    return TokenSource(spec.data.source, vocab, seq_len, spec.data.seed, spec.data.path)
