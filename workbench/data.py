"""Layout-invariant token batches: global batch k depends only on (seed, k, global_batch).

Every rank computes the same global batch and keeps its dp slice, so any dp x tp x pp layout
trains on exactly the data the single-process run sees, and a resumed run picks up at any step
with no state to restore beyond the step number. Token shards (`data.source: tokens`, see
shards.py) are read row by row, so a rank reads only its own slice of the global batch.

Fine-tuning shards carry a loss mask: a batch is then (tokens, mask), and `targets` turns the
masked-out positions into IGNORE, which the loss skips. By default each row holds one example
(truncated to seq_len + 1 tokens, padded, the padding masked out); `data.packing` cuts windows from
the stream of examples instead, as for text.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from workbench.errors import ConfigError
from workbench.shards import check_regions, open_token_data

DEFAULT_TEXT = Path(__file__).parent / "assets" / "public_domain.txt"
_FOLLOW_PROB = 0.9  # synthetic stream: chance that the next token follows the hidden rule
IGNORE = -100  # the target id of a token that does not train (cross_entropy's ignore_index)


def _generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7919 + salt)


class TokenSource:
    """Batches of token sequences of length seq_len + 1 (inputs and shifted targets).

    Args:
        source: "synthetic", "text" or "tokens".
        vocab: model vocabulary size.
        seq_len: tokens per training sample.
        seed: data seed.
        path: text file for source="text" (default: a small public-domain text); the token
            shards' directory or URI for source="tokens".
        val_fraction: the last fraction of the text / token stream held out for evaluation
            (synthetic data draws held-out batches from its own stream); of the examples, for
            fine-tuning shards.
        packing: fine-tuning shards only: windows of the stream of examples (examples attend to the
            ones before them in a window) instead of one example per row.
    """

    def __init__(self, source: str, vocab: int, seq_len: int, seed: int, path: str | None = None,
                 val_fraction: float = 0.0, packing: bool = False):
        self.source, self.vocab, self.seq_len, self.seed = source, vocab, seq_len, seed
        self.val_fraction = val_fraction
        self.path = Path(path) if path else DEFAULT_TEXT
        self.shards = None
        self.masked = self.by_example = False
        self._perms: dict[int, torch.Tensor] = {}
        if source == "text":
            if vocab < 256:
                raise ConfigError(f"data.source=text uses a byte-level tokenizer (256 tokens) but model.vocab={vocab}. Use vocab >= 256.")
            if not self.path.is_file():
                raise ConfigError(f"data.path: {str(self.path)!r} does not exist. Point it at a local text file.")
            check_regions(len(self.tokens), "bytes", str(self.path), seq_len, val_fraction)
        elif source == "tokens":
            self.shards = open_token_data(path, vocab, seq_len, val_fraction, packing)
            self.masked = self.shards.masked
            self.by_example = self.masked and not packing
            eos = self.shards.index.get("eos_id")
            self.pad_id = eos if eos is not None else 0

    @cached_property
    def tokens(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8).long()

    @cached_property
    def rule(self) -> torch.Tensor:
        """The synthetic stream's hidden next-token rule: a fixed permutation of the vocabulary."""
        return torch.randperm(self.vocab, generator=_generator(self.seed, -1, salt=1))

    def _regions(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """[start, end) of the training and the held-out part of the stream (of the examples, by_example)."""
        if self.by_example:
            total = self.shards.num_examples
        else:
            total = len(self.shards) if self.shards is not None else len(self.tokens)
        split = total - int(total * self.val_fraction)
        return (0, split), (split, total)

    def global_batch(self, step: int, global_batch: int) -> torch.Tensor:
        """The (global_batch, seq_len + 1) int64 tokens of optimizer step `step` (1-based)."""
        return self.rank_batch(step, global_batch, 0, 1)

    def rank_batch(self, step: int, global_batch: int, dp_rank: int, dp: int) -> torch.Tensor:
        """dp rank's contiguous slice of global batch `step`; token shards read only that slice."""
        return self.rank_examples(step, global_batch, dp_rank, dp)[0]

    def rank_examples(self, step: int, global_batch: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens, loss mask) of dp rank's slice of global batch `step`: the mask (bool, the
        tokens' shape, True = trains) for fine-tuning shards, None where every token trains."""
        if self.by_example:
            return self._examples(self._epoch_order(step, global_batch, dp_rank, dp))
        return self._batch(_generator(self.seed, step), self._regions()[0], global_batch, dp_rank, dp)

    def val_batch(self, index: int, global_batch: int, dp_rank: int = 0, dp: int = 1) -> torch.Tensor:
        """Held-out batch `index` (0-based; the same at every evaluation), dp rank's slice."""
        return self.val_examples(index, global_batch, dp_rank, dp)[0]

    def val_examples(self, index: int, global_batch: int, dp_rank: int = 0,
                     dp: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens, loss mask) of held-out batch `index`, dp rank's slice; by example: the held-out
        examples in order, batch after batch (wrapping around)."""
        if self.source != "synthetic" and self.val_fraction <= 0:
            raise ConfigError("evaluation needs held-out data: set data.val_fraction > 0 (e.g. 0.05).")
        if self.by_example:
            lo, hi = self._regions()[1]
            per_rank = global_batch // dp
            first = index * global_batch + dp_rank * per_rank
            return self._examples([lo + (first + j) % (hi - lo) for j in range(per_rank)])
        return self._batch(_generator(self.seed, index, salt=2), self._regions()[1], global_batch, dp_rank, dp)

    def _batch(self, gen: torch.Generator, region: tuple[int, int], global_batch: int, dp_rank: int,
               dp: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = self.seq_len + 1
        per_rank = global_batch // dp
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        if self.source == "synthetic":
            return self._synthetic(gen, global_batch)[rows], None
        lo, hi = region
        starts = (lo + torch.randint(0, hi - lo - n, (global_batch,), generator=gen))[rows].tolist()
        if self.shards is None:
            return torch.stack([self.tokens[s : s + n] for s in starts]), None
        tokens = torch.from_numpy(np.stack([self.shards.read(s, n) for s in starts]).astype(np.int64))
        if not self.masked:
            return tokens, None
        return tokens, torch.from_numpy(np.stack([self.shards.read_mask(s, n) for s in starts]) != 0)

    def _epoch_order(self, step: int, global_batch: int, dp_rank: int, dp: int) -> list[int]:
        """The training examples of dp rank's rows of step `step`: sample i = (step - 1) *
        global_batch + row is position i % n of epoch i // n's permutation of the n examples, a
        pure function of (seed, step, global_batch) that shows every example once an epoch."""
        n = self._regions()[0][1]
        per_rank = global_batch // dp
        first = (step - 1) * global_batch + dp_rank * per_rank
        order = []
        for i in range(first, first + per_rank):
            epoch = i // n
            if epoch not in self._perms:
                self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
                self._perms[epoch] = torch.randperm(n, generator=_generator(self.seed, epoch, salt=3))
            order.append(int(self._perms[epoch][i % n]))
        return order

    def _examples(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One example per row: its first seq_len + 1 tokens, padded with EOS (or 0); the padding
        and whatever the example's own mask leaves out do not train."""
        n = self.seq_len + 1
        tokens = torch.full((len(indices), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), n), dtype=torch.bool)
        for row, i in enumerate(indices):
            start, end = self.shards.example(i)
            k = min(end - start, n)
            tokens[row, :k] = torch.from_numpy(self.shards.read(start, k).astype(np.int64))
            mask[row, :k] = torch.from_numpy(self.shards.read_mask(start, k) != 0)
        return tokens, mask

    def _synthetic(self, gen: torch.Generator, global_batch: int) -> torch.Tensor:
        """Each token follows the hidden rule with p=0.9 (out[t] = rule[out[t - 1]]), else is
        uniform noise (out[t] = noise[t]; the first token is drawn alone). A model can learn the
        rule, so the loss falls visibly from ln(vocab).

        Computed without a loop over positions: token t is rule applied t - s times to the token
        drawn at s, the last position at or before t that did not follow, and rule^k is the
        composition of the rule's powers of two that add up to k. (A loop of three ops per
        position took ~1 ms a step at 64 tokens on CPU, ~12 ms at 1,024.)"""
        n = self.seq_len + 1
        first = torch.randint(0, self.vocab, (global_batch,), generator=gen)
        follow = torch.rand(global_batch, n, generator=gen) < _FOLLOW_PROB
        drawn = torch.randint(0, self.vocab, (global_batch, n), generator=gen)
        drawn[:, 0] = first
        follow[:, 0] = False
        pos = torch.arange(n).expand(global_batch, n)
        last_drawn = torch.where(follow, 0, pos).cummax(dim=1).values
        steps, out = pos - last_drawn, drawn.gather(1, last_drawn)
        for j, power in enumerate(self._rule_powers):
            out = torch.where((steps >> j) & 1 == 1, power[out], out)
        return out

    @cached_property
    def _rule_powers(self) -> list[torch.Tensor]:
        """[rule, rule^2, rule^4, ...]: the rule's powers of two up to seq_len applications (a batch's most)."""
        powers = [self.rule]
        while 2 ** len(powers) <= self.seq_len:
            powers.append(powers[-1][powers[-1]])
        return powers


def targets(tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The next-token targets of (B, T + 1) tokens: (B, T), IGNORE where the mask says the token
    does not train (the first token is never a target)."""
    y = tokens[:, 1:]
    return y if mask is None else y.masked_fill(~mask[:, 1:], IGNORE)


def token_loss_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the target tokens of (B, T, vocab) logits (IGNORE targets skipped).
    A sum, not a mean: the caller divides by the global batch's count of target tokens, so the
    loss does not depend on how the batch is cut into ranks and micro-batches."""
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="sum")


def rank_micro_batches(batch: torch.Tensor, dp_rank: int, dp: int, micro_batch: int) -> list[torch.Tensor]:
    """dp rank's contiguous slice of a global batch, split into micro-batches."""
    per_rank = batch.shape[0] // dp
    mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return list(mine.split(micro_batch))


def build_token_source(spec) -> TokenSource:
    from workbench.validate import token_dims

    vocab, seq_len = token_dims(spec.model)
    d = spec.data
    return TokenSource(d.source, vocab, seq_len, d.seed, d.path, d.val_fraction, packing=d.packing)
