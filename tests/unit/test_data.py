"""Data: layout invariance, determinism, resumability, the text source."""
import pytest
import torch

from workbench import ConfigError, load_spec
from workbench.data import TokenSource, build_token_source, rank_micro_batches


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_union_of_dp_slices_is_the_dp1_batch(source):
    src = TokenSource(source, vocab=256, seq_len=32, seed=3)
    batch = src.global_batch(7, 16)
    assert batch.shape == (16, 33) and batch.dtype == torch.long
    for dp, micro in [(2, 4), (4, 2), (8, 1), (1, 16)]:
        pieces = [mb for r in range(dp) for mb in rank_micro_batches(batch, r, dp, micro)]
        assert all(p.shape[0] == micro for p in pieces)
        assert torch.equal(torch.cat(pieces), batch)


def test_batches_depend_only_on_seed_step_and_size():
    a = TokenSource("synthetic", 256, 32, seed=0)
    b = TokenSource("synthetic", 256, 32, seed=0)
    # Any order of access (e.g. after a resume) gives the same batch k.
    assert torch.equal(a.global_batch(5, 8), b.global_batch(5, 8))
    assert torch.equal(a.global_batch(1, 8), b.global_batch(1, 8))
    assert not torch.equal(a.global_batch(1, 8), a.global_batch(2, 8))
    assert not torch.equal(a.global_batch(1, 8), TokenSource("synthetic", 256, 32, seed=1).global_batch(1, 8))


def test_synthetic_stream_is_learnable():
    src = TokenSource("synthetic", 64, 128, seed=0)
    batch = src.global_batch(1, 32)
    follows = (src.rule[batch[:, :-1]] == batch[:, 1:]).float().mean().item()
    assert 0.85 < follows < 0.95  # the hidden rule holds ~90% of the time
    assert int(batch.max()) < 64


@pytest.mark.parametrize("vocab,seq_len,batch,step", [(64, 128, 32, 1), (256, 64, 8, 7), (50257, 1024, 2, 3),
                                                     (5, 1, 3, 2)])
def test_synthetic_stream_is_its_definition_token_by_token(vocab, seq_len, batch, step):
    """The batch is the sequential definition, computed position by position from the same draws
    (the first token alone; then the rule with p=0.9, else noise)."""
    from workbench.data import _FOLLOW_PROB, _generator

    src = TokenSource("synthetic", vocab, seq_len, seed=3)
    gen = _generator(3, step)
    n = seq_len + 1
    want = torch.empty(batch, n, dtype=torch.long)
    want[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    follow = torch.rand(batch, n, generator=gen) < _FOLLOW_PROB
    noise = torch.randint(0, vocab, (batch, n), generator=gen)
    for t in range(1, n):
        want[:, t] = torch.where(follow[:, t], src.rule[want[:, t - 1]], noise[:, t])
    assert torch.equal(src.global_batch(step, batch), want)


def test_text_source_reads_bytes(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefgh" * 20)
    src = TokenSource("text", 256, 8, seed=0, path=str(path))
    batch = src.global_batch(1, 4)
    assert set(batch.flatten().tolist()) <= set(b"abcdefgh")
    with pytest.raises(ConfigError, match="does not exist"):
        TokenSource("text", 256, 8, seed=0, path=str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="byte-level tokenizer"):
        TokenSource("text", 100, 8, seed=0)


def test_shipped_text_feeds_the_quickstart():
    src = build_token_source(load_spec("examples/quickstart.yaml"))
    text = bytes(src.global_batch(1, 2)[0].tolist()).decode("utf-8", errors="replace")
    assert len(text) == 65
