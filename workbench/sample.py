"""`workbench sample CHECKPOINT --prompt TEXT`: continue a prompt with a trained checkpoint and
the run's own tokenizer (nanoGPT's sample.py: temperature and top-k, a seeded generator)."""
from __future__ import annotations

import math

import torch

from workbench.errors import ConfigError

MAX_NEW_TOKENS = 1 << 16  # a look at a model, not a serving engine: export and use transformers for more
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6  # below: greedy in effect (use 0); above: uniform in effect
MAX_SEED = 2**64 - 1  # torch.Generator's seed is an unsigned 64-bit integer


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, *, temperature: float = 0.8, top_k: int | None = 50,
             seed: int = 0) -> list[int]:
    """`ids` followed by `max_new_tokens` sampled tokens (greedy when temperature is 0).

    Raises:
        ConfigError: the model's logits are not finite (its weights are not a trained model's).
    """
    gen = torch.Generator().manual_seed(seed)
    out = list(ids)
    seq_len = model.shape.seq_len
    for i in range(max_new_tokens):
        x = torch.tensor([out[-seq_len:]], dtype=torch.long)  # the context is cropped to what the model saw
        logits = model(x)[0, -1].float()
        if temperature:
            logits = logits / temperature
        if not torch.isfinite(logits).all():  # softmax would give NaN and multinomial a RuntimeError
            raise ConfigError(f"sample: the logits for new token {i + 1} are not finite (NaN or inf) at --temperature "
                              f"{temperature}: the weights are not a usable model (a diverged run?), or the "
                              "temperature is too small for them. Sample from an earlier checkpoint, or use 0 (greedy).")
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        out.append(nxt)
    return out


def check_options(max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    """The sampling options are within what generate() computes with.

    Raises:
        ConfigError: an option outside its range, named with the range and a usual value.
    """
    if not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: use 0 to {MAX_NEW_TOKENS:,} (e.g. 200); for longer "
                          "texts export the model (`workbench export --to hf`) and generate with transformers.")
    if not (temperature == 0 or math.isfinite(temperature) and MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ConfigError(f"--temperature {temperature}: use 0 (greedy) or a number from {MIN_TEMPERATURE:g} to "
                          f"{MAX_TEMPERATURE:g}, such as 0.8.")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top-k {top_k}: use 0 (no limit) or a positive number of tokens, such as 50.")
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed {seed}: use an integer from 0 to 2**64-1 ({MAX_SEED:,}), such as 0.")


def sample(checkpoint: str, prompt: str, max_new_tokens: int = 100, *, temperature: float = 0.8,
           top_k: int | None = 50, seed: int = 0) -> str:
    """The prompt and its continuation, decoded with the run's tokenizer.

    Raises:
        ConfigError: an option out of range, no checkpoint, synthetic data (no tokenizer), an empty prompt.
    """
    from workbench.export import load_checkpoint_model, run_tokenizer

    check_options(max_new_tokens, temperature, top_k, seed)
    model, spec = load_checkpoint_model(checkpoint)
    tok = run_tokenizer(spec)
    ids = tok.encode_batch([prompt])[0] if prompt else []
    if not ids:
        ids = [tok.eos_id] if tok.eos_id is not None else None
        if ids is None:
            raise ConfigError("--prompt is empty and the byte-level tokenizer has no start token; give a prompt.")
    out = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(out)
