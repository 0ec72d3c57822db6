"""`workbench import -o job.yaml` then `export-config job.yaml` keeps what the config said and invents
nothing (issue 30): the YAML holds only the fields the import set, so a GPU config stays a GPU
config and no optimizer block appears; a tokenizer.json's end-of-document token is found under its
usual names."""
import json
from pathlib import Path

import yaml

from workbench.cli import main as cli_main

REAL = Path(__file__).parent.parent / "fixtures" / "interop" / "real"


def test_a_multi_gpu_accelerate_config_survives_the_cli_round_trip(tmp_path, capsys):
    src = REAL / "accelerate/accelerate/examples/config_yaml_templates/multi_gpu.yaml"
    job, out = tmp_path / "job.yaml", tmp_path / "back.yaml"
    assert cli_main(["import", str(src), "-o", str(job)]) == 0
    assert "resources" not in yaml.safe_load(job.read_text()) or "gpu" not in yaml.safe_load(job.read_text())["resources"]
    assert cli_main(["export-config", str(job), "--to", "accelerate", "-o", str(out)]) == 0
    back = yaml.safe_load(out.read_text())
    assert back["distributed_type"] == "MULTI_GPU" and not back.get("use_cpu")
    capsys.readouterr()


def test_a_deepspeed_config_without_optimizer_gets_none_back(tmp_path):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    job, out = tmp_path / "job.yaml", tmp_path / "back.json"
    assert cli_main(["import", str(src), "-o", str(job), "--set", "layout.dp=2"]) == 0
    assert cli_main(["export-config", str(job), "--to", "deepspeed", "-o", str(out)]) == 0
    back = json.loads(out.read_text())
    assert "optimizer" not in back and back["gradient_accumulation_steps"] == 1


def test_end_of_document_token_under_its_usual_names(tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from workbench.shards import prepare

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in ("a b", "b a")) + "\n")
    for eos, expected in (("</s>", 3), (None, None)):
        vocab = {"[UNK]": 0, "a": 1, "b": 2, **({eos: 3} if eos else {})}
        tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = Whitespace()
        path = tmp_path / f"tok-{bool(eos)}.json"
        tok.save(str(path))
        index = prepare([str(corpus)], str(tmp_path / f"out-{bool(eos)}"), tokenizer=str(path), progress=False)
        assert index["eos_id"] == expected and index["num_tokens"] == 4 + (2 if eos else 0)
        assert ("no end-of-document token" in capsys.readouterr().err) == (eos is None)
