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
