"""Get a trained model out: load any layout's checkpoint into one plain model, and export it as
a Hugging Face folder (safetensors + config.json) that transformers loads as GPT2LMHeadModel
(gpt family) or LlamaForCausalLM (llama family).

The checkpoint's canonical names (DCP's, for DDP, ZeRO/FSDP2, TP and pipeline stages alike)
are read with no process group: DCP reassembles the shards into full tensors. Where our
architecture and HF's differ in a way a config cannot express, the export refuses and says why.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from workbench.errors import ConfigError

GPT_LN_EPS = 1e-5  # nn.LayerNorm's default, which models.py uses; GPT-2's layer_norm_epsilon
LLAMA_NORM_EPS = 1e-5  # models.RMSNorm's default
ROPE_THETA = 10000.0  # models._rope_tables
# DCP says this on every load without a process group, which is what we mean here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_dir(uri: str) -> tuple[str, dict]:
    """(step directory URL, manifest) of `uri`: a step-NNNNNNNNN directory or a checkpoint.uri
    (its newest complete checkpoint).

    Raises:
        ConfigError: no complete checkpoint there.
    """
    from workbench.runtime.checkpoint_store import _STEP_RE, MANIFEST, Store

    name = uri.rstrip("/").rsplit("/", 1)[-1]
    m = _STEP_RE.match(name)
    if m and not m.group(2):
        store = Store(uri.rstrip("/")[: -len(name) - 1] or ".")
        step = int(m.group(1))
    else:
        store = Store(uri)
        steps = store.committed_steps()
        if not steps:
            raise ConfigError(f"no complete checkpoint under {uri!r} (no step-*/{MANIFEST}). Point at a run's "
                              "checkpoint.uri or one of its step-NNNNNNNNN directories.")
        step = steps[0]
    try:
        manifest = store.read_manifest(step)
    except Exception as e:  # noqa: BLE001 - a missing or unreadable manifest: not a complete checkpoint
        raise ConfigError(f"{uri!r} is not a complete checkpoint ({e}).") from None
    return store.url(store.step_dir(step)), manifest


def load_checkpoint_model(uri: str):
    """(model, spec): the checkpoint's weights in a plain fp32 model on CPU, any layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from workbench.models import GPT
    from workbench.runtime.checkpoint_safe import SafeLoadPlanner, reader_for, unsafe_cause
    from workbench.runtime.checkpoint_store import manifest_spec
    from workbench.spec import load_spec

    path, manifest = checkpoint_dir(uri)
    spec = load_spec(manifest_spec(manifest, uri))
    if spec.model.factory is not None:
        raise ConfigError("export/sample: a factory model has no known architecture here; load its checkpoint with "
                          "torch.distributed.checkpoint into your own module.")
    model = GPT(spec.model.shape()).float()
    reader = reader_for("://" not in path)(path)
    try:
        saved = set(reader.read_metadata().state_dict_metadata)
        state = {k: v for k, v in model.state_dict().items() if f"model.{k}" in saved}
        missing = [k for k in model.state_dict()
                   if k not in state and not (k == "head.weight" and spec.model.shape().tie_embeddings)]
        if missing:
            raise ConfigError(f"checkpoint {path} lacks {missing[:3]}: it was not written by this model shape.")
        dcp.load({"model": state}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except ConfigError:
        raise
    except (Exception, CheckpointException) as e:
        from workbench.runtime.checkpoint_store import describe_error

        cause = unsafe_cause(e)
        why = f"holds files that are not plain checkpoint data ({cause})" if cause else \
            f"does not load ({describe_error(e)})"
        raise ConfigError(f"checkpoint {path} {why}; nothing was loaded or run. Export from a checkpoint written by "
                          "workbench that nobody else can write to.") from None
    model.load_state_dict(state, strict=False)
    return model.eval(), spec


def hf_state_dict(model) -> tuple[dict[str, torch.Tensor], object]:
    """(HF state dict, transformers config) of our GPT. Raises ConfigError where HF's
    architecture cannot express ours."""
    shape = model.shape
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if shape.family == "gpt":
        return _gpt2(sd, shape)
    return _llama(sd, shape)


def _gpt2(sd: dict, shape) -> tuple[dict, object]:
    from transformers import GPT2Config

    if shape.kv_heads != shape.heads:
        raise ConfigError(f"export --to hf: GPT-2 has no grouped-query attention, but model.kv_heads={shape.kv_heads} "
                          f"!= heads={shape.heads}. Use the llama family for GQA, or kv_heads=heads.")
    out = {"transformer.wte.weight": sd["tok_emb.weight"], "transformer.wpe.weight": sd["pos_emb.weight"],
           "transformer.ln_f.weight": sd["norm.weight"], "transformer.ln_f.bias": sd["norm.bias"]}
    for i in range(shape.layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        # GPT-2's Conv1D keeps weights as (in, out): the transpose of nn.Linear's; q, k, v are one c_attn.
        out[h + "attn.c_attn.weight"] = torch.cat([sd[b + f"attn.{w}.weight"] for w in ("wq", "wk", "wv")]).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[b + f"attn.{w}.bias"] for w in ("wq", "wk", "wv")])
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.w1", "mlp.c_fc"), ("mlp.w2", "mlp.c_proj")):
            out[h + theirs + ".weight"] = sd[b + ours + ".weight"].t().contiguous()
            out[h + theirs + ".bias"] = sd[b + ours + ".bias"]
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[h + theirs + ".weight"], out[h + theirs + ".bias"] = sd[b + ours + ".weight"], sd[b + ours + ".bias"]
    if not shape.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    config = GPT2Config(vocab_size=shape.vocab, n_positions=shape.seq_len, n_embd=shape.hidden, n_layer=shape.layers,
                        n_head=shape.heads, n_inner=shape.ffn_hidden, activation_function="gelu_new",  # tanh GELU
                        layer_norm_epsilon=GPT_LN_EPS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=shape.tie_embeddings, architectures=["GPT2LMHeadModel"])
    return out, config


def _rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Our rotary embedding rotates adjacent pairs (2i, 2i+1); HF's rotate_half pairs (i, i+D/2).
    Reordering each head's q/k rows maps one onto the other (Meta's convert_llama_weights_to_hf)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _llama(sd: dict, shape) -> tuple[dict, object]:
    from transformers import LlamaConfig

    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm.weight"]}
    names = {"attn.wo": "self_attn.o_proj", "attn.wv": "self_attn.v_proj", "mlp.w1": "mlp.gate_proj",
             "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj", "attn_norm": "input_layernorm",
             "mlp_norm": "post_attention_layernorm"}
    for i in range(shape.layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "self_attn.q_proj.weight"] = _rope_permute(sd[b + "attn.wq.weight"], shape.heads)
        out[h + "self_attn.k_proj.weight"] = _rope_permute(sd[b + "attn.wk.weight"], shape.kv_heads)
        for ours, theirs in names.items():
            out[h + theirs + ".weight"] = sd[b + ours + ".weight"]
    if not shape.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn_hidden,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                         max_position_embeddings=shape.seq_len, rms_norm_eps=LLAMA_NORM_EPS, hidden_act="silu",
                         rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                         attention_bias=False, mlp_bias=False, tie_word_embeddings=shape.tie_embeddings,
                         architectures=["LlamaForCausalLM"])
    return out, config


def export_hf(checkpoint: str, out_dir: str) -> Path:
    """Write `checkpoint` (a checkpoint.uri or step directory) to `out_dir` as a transformers folder:
    model.safetensors, config.json and, when the run had one, its tokenizer.

    Raises:
        ConfigError: no checkpoint, a factory model, or an architecture HF cannot express.
    """
    from safetensors.torch import save_file

    model, spec = load_checkpoint_model(checkpoint)
    state, config = hf_state_dict(model)
    try:
        tok = run_tokenizer(spec, required=False)
    except ConfigError as e:  # the shards moved: the model still exports, without its tokenizer
        warnings.warn(f"exporting without a tokenizer: {e} Set data.tokenizer in the spec to include one.",
                      stacklevel=2)
        tok = None
    # GPT2Config defaults to GPT-2's own <|endoftext|> id (50256); ours is the run tokenizer's.
    config.bos_token_id = config.eos_token_id = tok.eos_id if tok is not None else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    if tok is not None and hasattr(tok, "tok"):
        from transformers import PreTrainedTokenizerFast

        from workbench.tokenizer import EOS

        PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token=EOS if tok.eos_id is not None else None,
                                model_max_length=model.shape.seq_len).save_pretrained(str(out))
    return out


def run_tokenizer(spec, required: bool = True):
    """The tokenizer a run's data was made with: data.tokenizer, the shards' own, or bytes for text.

    Raises:
        ConfigError: synthetic data (no text behind the tokens) when `required`.
    """
    from workbench.tokenizer import ByteTokenizer, load_tokenizer_file

    d = spec.data
    if d.tokenizer:
        return load_tokenizer_file(d.tokenizer)
    if d.source == "tokens":
        from workbench.shards import TokenShards

        return TokenShards(d.path).tokenizer()
    if d.source == "text":
        return ByteTokenizer()
    if required:
        raise ConfigError("this run trained on synthetic tokens: there is no tokenizer to turn a prompt into them. "
                          "Train on text (data.source: text or tokens) to sample.")
    return None
