"""Fine-tuning with a loss mask on 2 gloo ranks: the loss is the mean over the global batch's
completion tokens, so dp2, ZeRO-3, tp2 and pp2 give the single-process training and eval losses
although the share of tokens that train differs from micro-batch to micro-batch and rank to rank."""
import pytest
import torch

from tests.helpers.chat import jsonl, many_chats
from tests.helpers.events import losses
from tests.helpers.models import TWO_RANK_LAYOUTS
from tests.helpers.reference import reference_run
from workbench import build_model, load_spec
from workbench.data import IGNORE, build_token_source, targets
from workbench.shards import prepare

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
GPT = {"preset": "gpt-tiny", "seq_len": 128}
LLAMA = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "seq_len": 128}
CASES = {name: ({"gpt": GPT, "llama": LLAMA}[family], layout) for name, (family, layout) in TWO_RANK_LAYOUTS.items()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    prepare([jsonl(tmp / "chats.jsonl", many_chats(48))], str(tmp / "tokens"), tokenizer="bytes", progress=False)
    return str(tmp / "tokens")


def spec(shards, model, layout=None):
    return {"name": "loss-mask", "model": model, "layout": layout or {},
            "data": {"source": "tokens", "path": shards, "val_fraction": 0.2},
            "train": {"steps": 4, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "eval_every": 2, "eval_batches": 2}}


@pytest.fixture(scope="module")
def references(shards):
    return {name: reference_run(spec(shards, model)).events for name, model in (("gpt", GPT), ("llama", LLAMA))}


def test_the_reference_loss_is_the_mean_over_the_global_batchs_completion_tokens(shards, references):
    """Step 1's loss, computed by hand from the untrained model: the cross-entropy of every
    completion token of the global batch, averaged once. Averaging per micro-batch or per rank
    would give another number, and the batch is one where that matters."""
    s = load_spec(spec(shards, GPT))
    tokens, mask = build_token_source(s).rank_examples(1, 8, 0, 1)
    y = targets(tokens, mask)
    per_micro = (y != IGNORE).reshape(4, -1).sum(dim=1)
    assert len(set(per_micro.tolist())) == 4 and (y == IGNORE).any()  # the mask's density differs per micro-batch
    with torch.no_grad():
        logits = build_model(s)(tokens[:, :-1])
        token_losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                                                         reduction="none").reshape(4, -1)
    expected = token_losses.sum() / per_micro.sum()
    assert losses(references["gpt"])[0] == pytest.approx(expected.item(), rel=1e-5)
    by_micro = (token_losses.sum(dim=1) / per_micro).mean()
    assert abs(by_micro.item() - expected.item()) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_layouts_match_the_single_process_masked_losses(name, shards, references, pool2):
    model, layout = CASES[name]
    events = pool2.run(spec(shards, model, layout), timeout_s=300)
    ref = references[name.split("-")[0]]
    torch.testing.assert_close(losses(events), losses(ref), rtol=1e-4, atol=0)
    torch.testing.assert_close(losses(events, "eval"), losses(ref, "eval"), rtol=1e-4, atol=0)
    assert [e["step"] for e in events if e["event"] == "eval"] == [2, 4]
