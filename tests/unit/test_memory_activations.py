"""The activation tables against what autograd really saves in our model (saved_tensors_hooks)."""
import pytest
import torch

from workbench.memory import Layout, estimate_stage
from workbench.memory import activations as act
from workbench.models import GPT, resolve_shape
from workbench.parallel.materialize import materialize
from workbench.spec import ModelSpec

SHAPES = {
    "gpt": ModelSpec(family="gpt", layers=2, hidden=64, heads=4, vocab=256, seq_len=32, tie_embeddings=False),
    "llama-gqa": ModelSpec(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=256, seq_len=32),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _saved_bytes(fn, params) -> int:
    """Bytes of distinct non-parameter storages autograd keeps while `fn` runs."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _model(name, dtype):
    shape = resolve_shape(SHAPES[name])
    with torch.device("meta"):
        model = GPT(shape)
    materialize(model, torch.device("cpu"), seed=0)
    return shape, model.to(DTYPES[dtype])


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_block_table_matches_autograd(name, dtype):
    shape, model = _model(name, dtype)
    b = 3
    x = torch.randn(b, shape.seq_len, shape.hidden, dtype=DTYPES[dtype], requires_grad=True)
    rope = model.rope_tables(x.device)
    measured = _saved_bytes(lambda: model.blocks["0"](x, rope), model.parameters())
    rope_tables = 0 if rope is None else sum(t[: shape.seq_len].numel() * 4 for t in rope)
    predicted = act.block_bytes_per_token(shape, dtype) * b * shape.seq_len
    assert measured - rope_tables == pytest.approx(predicted, rel=1e-9)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_whole_model_forward_and_loss(name, ckpt):
    """The runtime's own micro-batch loss (a view of the token batch, fp32 cross-entropy)."""
    from torch.utils.checkpoint import checkpoint

    from workbench.runtime.loop import micro_batch_loss

    shape, model = _model(name, "fp32")
    b = 2
    tokens = torch.randint(0, shape.vocab, (b, shape.seq_len + 1))
    if ckpt == "full":
        for key, block in list(model.blocks.items()):
            model.blocks[key] = _Ckpt(block, checkpoint)
    measured = _saved_bytes(lambda: micro_batch_loss(model, tokens), model.parameters())
    lay = Layout(micro_batch=b, num_micro=1, activation_checkpointing=ckpt)
    assert measured == estimate_stage(shape, lay, 0).activations


class _Ckpt(torch.nn.Module):
    def __init__(self, block, checkpoint):
        super().__init__()
        self.block, self.checkpoint = block, checkpoint

    def forward(self, x, rope=None):
        return self.checkpoint(self.block, x, rope, use_reentrant=False)


def test_cuda_tables_differ_only_in_the_norms():
    gpt = resolve_shape(SHAPES["gpt"])
    llama = resolve_shape(SHAPES["llama-gqa"])
    h = gpt.hidden
    # CUDA autocast: fp32 copies of the LayerNorm inputs and fp32 statistics (2 norms per block).
    diff = act.block_bytes_per_token(gpt, "bf16", device="cuda") - act.block_bytes_per_token(gpt, "bf16")
    assert diff == 2 * (2 * h + 2 * 2)
    assert act.block_bytes_per_token(gpt, "fp32", device="cuda") == act.block_bytes_per_token(gpt, "fp32")
    # Fused rms_norm keeps no fp32 normalized product.
    diff = act.block_bytes_per_token(llama, "bf16", device="cuda") - act.block_bytes_per_token(llama, "bf16")
    assert diff == -2 * 4 * llama.hidden


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(SHAPES))
def test_cuda_block_table_matches_autograd_under_autocast(name):
    """What the runtime does on a GPU: bf16 parameters (zero 0/1) under torch.autocast(bf16)."""
    shape, model = _model(name, "bf16")
    model = model.cuda()
    b = 3
    x = torch.randn(b, shape.seq_len, shape.hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    rope = model.rope_tables(x.device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        measured = _saved_bytes(lambda: model.blocks["0"](x, rope), model.parameters())
    rope_tables = 0 if rope is None else sum(t[: shape.seq_len].numel() * 4 for t in rope)
    predicted = act.block_bytes_per_token(shape, "bf16", device="cuda") * b * shape.seq_len
    assert measured - rope_tables == pytest.approx(predicted, rel=0.02)
