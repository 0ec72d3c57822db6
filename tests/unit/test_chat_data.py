"""Fine-tuning data: chat / instruct records -> token shards + loss mask (default template, a
model folder's chat template by prefixes or {% generation %}), the index checks, one example per
row or packed windows, the masked loss normalised by the global batch, and the man-page set."""
import gzip
import json

import numpy as np
import pytest
import torch

from tests.helpers.chat import jsonl, many_chats
from tests.helpers.cli import run_cli
from workbench import ConfigError
from workbench.data import IGNORE, TokenSource, targets
from workbench.shards import TokenShards, prepare

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does ls do?"},
                  {"role": "assistant", "content": "It lists directory contents."}]},
    {"messages": [{"role": "user", "content": "What does cp do?"}, {"role": "assistant", "content": "It copies files."},
                  {"role": "user", "content": "And mv?"}, {"role": "assistant", "content": "It moves them."}]},
]
IM = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IM_GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
                 "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hf_folder(path, template):
    """A model folder's tokenizer, made offline: a byte-level BPE with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CHATS for m in c["messages"]] * 4
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>",
                            "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(str(path))
    return str(path)


def examples(out):
    """(trained text, untrained text) of every example, decoded from the shards."""
    shards = TokenShards(str(out))
    tok = shards.tokenizer()
    got = []
    for i in range(shards.num_examples):
        start, end = shards.example(i)
        ids, mask = shards.read(start, end - start).tolist(), shards.read_mask(start, end - start).tolist()
        got.append((tok.decode([t for t, m in zip(ids, mask) if m]), tok.decode([t for t, m in zip(ids, mask) if not m])))
    return got


def test_chat_records_with_the_default_template_train_only_the_assistant(tmp_path):
    index = prepare([jsonl(tmp_path / "c.jsonl", CHATS)], tmp_path / "out", tokenizer="bpe", vocab_size=300,
                    progress=False)
    assert index["data_format"] == "chat" and index["chat_template"] == "default"
    assert index["examples"]["count"] == 2 == index["num_documents"]
    assert examples(tmp_path / "out") == [
        ("It lists directory contents.<|endoftext|>", "Be brief.\n\nUser: What does ls do?\nAssistant: "),
        ("It copies files.<|endoftext|>It moves them.<|endoftext|>",
         "User: What does cp do?\nAssistant: User: And mv?\nAssistant: "),
    ]
    masks = [np.fromfile(tmp_path / "out" / s["mask"], dtype=np.uint8) for s in index["shards"]]
    assert sum(int(m.sum()) for m in masks) == index["loss_tokens"] > 0
    assert [len(m) for m in masks] == [s["tokens"] for s in index["shards"]]


def test_bytes_tokenizer_ends_an_answer_with_a_newline(tmp_path):
    prepare([jsonl(tmp_path / "c.jsonl", CHATS[:1])], tmp_path / "out", tokenizer="bytes", progress=False)
    assert examples(tmp_path / "out") == [("It lists directory contents.\n",
                                           "Be brief.\n\nUser: What does ls do?\nAssistant: ")]


def test_instruct_records_train_the_completion_and_eos(tmp_path):
    rows = [{"prompt": "Q: What does ls do?\nA:", "completion": " It lists files."},
            {"prompt": "", "completion": "Only a completion."}]
    index = prepare([jsonl(tmp_path / "i.jsonl", rows)], tmp_path / "out", tokenizer="bpe", vocab_size=280, progress=False)
    assert index["data_format"] == "instruct" and index["chat_template"] is None
    assert examples(tmp_path / "out") == [(" It lists files.<|endoftext|>", "Q: What does ls do?\nA:"),
                                          ("Only a completion.<|endoftext|>", "")]


@pytest.mark.parametrize("template", [IM, IM_GENERATION], ids=["by-prefixes", "generation-tags"])
def test_a_model_folders_chat_template_renders_and_masks_the_assistant_turns(tmp_path, template):
    pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "model", template)
    index = prepare([jsonl(tmp_path / "c.jsonl", CHATS)], tmp_path / "out", tokenizer=folder, progress=False)
    assert index["chat_template"] == "tokenizer"
    assert (tmp_path / "out" / index["chat_template_file"]).read_text() == template
    got = examples(tmp_path / "out")
    # by prefixes: everything the template writes from the generation prompt to the next turn ("\n" too)
    assert [t.replace("<|im_end|>\n", "<|im_end|>") for t, _ in got] == [
        "It lists directory contents.<|im_end|>", "It copies files.<|im_end|>It moves them.<|im_end|>"]
    assert got[0][1].startswith("<|im_start|>system\nBe brief.<|im_end|>") and got[0][1].endswith("<|im_start|>assistant\n")
    # The ids are transformers' own rendering, tokenized as apply_chat_template does.
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    shards = TokenShards(str(tmp_path / "out"))
    start, end = shards.example(1)
    assert shards.read(start, end - start).tolist() == list(hf.apply_chat_template(CHATS[1]["messages"])["input_ids"])


def test_a_template_is_rendered_in_the_sandbox(tmp_path):
    pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "model", "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ConfigError, match="chat template does not render .*SecurityError"):
        prepare([jsonl(tmp_path / "c.jsonl", CHATS)], tmp_path / "out", tokenizer=folder, progress=False)


@pytest.mark.parametrize("template, needle", [
    ("{{ 'x' * 2000000 }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     r"renders 2,000,0\d\d characters from messages of \d+"),
    # with generation tags transformers tokenizes as it renders: the text is rendered bounded first
    ("{% for m in messages %}{% generation %}{{ 'x' * 2000000 }}{% endgeneration %}{% endfor %}",
     r"renders 6,000,000 characters from messages of \d+"),
    # past the memory headroom: a MemoryError inside the render, not a host out of memory
    ("{{ 'x' * 8000000000 }}", "needs more than 2 GiB to render one record"),
])
def test_a_template_that_repeats_text_is_refused_within_bounded_memory(tmp_path, template, needle):
    """jinja2's sandbox stops code, not size: a 100-byte template could render gigabytes per record."""
    pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "model", template)
    with pytest.raises(ConfigError, match=needle):
        prepare([jsonl(tmp_path / "c.jsonl", CHATS)], tmp_path / "out", tokenizer=folder, progress=False)


def test_memory_headroom_bounds_the_block_and_restores_the_limit():
    import resource

    from workbench.chat_data import memory_headroom

    before = resource.getrlimit(resource.RLIMIT_DATA)
    with pytest.raises(MemoryError), memory_headroom(256 << 20):
        bytearray(1 << 30)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert len(bytearray(512 << 20)) == 512 << 20  # the limit is gone after the block


def test_a_template_that_rewrites_past_turns_is_refused_with_the_way_out(tmp_path):
    pytest.importorskip("transformers")
    # Renders only the last assistant turn in full: the prefix of turn 1 differs once turn 3 follows.
    odd = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' and not loop.last %}...{% else %}"
           "{{ m['content'] }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    folder = hf_folder(tmp_path / "model", odd)
    with pytest.raises(ConfigError, match="renders turn 1 differently .*generation"):
        prepare([jsonl(tmp_path / "c.jsonl", CHATS[1:])], tmp_path / "out", tokenizer=folder, progress=False)


def test_a_model_folder_without_a_template_uses_the_default_with_its_eos(tmp_path):
    pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "model", None)
    index = prepare([jsonl(tmp_path / "c.jsonl", CHATS[:1])], tmp_path / "out", tokenizer=folder, progress=False)
    assert index["chat_template"] == "default" and "chat_template_file" not in index
    assert examples(tmp_path / "out")[0][0] == "It lists directory contents.<|im_end|>"


def test_parquet_chat_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "c.parquet")
    index = prepare([str(tmp_path / "c.parquet")], tmp_path / "out", tokenizer="bytes", progress=False)
    assert index["data_format"] == "chat" and index["examples"]["count"] == 2


@pytest.mark.parametrize("rows, fmt, message", [
    ([{"messages": [], "text": "x"}], "auto", "cannot tell the record's format .*fits chat and text"),
    ([{"body": "x"}], "auto", "cannot tell the record's format .*none fits"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "auto", "no assistant message"),
    ([{"messages": [{"role": "robot", "content": "hi"}]}], "auto", "message 0 needs a role in"),
    ([{"messages": [{"role": "user", "content": 3}]}], "chat", "message 0 needs a role .*string content"),
    ([{"prompt": "x", "completion": ""}], "instruct", "non-empty 'completion'"),
    ([{"prompt": "x", "completion": "y"}], "chat", "no 'messages' list"),
    ([{"text": "x"}], "bogus", "--format 'bogus' is not one of"),
])
def test_bad_records_are_refused_with_the_line(tmp_path, rows, fmt, message):
    with pytest.raises(ConfigError, match=message):
        prepare([jsonl(tmp_path / "bad.jsonl", rows)], tmp_path / "out", tokenizer="bytes", progress=False, format=fmt)


def test_text_and_chat_inputs_do_not_mix(tmp_path):
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(ConfigError, match="mix formats"):
        prepare([str(tmp_path / "t.txt"), jsonl(tmp_path / "c.jsonl", CHATS)], tmp_path / "out", tokenizer="bytes",
                progress=False)


# -- the index and the batches ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    path = jsonl(tmp / "c.jsonl", many_chats(40))
    index = prepare([path], tmp / "out", tokenizer="bytes", shard_tokens=700, progress=False)
    assert len(index["shards"]) > 2  # examples cross shard boundaries
    return tmp / "out", index


def test_one_example_per_row_padded_and_masked(chat_shards):
    out, index = chat_shards
    src = TokenSource("tokens", vocab=256, seq_len=128, seed=0, path=str(out), val_fraction=0.1)
    assert src.by_example and src._regions() == ((0, 36), (36, 40))
    shards = TokenShards(str(out))
    tokens, mask = src.rank_examples(1, 8, 0, 1)
    rows = src._epoch_order(1, 8, 0, 1)
    for r, i in enumerate(rows):
        start, end = shards.example(i)
        k = min(end - start, 129)
        assert tokens[r, :k].tolist() == shards.read(start, k).tolist()
        assert mask[r, :k].tolist() == [bool(v) for v in shards.read_mask(start, k)]
        assert not mask[r, k:].any() and (tokens[r, k:] == 0).all()  # padding (bytes: no EOS, pad 0) never trains
    y = targets(tokens, mask)
    assert ((y == IGNORE) == ~mask[:, 1:]).all() and (y[mask[:, 1:]] == tokens[:, 1:][mask[:, 1:]]).all()
    # some examples are longer than a row: truncated, not wrapped into the next row
    assert max(e - s for s, e in map(shards.example, range(40))) > 129


def test_example_batches_are_layout_invariant_and_cover_each_example_once_an_epoch(chat_shards):
    out, _ = chat_shards
    src = TokenSource("tokens", vocab=256, seq_len=128, seed=3, path=str(out), val_fraction=0.1)
    full_tokens, full_mask = src.rank_examples(2, 8, 0, 1)
    for dp in (2, 4):
        parts = [src.rank_examples(2, 8, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([t for t, _ in parts]), full_tokens)
        assert torch.equal(torch.cat([m for _, m in parts]), full_mask)
    order = [i for step in range(1, 10) for i in src._epoch_order(step, 4, 0, 1)]  # 36 = one epoch
    assert sorted(order) == list(range(36))
    again = TokenSource("tokens", vocab=256, seq_len=128, seed=3, path=str(out), val_fraction=0.1)
    assert again._epoch_order(10, 4, 0, 1) == src._epoch_order(10, 4, 0, 1)  # epoch 2, from nothing but the step
    held = [src.val_examples(j, 4)[0] for j in range(2)]  # the 4 held-out examples in order, then again
    assert torch.equal(held[0], held[1]) and torch.equal(held[0], src._examples([36, 37, 38, 39])[0])


def test_packing_cuts_windows_with_their_masks(chat_shards):
    out, _ = chat_shards
    src = TokenSource("tokens", vocab=256, seq_len=128, seed=0, path=str(out), val_fraction=0.1, packing=True)
    assert src.masked and not src.by_example
    shards = TokenShards(str(out))
    tokens, mask = src.rank_examples(1, 4, 0, 1)
    for row, m in zip(tokens, mask):  # each window is a stretch of the stream, mask alongside
        starts = [s for s in range(len(shards) - 128) if shards.read(s, 129).tolist() == row.tolist()]
        assert starts and m.tolist() == [bool(v) for v in shards.read_mask(starts[0], 129)]


@pytest.mark.parametrize("forge", [
    {"examples": "examples.bin"}, {"examples": {"file": "../examples.bin", "count": 1}},
    {"examples": {"file": "examples.bin", "count": -1}}, {"examples": {"file": "examples.bin", "count": 10**6}},
    {"shards": "drop-a-mask"}, {"shards": "mask-elsewhere"},
], ids=str)
def test_a_forged_fine_tuning_index_is_refused(chat_shards, tmp_path, forge):
    import shutil

    out, _ = chat_shards
    shutil.copytree(out, tmp_path / "s")
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    if forge.get("shards") == "drop-a-mask":
        del index["shards"][1]["mask"]
    elif forge.get("shards") == "mask-elsewhere":
        index["shards"][1]["mask"] = "/etc/hostname"
    else:
        index.update(forge)
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="not a token index workbench wrote|holds .* but the file has"):
        TokenShards(str(tmp_path / "s"))


def test_short_mask_and_bad_bounds_are_refused(chat_shards, tmp_path):
    import shutil

    out, index = chat_shards
    shutil.copytree(out, tmp_path / "s")
    mask = tmp_path / "s" / index["shards"][0]["mask"]
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="mask-00000.bin holds 700 tokens, but the file has 699 bytes"):
        TokenShards(str(tmp_path / "s"))
    shutil.copy(out / index["shards"][0]["mask"], mask)
    bounds = np.fromfile(tmp_path / "s" / "examples.bin", dtype="<u8")
    bounds[5] = bounds[7]  # example 5 now ends before it starts... 4 ends after 5's start
    bounds[6] = 1
    bounds.tofile(tmp_path / "s" / "examples.bin")
    with pytest.raises(ConfigError, match="bounds example 5 by"):
        TokenShards(str(tmp_path / "s")).example(5)


def test_too_few_examples_for_the_split_is_a_config_error(tmp_path):
    prepare([jsonl(tmp_path / "c.jsonl", CHATS[:1])], tmp_path / "out", tokenizer="bytes", progress=False)
    with pytest.raises(ConfigError, match="1 examples: 1 for training and 0 held out .*at least one"):
        TokenSource("tokens", vocab=256, seq_len=128, seed=0, path=str(tmp_path / "out"), val_fraction=0.1)


# -- the masked loss ---------------------------------------------------------------------------------

def test_the_loss_is_the_mean_over_the_global_batchs_target_tokens_however_it_is_cut(chat_shards):
    """Gradient accumulation over 1, 2 or 8 micro-batches gives the same loss and gradients: each
    micro-batch's summed loss is divided by the global count, not averaged per micro-batch."""
    from workbench import build_model
    from workbench.runtime.loop import micro_batch_loss

    out, _ = chat_shards
    spec = {"model": {"preset": "gpt-tiny", "seq_len": 128}, "data": {"source": "tokens", "path": str(out), "val_fraction": 0.1}}
    src = TokenSource("tokens", vocab=256, seq_len=128, seed=0, path=str(out), val_fraction=0.1)
    tokens, mask = src.rank_examples(1, 8, 0, 1)
    y = targets(tokens, mask)
    counts = (y != IGNORE).sum(dim=1)
    assert len(set(counts.tolist())) > 3  # the mask's density differs from row to row
    model = build_model(spec)
    logits = model(tokens[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], tokens[:, 1:][mask[:, 1:]])  # by hand
    results = []
    for micro in (8, 2, 1):
        model.zero_grad()
        total = sum(micro_batch_loss(model, t, ty, scale=1 / int(counts.sum())) for t, ty in
                    zip(tokens.split(micro), y.split(micro)))
        total.backward()
        results.append((total.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in results:
        torch.testing.assert_close(loss, expected.detach())
        for g, ref in zip(grads, results[0][1]):
            torch.testing.assert_close(g, ref)
    # the per-micro-batch mean (what averaging micro-batch losses would give) is a different number
    per_micro = torch.stack([micro_batch_loss(model, t, ty) for t, ty in zip(tokens.split(1), y.split(1))]).mean()
    assert abs(per_micro.item() - expected.item()) > 1e-3


# -- the man-page set ----------------------------------------------------------------------------------

PAGE = r'''.\" a comment
.TH FROB 1 "2024" "frob 1.0" "User Commands"
.SH NAME
frob \- frobnicate the \fBwidgets\fR
.SH SYNOPSIS
.B frob
[\fIOPTION\fR]...
.SH DESCRIPTION
.PP
\fBfrob\fP turns widgets into gadgets.  It reads \(lqwidget\(rq files
from standard input\(em and writes gadgets.
Another sentence that is long enough to be cut off when the limit is small.
.PP
Second paragraph.
'''


def test_man_pages_become_question_answer_records(tmp_path):
    from workbench.manpages import man_pages, qa_records, sections

    folder = tmp_path / "man1"
    folder.mkdir()
    with gzip.open(folder / "frob.1.gz", "wt") as f:
        f.write(PAGE)
    with gzip.open(folder / "link.1.gz", "wt") as f:
        f.write(".so man1/frob.1\n")
    (folder / "broken.1.gz").write_bytes(b"not gzip")
    (folder / "gcloud_x.1.gz").write_bytes(b"")
    paths = man_pages("1", root=tmp_path)
    assert [p.name for p in paths] == ["broken.1.gz", "frob.1.gz", "link.1.gz"]
    assert sections(PAGE)["NAME"] == "frob - frobnicate the widgets"
    records = list(qa_records(paths))
    assert records == [{"messages": [
        {"role": "user", "content": "What does the frob command do?"},
        {"role": "assistant", "content": "frob - frobnicate the widgets. frob turns widgets into gadgets. It reads "
                                         "\u201cwidget\u201d files from standard input\u2014 and writes gadgets. Another "
                                         "sentence that is long enough to be cut off when the limit is small."}]}]


def test_this_machines_man_pages_give_a_question_answer_set():
    from workbench.manpages import man_pages, qa_records

    paths = man_pages("1")[:300]
    if not paths:
        pytest.skip("no man pages under /usr/share/man/man1 on this machine")
    records = list(qa_records(paths))
    assert len(records) > len(paths) // 4  # most pages have a NAME line and a DESCRIPTION
    for r in records:
        question, answer = (m["content"] for m in r["messages"])
        command = question.removeprefix("What does the ").removesuffix(" command do?")
        assert answer.startswith(f"{command} - ") and "\\f" not in answer and "\\-" not in answer


def test_cli_prepares_chat_data_and_says_what_trains(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", CHATS)
    done = run_cli("data", "prepare", path, "--out", tmp_path / "o", "--tokenizer", "bytes", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "2 chat examples, 61 of the tokens train; median 82 tokens, longest 91" in done.stdout
    bad = run_cli("data", "prepare", path, "--out", tmp_path / "o2", "--format", "instruct", "--no-progress")
    assert bad.returncode == 2 and "an instruct record has string fields 'prompt'" in bad.stderr
