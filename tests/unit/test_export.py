"""Export to Hugging Face: transformers loads the folder as GPT2LMHeadModel / LlamaForCausalLM
and reproduces our fp32 logits; sample continues a prompt with the run's tokenizer."""
import os

import pytest
import torch

from workbench import ConfigError
from workbench.cli import main
from workbench.export import export_hf, load_checkpoint_model
from workbench.runtime.loop import train
from workbench.shards import prepare

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a hub
LLAMA = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 64}
MODELS = {"gpt": {"preset": "gpt-tiny"}, "gpt-tied": {"preset": "gpt-tiny", "tie_embeddings": True}, "llama-gqa": LLAMA}
ARCH = {"gpt": "GPT2LMHeadModel", "gpt-tied": "GPT2LMHeadModel", "llama-gqa": "LlamaForCausalLM"}


def run(tmp_path, model, data=None, steps=3) -> str:
    uri = str(tmp_path / "ckpt")
    train({"model": model, "data": data or {"source": "text"}, "checkpoint": {"uri": uri},
           "train": {"steps": steps, "global_batch": 4, "micro_batch": 4, "lr": 1e-2}}, lambda e: None)
    return uri


def assert_hf_matches(uri: str, out, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    export_hf(uri, str(out))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    ours, spec = load_checkpoint_model(uri)
    x = torch.randint(0, spec.model.shape().vocab, (2, spec.model.shape().seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_loads_the_export_with_our_logits(tmp_path, name):
    uri = run(tmp_path, MODELS[name])
    assert_hf_matches(uri, tmp_path / "hf", ARCH[name])
    # The trained weights, not the initialization, went out.
    trained = load_checkpoint_model(uri)[0].state_dict()["blocks.0.attn.wq.weight"]
    from workbench import build_model

    assert not torch.equal(trained, build_model({"model": MODELS[name]}).state_dict()["blocks.0.attn.wq.weight"])


def test_gpt_with_grouped_query_attention_is_refused(tmp_path):
    uri = run(tmp_path, {"preset": "gpt-tiny", "kv_heads": 2}, steps=1)
    with pytest.raises(ConfigError, match="GPT-2 has no grouped-query attention"):
        export_hf(uri, str(tmp_path / "hf"))


def test_cli_export_and_sample_with_the_runs_bpe(tmp_path, capsys):
    from transformers import AutoTokenizer

    from workbench.data import DEFAULT_TEXT

    prepare([str(DEFAULT_TEXT)], str(tmp_path / "tok"), vocab_size=320, progress=False)
    uri = run(tmp_path, {"preset": "gpt-tiny", "vocab": 320}, data={"source": "tokens", "path": str(tmp_path / "tok")})
    assert main(["export", uri, "--to", "hf", str(tmp_path / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.decode(tok("Four score and seven")["input_ids"]) == "Four score and seven"
    capsys.readouterr()
    args = ["sample", uri, "--prompt", "Four score", "--max-new-tokens", "12", "--seed", "1"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("Four score") and len(first) > len("Four score\n")
    assert main(args) == 0 and capsys.readouterr().out == first  # seeded
    assert main(["sample", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_sample_refuses_synthetic_runs(tmp_path):
    from workbench.sample import sample

    uri = run(tmp_path, {"preset": "gpt-tiny"}, data={"source": "synthetic"}, steps=1)
    with pytest.raises(ConfigError, match="synthetic tokens"):
        sample(uri, "hello")


def test_export_without_the_shards_still_writes_the_model(tmp_path):
    import shutil

    from workbench.data import DEFAULT_TEXT

    prepare([str(DEFAULT_TEXT)], str(tmp_path / "tok"), vocab_size=300, progress=False)
    uri = run(tmp_path, {"preset": "gpt-tiny", "vocab": 300}, data={"source": "tokens", "path": str(tmp_path / "tok")}, steps=1)
    shutil.rmtree(tmp_path / "tok")
    with pytest.warns(UserWarning, match="without a tokenizer.*no index.json"):
        out = export_hf(uri, str(tmp_path / "hf"))
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()


# -- review findings 3, 4, 6, 7, 8, 9, 10: which step is used, where it is written, bad options --------


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> str:
    """A text run with checkpoints at steps 2 and 4 (copy it before damaging it)."""
    uri = str(tmp_path_factory.mktemp("two") / "ckpt")
    train({"model": {"preset": "gpt-tiny"}, "data": {"source": "text"}, "checkpoint": {"uri": uri, "every_steps": 2},
           "train": {"steps": 4, "global_batch": 4, "micro_batch": 4, "lr": 1e-2}}, lambda e: None)
    return uri


def damaged(two_steps, tmp_path, how: str) -> str:
    """A copy of `two_steps` with step 4 damaged: `flip` (bit rot, size kept), `truncate`, `nested`
    (a manifest nested past Python's recursion limit), `huge` (a 600 MB sparse manifest), `fifo` or
    `entry` (a manifest whose file entry is not {bytes, crc32})."""
    import shutil

    uri = tmp_path / "ckpt"
    shutil.copytree(two_steps, uri)
    step = uri / "step-000000004"
    shard, manifest = step / "__0_0.distcp", step / "manifest.json"
    if how == "flip":
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            f.write(b"\x7f" * 64)
    elif how == "truncate":
        os.truncate(shard, 1000)
    elif how == "nested":
        manifest.write_text("[" * 100_000 + "]" * 100_000)
    elif how == "huge":
        os.truncate(manifest, 600 << 20)
    elif how == "fifo":
        manifest.unlink()
        os.mkfifo(manifest)
    elif how == "entry":
        import json

        recorded = json.loads(manifest.read_text())
        recorded["files"]["__0_0.distcp"] = 5
        manifest.write_text(json.dumps(recorded))
    return str(uri)


@pytest.mark.parametrize("how, why", [("flip", "__0_0.distcp: CRC-32 mismatch"),
                                      ("truncate", r"__0_0.distcp: 1000 bytes, manifest says \d+ \(truncated\?\)"),
                                      ("nested", "manifest unreadable .RecursionError"),
                                      ("huge", "manifest.json is 629,145,600 bytes; a manifest is at most"),
                                      ("fifo", "manifest.json is not a regular file"),
                                      ("entry", "manifest.json: 'files' is not a mapping of file names")])
@pytest.mark.timeout(120)  # fifo: opening the manifest would wait for a writer forever
def test_export_sample_and_init_skip_a_damaged_newest_step(two_steps, tmp_path, how, why):
    from workbench import build_model
    from workbench.runtime.checkpoint import CheckpointWarning
    from workbench.sample import sample

    uri = damaged(two_steps, tmp_path, how)
    step2 = load_checkpoint_model(f"{uri}/step-000000002")[0].state_dict()
    warned = f"step-000000004: {why}.*using step 2, the newest intact one"
    with pytest.warns(CheckpointWarning, match=warned):
        out = export_hf(uri, str(tmp_path / "hf"))
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out / "model.safetensors"))["lm_head.weight"], step2["head.weight"])
    with pytest.warns(CheckpointWarning, match=warned):
        assert sample(uri, "The ", 5, seed=1) == sample(f"{uri}/step-000000002", "The ", 5, seed=1)
    with pytest.warns(CheckpointWarning, match=warned):  # what each rank of a fine-tuning run builds
        model = build_model({"model": {"preset": "gpt-tiny", "init": "checkpoint", "path": uri}})
    assert torch.equal(model.state_dict()["blocks.0.attn.wq.weight"], step2["blocks.0.attn.wq.weight"])


def test_a_damaged_step_directory_is_refused_naming_the_intact_one(two_steps, tmp_path):
    uri = damaged(two_steps, tmp_path, "flip")
    with pytest.raises(ConfigError, match="step-000000004 fails its integrity check .__0_0.distcp: CRC-32 mismatch"
                                          ".*nothing was loaded. Step 2 is intact: point at .*step-000000002"):
        export_hf(f"{uri}/step-000000004", str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    os.truncate(f"{uri}/step-000000002/__0_0.distcp", 10)
    with pytest.raises(ConfigError, match="no intact checkpoint under .*step-000000004: __0_0.distcp: CRC-32 "
                                          "mismatch.*step-000000002: __0_0.distcp: 10 bytes"):
        load_checkpoint_model(uri)
    from backends.local_start import check_before_start
    from workbench.spec import load_spec

    with pytest.raises(ConfigError, match="no intact checkpoint under"):  # a fine-tune from it: before any worker
        check_before_start(load_spec({"model": {"preset": "gpt-tiny", "init": "checkpoint", "path": uri}}))


def test_export_refuses_a_file_or_a_folder_with_other_files_and_replaces_an_earlier_export(two_steps, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="that is a file, but an export is a folder"):
        export_hf(two_steps, str(tmp_path / "afile"))
    with pytest.raises(ConfigError, match="cannot (create the folder|write in)"):
        export_hf(two_steps, "/proc/nope/hf")
    release = tmp_path / "release"
    release.mkdir()
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"):
        (release / name).write_text("{}")
    with pytest.raises(ConfigError, match=r"holds files an export does not write \(model-00001-of-00002.safetensors, "
                                          r"model.safetensors.index.json\).*Nothing was written"):
        export_hf(two_steps, str(release))
    assert sorted(p.name for p in release.iterdir()) == ["config.json", "model-00001-of-00002.safetensors",
                                                         "model.safetensors.index.json"]
    out = tmp_path / "hf"
    export_hf(f"{two_steps}/step-000000002", str(out))
    (out / "tokenizer.json").write_text("{}")  # an earlier export's tokenizer, which this run has no file of
    export_hf(two_steps, str(out))
    from safetensors.torch import load_file

    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    step4 = load_checkpoint_model(two_steps)[0].state_dict()
    assert torch.equal(load_file(str(out / "model.safetensors"))["lm_head.weight"], step4["head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "hf", "release"]  # no staging folder is left


@pytest.mark.parametrize("option, match", [
    ({"temperature": float("nan")}, "--temperature nan: use 0 .greedy. or a number from 1e-06 to 1e.06"),
    ({"temperature": 1e-30}, "--temperature 1e-30"),
    ({"top_k": -5}, "--top-k -5: use 0 .no limit. or a positive number"),
    ({"seed": 99999999999999999999999}, "--seed 99999999999999999999999: use an integer from 0 to 2..64-1"),
    ({"max_new_tokens": 100_000_000}, "--max-new-tokens 100000000: use 0 to 65,536"),
])
def test_sample_options_out_of_range_are_config_errors(two_steps, option, match):
    from workbench.sample import sample

    with pytest.raises(ConfigError, match=match):
        sample(two_steps, "The ", **{"max_new_tokens": 5, **option})


def test_sample_refuses_a_model_whose_logits_are_not_finite(two_steps):
    from workbench.sample import generate

    model = load_checkpoint_model(two_steps)[0]
    with torch.no_grad():
        model.state_dict()["head.weight"][3] = float("inf")
    with pytest.raises(ConfigError, match="logits for new token 1 are not finite"):
        generate(model, [1, 2], 3)


def test_a_recorded_tokenizer_that_is_a_pipe_is_refused_without_opening_it(tmp_path):
    from tests.helpers.blocking import refusal_within
    from workbench.tokenizer import load_tokenizer_file

    os.mkfifo(tmp_path / "tokenizer.json")  # open() would wait for a writer forever
    assert "is not a regular file" in (refusal_within(lambda: load_tokenizer_file(str(tmp_path / "tokenizer.json")))
                                       or "")
