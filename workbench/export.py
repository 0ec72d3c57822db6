"""Get a trained model out: load any layout's checkpoint into one plain model, and export it as
a Hugging Face folder (safetensors + config.json) that transformers loads as GPT2LMHeadModel
(gpt family) or LlamaForCausalLM (llama family).

The checkpoint's canonical names (DCP's, for DDP, ZeRO/FSDP2, TP and pipeline stages alike)
are read with no process group: DCP reassembles the shards into full tensors. Where our
architecture and HF's differ in a way a config cannot express, the export refuses and says why.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.errors import ConfigError

# DCP says this on every load without a process group, which is what we mean here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_dir(uri: str) -> tuple[str, dict]:
    """(step directory URL, manifest) of `uri`: a step-NNNNNNNNN directory or a checkpoint.uri
    (its newest intact checkpoint).

    A step is used only after the check `--resume` makes: its manifest is readable, every file it
    lists has its size and CRC-32 (Store.check_step), and every pickle in it is data
    (checkpoint_safe.scan_step). At a checkpoint.uri a newer step that fails is skipped with a
    CheckpointWarning naming it and why.

    Raises:
        ConfigError: no checkpoint there, the step directory fails the check, or every step does.
    """
    from workbench.runtime.checkpoint_safe import scan_step
    from workbench.runtime.checkpoint_store import _STEP_RE, MANIFEST, Store, step_name

    name = uri.rstrip("/").rsplit("/", 1)[-1]
    m = _STEP_RE.match(name)
    if m and not m.group(2):
        store = Store(uri.rstrip("/")[: -len(name) - 1] or ".")
        step = int(m.group(1))
        manifest, problems = store.check_step(step, scan_step)
        if problems:
            raise ConfigError(f"checkpoint {uri}: {name} fails its integrity check ({'; '.join(problems[:3])}); "
                              f"nothing was loaded. {_intact_hint(store, skip=step)}")
        return store.url(store.step_dir(step)), manifest
    store = Store(uri)
    if not store.committed_steps():
        raise ConfigError(f"no complete checkpoint under {uri!r} (no step-*/{MANIFEST}). Point at a run's "
                          "checkpoint.uri or one of its step-NNNNNNNNN directories.")
    manifest, rejected = store.newest_complete(check=scan_step)
    if manifest is None:
        listed = "; ".join(f"{step_name(s)}: {why}" for s, why in rejected)
        raise ConfigError(f"no intact checkpoint under {uri}: every step fails its integrity check ({listed}). "
                          "Nothing was loaded. Restore the files (e.g. from the store's versioning or a backup), "
                          "or point at another checkpoint.")
    if rejected:
        from workbench.runtime.checkpoint import CheckpointWarning

        skipped = "; ".join(f"{step_name(s)}: {why}" for s, why in rejected)
        warnings.warn(f"checkpoint {uri}: skipped the newer step(s) that fail their integrity check ({skipped}); "
                      f"using step {manifest['step']}, the newest intact one.", CheckpointWarning, stacklevel=2)
    return store.url(store.step_dir(manifest["step"])), manifest


def _intact_hint(store, skip: int) -> str:
    """Where an intact step of `store` is, other than `skip`, for an error about `skip`."""
    from workbench.runtime.checkpoint_safe import scan_step

    for step in store.committed_steps():
        if step != skip and not store.check_step(step, scan_step)[1]:
            return (f"Step {step} is intact: point at {store.url(store.step_dir(step))}, or at {store.uri} for its "
                    "newest intact step.")
    return "No other step there is intact: restore the files (e.g. from the store's versioning or a backup)."


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
    config = hf_config(shape)
    return to_hf(sd, shape), config


# -- the one mapping between our names and transformers', used both ways -----------------------
# Export (to_hf) applies each link to full tensors; import (workbench.hf_import) reads, through
# the same links, only the slice of the HF tensor a rank's shard needs.


@dataclass(frozen=True)
class Link:
    """Where our parameter `ours` lives in the HF checkpoint.

    hf: the HF tensor's name. transpose: HF keeps ours transposed (GPT-2's Conv1D, (in, out)).
    offset: ours starts this many rows into the HF tensor's output-feature dimension (GPT-2's
    fused c_attn holds q, k, v one after another). rope_heads: ours has the rotary pairs
    interleaved (2i, 2i+1) in each of these many heads of `head_dim` rows, HF has them split
    (i, i + D/2) (Meta's convert_llama_weights_to_hf permutation). vocab: the rows HF has when
    ours has padding rows after them (the embedding and the head).
    """

    ours: str
    hf: str
    transpose: bool = False
    offset: int = 0
    rope_heads: int = 0
    head_dim: int = 0
    vocab: int = 0


def hf_links(shape) -> dict[str, Link]:
    """Our canonical parameter names -> their Links, for the gpt (GPT2LMHeadModel) and llama
    (LlamaForCausalLM, also Mistral and Qwen2) families. A tied head has no link of its own."""
    links: list[Link] = []
    v = shape.vocab
    if shape.family == "gpt":
        links += [Link("tok_emb.weight", "transformer.wte.weight", vocab=v),
                  Link("pos_emb.weight", "transformer.wpe.weight"),
                  Link("norm.weight", "transformer.ln_f.weight"), Link("norm.bias", "transformer.ln_f.bias")]
        for i in range(shape.layers):
            b, h = f"blocks.{i}.", f"transformer.h.{i}."
            # GPT-2's Conv1D keeps weights as (in, out): the transpose of nn.Linear's; q, k, v are one c_attn.
            for w, off in (("wq", 0), ("wk", shape.hidden), ("wv", shape.hidden + shape.kv_dim)):
                links += [Link(f"{b}attn.{w}.weight", h + "attn.c_attn.weight", transpose=True, offset=off),
                          Link(f"{b}attn.{w}.bias", h + "attn.c_attn.bias", offset=off)]
            for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.w1", "mlp.c_fc"), ("mlp.w2", "mlp.c_proj")):
                links += [Link(b + ours + ".weight", h + theirs + ".weight", transpose=True),
                          Link(b + ours + ".bias", h + theirs + ".bias")]
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                links += [Link(b + ours + ".weight", h + theirs + ".weight"), Link(b + ours + ".bias", h + theirs + ".bias")]
        if not shape.tie_embeddings:
            links.append(Link("head.weight", "lm_head.weight", vocab=v))
        return {link.ours: link for link in links}
    links += [Link("tok_emb.weight", "model.embed_tokens.weight", vocab=v), Link("norm.weight", "model.norm.weight")]
    names = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj",
             "mlp.w2": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    biased = {"attn.wq": shape.qkv_bias, "attn.wk": shape.qkv_bias, "attn.wv": shape.qkv_bias,
              "attn.wo": shape.out_bias, "mlp.w1": shape.mlp_bias, "mlp.w3": shape.mlp_bias, "mlp.w2": shape.mlp_bias}
    rope = {"attn.wq": shape.heads, "attn.wk": shape.kv_heads}
    for i in range(shape.layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in names.items():
            kw = {"rope_heads": rope[ours], "head_dim": shape.head_dim} if ours in rope else {}
            links.append(Link(b + ours + ".weight", h + theirs + ".weight", **kw))
            if biased.get(ours):
                links.append(Link(b + ours + ".bias", h + theirs + ".bias", **kw))
    if not shape.tie_embeddings:
        links.append(Link("head.weight", "lm_head.weight", vocab=v))
    return {link.ours: link for link in links}


def rope_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Our rotary embedding rotates adjacent pairs (2i, 2i+1); HF's rotate_half pairs (i, i+D/2).
    Reordering each head's q/k rows (or bias entries) maps one onto the other."""
    flat = w.reshape(w.shape[0], -1)
    rows, cols = flat.shape
    out = flat.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return out.reshape(w.shape).contiguous()


def rope_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of rope_permute: HF's (i, i+D/2) rows of `heads` whole heads -> ours."""
    flat = w.reshape(w.shape[0], -1)
    rows, cols = flat.shape
    out = flat.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)
    return out.reshape(w.shape).contiguous()


def to_hf(sd: dict[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
    """Our full state dict (canonical names) -> HF's, through hf_links. Padding rows are dropped."""
    pieces: dict[str, list[tuple[int, Link, torch.Tensor]]] = {}
    for name, link in hf_links(shape).items():
        t = sd[name]
        if link.vocab:
            t = t[: link.vocab]
        if link.rope_heads:
            t = rope_permute(t, link.rope_heads)
        if link.transpose:
            t = t.t()
        pieces.setdefault(link.hf, []).append((link.offset, link, t))
    out = {}
    for hf, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        dim = 1 if parts[0][1].transpose else 0
        out[hf] = (parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts], dim=dim)).contiguous()
    return out


def hf_config(shape):
    """The transformers config that describes `shape` (GPT2Config or LlamaConfig).

    Raises:
        ConfigError: a shape HF's class cannot express (GQA in GPT-2, partial biases in Llama).
    """
    if shape.family == "gpt":
        from transformers import GPT2Config

        if shape.kv_heads != shape.heads:
            raise ConfigError(f"export --to hf: GPT-2 has no grouped-query attention, but model.kv_heads="
                              f"{shape.kv_heads} != heads={shape.heads}. Use the llama family for GQA, or kv_heads=heads.")
        return GPT2Config(vocab_size=shape.vocab, n_positions=shape.max_positions, n_embd=shape.hidden,
                          n_layer=shape.layers, n_head=shape.heads, n_inner=shape.ffn_hidden,
                          activation_function="gelu_new",  # tanh GELU
                          layer_norm_epsilon=shape.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          tie_word_embeddings=shape.tie_embeddings, architectures=["GPT2LMHeadModel"],
                          bos_token_id=None, eos_token_id=None)  # not GPT-2's 50256: export_hf sets the run's
    rope: dict = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        rs = shape.rope_scaling
        rope.update(rope_type="llama3", factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn_hidden,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                  rms_norm_eps=shape.norm_eps, hidden_act="silu", rope_parameters=rope,
                  tie_word_embeddings=shape.tie_embeddings)
    if shape.qkv_bias and not shape.out_bias and not shape.mlp_bias:  # Qwen2's pattern
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
    if shape.qkv_bias != shape.out_bias:
        raise ConfigError(f"export --to hf: qkv_bias={shape.qkv_bias} with out_bias={shape.out_bias}: Llama has one "
                          "attention_bias for q, k, v and o, and Qwen2 (bias on q, k, v alone) no MLP bias. Use equal "
                          "attention biases, or qkv_bias without mlp_bias.")
    if shape.sliding_window is not None:
        from transformers import MistralConfig

        return MistralConfig(**common, head_dim=shape.head_dim, sliding_window=shape.sliding_window,
                             architectures=["MistralForCausalLM"]) if not (shape.qkv_bias or shape.mlp_bias) else \
            _refuse_window(shape)
    from transformers import LlamaConfig

    return LlamaConfig(**common, head_dim=shape.head_dim, attention_bias=bool(shape.qkv_bias),
                       mlp_bias=bool(shape.mlp_bias), architectures=["LlamaForCausalLM"])


def _refuse_window(shape):
    raise ConfigError(f"export --to hf: a sliding window ({shape.sliding_window}) is Mistral's, which has no biases. "
                      "Drop model.sliding_window or the biases.")


def export_hf(checkpoint: str, out_dir: str) -> Path:
    """Write `checkpoint` (a checkpoint.uri or step directory) to `out_dir` as a transformers folder:
    model.safetensors, config.json and, when the run had one, its tokenizer.

    `out_dir` is new, empty, or an earlier export: the folder is written beside it under a hidden
    name and renamed into place, so a reader sees the old export or the new one whole, never a mix
    or a torn file.

    Raises:
        ConfigError: no intact checkpoint, a factory model, an architecture HF cannot express, or an
            `out_dir` that is a file, holds other files, or cannot be written.
    """
    from workbench.export_folder import export_target, written_whole

    target = export_target(out_dir)
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
    with written_whole(target, out_dir) as folder:
        _write_folder(folder, state, config, tok, model.shape.seq_len)
    return Path(out_dir)


def _write_folder(folder: Path, state: dict, config, tok, seq_len: int) -> None:
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    if tok is not None and hasattr(tok, "tok"):
        from transformers import PreTrainedTokenizerFast

        from workbench.tokenizer import EOS

        PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token=EOS if tok.eos_id is not None else None,
                                model_max_length=seq_len).save_pretrained(str(folder))


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
