"""Training features on 2 gloo ranks: token shards and evaluation keep layout invariance (dp2,
zero3, tp2, pp2 give the single-process losses and eval losses), and a checkpoint of each
multi-rank layout exports to a transformers model with our fp32 logits."""
import os

import pytest
import torch

from tests.helpers.events import losses
from tests.helpers.models import TWO_RANK_LAYOUTS
from tests.helpers.reference import reference_run
from workbench.data import DEFAULT_TEXT
from workbench.export import export_hf, load_checkpoint_model
from workbench.shards import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
os.environ["HF_HUB_OFFLINE"] = "1"
LLAMA = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 384, "seq_len": 32}
GPT = {"preset": "gpt-tiny", "vocab": 384}
CASES = {name: ({"gpt": GPT, "llama": LLAMA}[family], layout) for name, (family, layout) in TWO_RANK_LAYOUTS.items()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    prepare([str(DEFAULT_TEXT)], str(out), tokenizer="bpe", vocab_size=384, progress=False)
    return str(out)


def spec(shards, model, layout=None, uri=None):
    out = {"name": "train-dist", "model": model, "layout": layout or {},
           "data": {"source": "tokens", "path": shards, "val_fraction": 0.15},
           "train": {"steps": 4, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "schedule": "cosine",
                     "warmup_steps": 1, "eval_every": 2, "eval_batches": 2}}
    if uri:
        out["checkpoint"] = {"uri": str(uri)}
    return out


@pytest.fixture(scope="module")
def references(shards):
    return {name: reference_run(spec(shards, model), gather_state=True)
            for name, model in (("gpt", GPT), ("llama", LLAMA))}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_on_tokens_matches_single_process_and_exports(name, shards, references, pool2, tmp_path):
    from transformers import AutoModelForCausalLM

    model, layout = CASES[name]
    events = pool2.run(spec(shards, model, layout, uri=tmp_path / "ckpt"), timeout_s=300)
    ref = references[name.split("-")[0]]
    torch.testing.assert_close(losses(events), ref.losses(), rtol=1e-4, atol=0)
    torch.testing.assert_close(losses(events, "eval"), ref.losses("eval"), rtol=1e-4, atol=0)
    assert [e["step"] for e in events if e["event"] == "eval"] == [2, 4]

    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours, _ = load_checkpoint_model(str(tmp_path / "ckpt"))
    consolidated = ours.state_dict()
    for key, value in ref.state.items():  # the checkpoint holds the trained model, whole
        torch.testing.assert_close(consolidated[key], value, rtol=1e-4, atol=1e-5, msg=key)
    x = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-4, rtol=0)
