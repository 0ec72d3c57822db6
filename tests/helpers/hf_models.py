"""Small random `transformers` models written offline (config classes + save_pretrained), the
"released checkpoints" the init: hf tests load; and the per-rank functions those tests run."""
from __future__ import annotations

from pathlib import Path

import torch

SEQ = 16  # training context of the tests (config.json says more)


def make_config(arch: str):
    """GPT-2 (tied, fused c_attn), Llama (GQA, rope_theta 500000 + Llama 3.1 rope scaling, untied) or
    Qwen2 (bias on q/k/v, tied)."""
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                          architectures=["GPT2LMHeadModel"])
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    if arch == "llama":
        from transformers import LlamaConfig

        # original_max_position_embeddings 16 with head_dim 16: some frequencies are divided by
        # `factor`, one is blended (the smooth band), so every branch of the scaling is used.
        return LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16},
                           architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           architectures=["Qwen2ForCausalLM"])
    raise ValueError(arch)


def make_hf_model(arch: str, directory: str | Path, *, sharded: bool = False, seed: int = 0,
                  dtype: torch.dtype = torch.float32):
    """A random model of `arch` saved to `directory` (safetensors; `sharded`: several files and an
    index). Every parameter is perturbed, biases and norms too, so a misplaced one shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch), attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if ("norm" in name or ".ln_" in name) and name.endswith("weight") else noise)
    model = model.to(dtype)
    model.save_pretrained(str(directory), max_shard_size="40KB" if sharded else "10GB")
    return model


def hf_spec(path, **model) -> dict:
    return {"model": {"init": "hf", "path": str(path), "seq_len": SEQ, **model},
            "train": {"steps": 2, "global_batch": 8, "micro_batch": 2, "lr": 1e-3, "seed": 0}}


def hf_loss(model, spec: dict, step: int = 1) -> float:
    """transformers' mean next-token loss on the run's global batch of `step`."""
    from workbench.data import build_token_source
    from workbench.spec import load_spec

    s = load_spec(spec)
    tokens = build_token_source(s).rank_batch(step, s.train.global_batch, 0, 1)
    with torch.no_grad():
        logits = model.float()(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
