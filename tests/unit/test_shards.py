"""Token shards: prepare from text / jsonl / parquet / Arrow, the index, memmap and fsspec reads,
layout-invariant batches, the held-out split and the errors."""
import json
import os

import numpy as np
import pytest
import torch

from workbench import ConfigError, load_spec
from workbench.data import DEFAULT_TEXT, TokenSource, build_token_source
from workbench.shards import TokenShards, prepare


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    index = prepare([str(DEFAULT_TEXT)], str(out), tokenizer="bpe", vocab_size=400, shard_tokens=1000, progress=False)
    return out, index


def test_prepare_writes_shards_index_and_tokenizer(shards):
    out, index = shards
    assert index["dtype"] == "uint16" and index["vocab_size"] == 400 and index["tokenizer"] == "bpe"
    assert json.loads((out / "index.json").read_text()) == index
    sizes = [(out / s["file"]).stat().st_size for s in index["shards"]]
    assert sizes == [2 * s["tokens"] for s in index["shards"]] and len(sizes) > 1
    assert all(s["tokens"] == 1000 for s in index["shards"][:-1])
    assert index["num_tokens"] == sum(s["tokens"] for s in index["shards"]) < index["source_bytes"]
    # The stream decodes back to the text (one document, then EOS).
    stream = TokenShards(str(out))
    tok = stream.tokenizer()
    ids = stream.read(0, len(stream)).tolist()
    assert ids[-1] == tok.eos_id
    assert tok.decode(ids[:-1]) == DEFAULT_TEXT.read_text()


def test_reads_across_shard_boundaries_match_the_whole_stream(shards):
    out, _ = shards
    stream = TokenShards(str(out))
    whole = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in stream.index["shards"]])
    assert len(whole) > 2100
    for start, n in [(0, 10), (995, 10), (990, 1020), (len(whole) - 5, 5)]:
        assert np.array_equal(stream.read(start, n), whole[start:start + n])
    with pytest.raises(IndexError):
        stream.read(len(whole) - 5, 6)


def test_object_store_reads_by_range(shards):
    fsspec = pytest.importorskip("fsspec")
    out, _ = shards
    fs = fsspec.filesystem("memory")
    for f in out.iterdir():
        fs.pipe(f"/wb-test-shards/{f.name}", f.read_bytes())
    remote, local = TokenShards("memory://wb-test-shards"), TokenShards(str(out))
    assert not remote.local
    assert np.array_equal(remote.read(990, 30), local.read(990, 30))


def test_token_batches_are_layout_invariant_and_deterministic(shards):
    out, _ = shards
    src = TokenSource("tokens", vocab=512, seq_len=32, seed=3, path=str(out), val_fraction=0.1)
    batch = src.global_batch(7, 8)
    assert batch.shape == (8, 33) and batch.dtype == torch.long
    for dp in (2, 4, 8):
        assert torch.equal(torch.cat([src.rank_batch(7, 8, r, dp) for r in range(dp)]), batch)
    again = TokenSource("tokens", vocab=512, seq_len=32, seed=3, path=str(out), val_fraction=0.1)
    assert torch.equal(again.global_batch(7, 8), batch) and not torch.equal(src.global_batch(8, 8), batch)


def test_validation_split_is_held_out(shards):
    out, _ = shards
    src = TokenSource("tokens", vocab=512, seq_len=32, seed=0, path=str(out), val_fraction=0.2)
    (t0, t1), (v0, v1) = src._regions()
    assert t1 == v0 and v1 == len(src.shards) and v1 - v0 == int(0.2 * v1)
    stream = torch.from_numpy(src.shards.read(0, v1).astype(np.int64))
    def starts(b):  # where each row sits in the stream
        return [next(i for i in range(v1 - 33) if torch.equal(stream[i:i + 33], row)) for row in b]
    assert all(s + 33 <= t1 for s in starts(src.global_batch(1, 4)))
    assert all(s >= v0 for s in starts(src.val_batch(0, 4)))
    assert torch.equal(src.val_batch(1, 4), src.val_batch(1, 4))


def test_jsonl_parquet_and_saved_arrow_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = ["first document", "second one, longer", "third"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    pq.write_table(pa.table({"text": docs}), tmp_path / "b.parquet")
    ds = tmp_path / "saved"  # datasets' save_to_disk layout: Arrow stream files + state.json
    ds.mkdir()
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": docs}))
    (ds / "state.json").write_text("{}")
    for inp in ("a.jsonl", "b.parquet", "saved"):
        index = prepare([str(tmp_path / inp)], str(tmp_path / f"out-{inp}"), tokenizer="bytes", progress=False)
        stream = TokenShards(str(tmp_path / f"out-{inp}"))
        assert index["num_documents"] == 3 and stream.tokenizer().decode(stream.read(0, len(stream)).tolist()) == "".join(docs)


def test_local_tokenizer_json_is_reused(shards, tmp_path):
    out, index = shards
    again = prepare([str(DEFAULT_TEXT)], str(tmp_path / "o"), tokenizer=str(out / "tokenizer.json"), progress=False)
    assert again["tokenizer"] == "json" and again["num_tokens"] == index["num_tokens"]
    assert np.array_equal(TokenShards(str(tmp_path / "o")).read(0, 100), TokenShards(str(out)).read(0, 100))


def test_errors_name_the_fix(shards, tmp_path):
    out, _ = shards
    with pytest.raises(ConfigError, match="no index.json.*workbench data prepare"):
        TokenShards(str(tmp_path))
    with pytest.raises(ConfigError, match=r"400 tokens but model.vocab=256. Set model.vocab >= 400"):
        build_token_source(load_spec({"data": {"source": "tokens", "path": str(out)}}))
    with pytest.raises(ConfigError, match="needs data.path"):
        TokenSource("tokens", 512, 32, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        prepare([str(tmp_path / "missing.txt")], str(tmp_path / "x"), progress=False)
    with pytest.raises(ConfigError, match="needs held-out data"):
        load_spec({"data": {"source": "text"}, "train": {"eval_every": 2}})
    with pytest.raises(ConfigError, match="at least 257 tokens"):
        prepare([str(DEFAULT_TEXT)], str(tmp_path / "y"), tokenizer="bpe", vocab_size=100, progress=False)


def test_a_rank_reads_only_its_own_rows(shards):
    out, _ = shards
    src = TokenSource("tokens", vocab=512, seq_len=32, seed=0, path=str(out))
    windows = []
    read = src.shards.read
    src.shards.read = lambda start, n: windows.append((start, n)) or read(start, n)
    mine = src.rank_batch(3, 8, 1, 4)  # dp rank 1 of 4: rows 2 and 3 of the global batch
    assert len(windows) == 2 and all(n == 33 for _, n in windows)
    assert torch.equal(mine, src.global_batch(3, 8)[2:4])


@pytest.mark.parametrize("forge", [
    {"dtype": "object"}, {"dtype": "<f8"}, {"vocab_size": "400"}, {"eos_id": 2**80},
    {"shards": [{"file": "../../../etc/hostname", "tokens": 1}]}, {"shards": [{"file": "shard-00000.bin", "tokens": -1}]},
    {"shards": [{"file": "shard-00000.bin", "tokens": 10**9}]}, {"tokenizer_file": "/etc/passwd"}, {"shards": "x"},
], ids=str)
def test_a_forged_index_is_refused_before_any_read(shards, tmp_path, forge):
    """A token index is data: an `object` dtype would make numpy read shard bytes as pointers (a
    crash, found from outside), and paths or counts must stay inside the shards' own files."""
    import shutil

    out, _ = shards
    shutil.copytree(out, tmp_path / "s")
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    index.update(forge)
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="not a token index workbench wrote|holds .* tokens, but the file has"):
        TokenShards(str(tmp_path / "s"))
    (tmp_path / "s" / "index.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a workbench token index"):
        TokenShards(str(tmp_path / "s"))


@pytest.mark.parametrize("index, needle", [
    (b"{not json", "not JSON: Expecting property name"),
    (bytes(range(128, 256)), "not UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (b'{"vocab_size": ' + b"9" * 5000 + b"}", "a number too long to read"),
    (b" " * ((1 << 24) + 1), "16,777,217 bytes is too large"),
    (None, "is not a regular file"),  # a pipe named index.json: json.load would wait for a writer
])
def test_an_index_that_is_not_one_is_refused_with_a_bound(tmp_path, index, needle):
    (tmp_path / "s").mkdir()
    path = tmp_path / "s" / "index.json"
    if index is None:
        os.mkfifo(path)
    else:
        path.write_bytes(index)
    with pytest.raises(ConfigError, match=needle):
        TokenShards(str(tmp_path / "s"))


@pytest.mark.parametrize("uri, needle", [
    ("nosuch://x/y", "cannot open 'nosuch://x/y': Protocol not known"),
    ("zip://x::file:///etc/hostname", "cannot open 'zip://x::file:///etc/hostname'"),
    ("/dev/null", "no index.json under '/dev/null'"),
])
def test_a_data_path_that_cannot_be_opened_says_so(uri, needle):
    with pytest.raises(ConfigError, match=needle):
        TokenShards(uri)


def test_a_tokenizer_json_is_read_with_a_bound(shards, monkeypatch):
    """`tokenizers` reads a tokenizer.json whole: a file past the bound is refused before that."""
    from workbench import tokenizer
    from workbench.tokenizer import load_tokenizer_file

    out, _ = shards
    assert load_tokenizer_file(str(out / "tokenizer.json")).vocab_size == 400
    monkeypatch.setattr(tokenizer, "MAX_TOKENIZER_CHARS", 1000)
    with pytest.raises(ConfigError, match="is over 0 Mi characters"):
        load_tokenizer_file(str(out / "tokenizer.json"))
    with pytest.raises(ConfigError, match="not a tokenizer.json workbench wrote"):
        TokenShards(str(out)).tokenizer()
