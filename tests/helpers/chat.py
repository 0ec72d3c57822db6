"""Chat records for fine-tuning tests: jsonl files and chats whose loss-mask density varies."""
import json

import numpy as np

WORDS = "the file list copy move show print read write disk user time".split()


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def many_chats(n: int, seed: int = 0) -> list[dict]:
    """Chats whose prompts (1-19 words) and answers (1-11 words) vary in length, so the share of
    tokens that train differs from row to row and from micro-batch to micro-batch."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS, size=rng.integers(1, 20)))
        a = " ".join(rng.choice(WORDS, size=rng.integers(1, 12)))
        out.append({"messages": [{"role": "user", "content": f"{i}: {q}?"}, {"role": "assistant", "content": a}]})
    return out
