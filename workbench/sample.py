"""`workbench sample CHECKPOINT --prompt TEXT`: continue a prompt with a trained checkpoint and
the run's own tokenizer (nanoGPT's sample.py: temperature and top-k, a seeded generator)."""
from __future__ import annotations

import torch

from workbench.errors import ConfigError


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, *, temperature: float = 0.8, top_k: int | None = 50,
             seed: int = 0) -> list[int]:
    """`ids` followed by `max_new_tokens` sampled tokens (greedy when temperature is 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([ids], dtype=torch.long)
    seq_len = model.shape.seq_len
    for _ in range(max_new_tokens):
        logits = model(x[:, -seq_len:])[0, -1].float()  # the context is cropped to what the model saw
        if temperature == 0:
            nxt = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        x = torch.cat([x, nxt.view(1, 1)], dim=1)
    return x[0].tolist()


def sample(checkpoint: str, prompt: str, max_new_tokens: int = 100, *, temperature: float = 0.8,
           top_k: int | None = 50, seed: int = 0) -> str:
    """The prompt and its continuation, decoded with the run's tokenizer.

    Raises:
        ConfigError: no checkpoint, synthetic data (no tokenizer), an empty prompt.
    """
    from workbench.export import load_checkpoint_model, run_tokenizer

    if temperature < 0:
        raise ConfigError(f"--temperature {temperature}: use 0 (greedy) or a positive value such as 0.8.")
    model, spec = load_checkpoint_model(checkpoint)
    tok = run_tokenizer(spec)
    ids = tok.encode_batch([prompt])[0] if prompt else []
    if not ids:
        ids = [tok.eos_id] if tok.eos_id is not None else None
        if ids is None:
            raise ConfigError("--prompt is empty and the byte-level tokenizer has no start token; give a prompt.")
    out = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(out)
