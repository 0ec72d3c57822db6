"""Fine-tuning examples as tokens + a loss mask (1 = a token the model learns to predict).

Chat records (`{"messages": [{"role", "content"}, ...]}`) are rendered with the model's chat
template (transformers' `apply_chat_template`, jinja2's sandbox: a template is data, never code)
and only the assistant turns train. Instruction records (`{"prompt", "completion"}`, plain strings)
are prompt + completion + EOS, as TRL does it, and only the completion (+ EOS) trains. A tokenizer
without a chat template renders chats with DEFAULT_TEMPLATE below. docs/training.md, Fine-tuning.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from workbench.errors import ConfigError

FORMATS = ("auto", "text", "chat", "instruct")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # the tag transformers' assistant mask needs
ROLES = ("system", "user", "assistant")
# The plain chat rendering when the tokenizer has no chat template: (role, text before, text after);
# an assistant turn's content and its end (EOS, or "\n" for a tokenizer without one) train.
DEFAULT_TEMPLATE = {"system": ("", "\n\n"), "user": ("User: ", "\n"), "assistant": ("Assistant: ", "")}
# A template is data from a model folder: jinja2's sandbox stops code, not size ('x' * 10**9, a
# filter's width, a loop over range() repeating a message). Rendering one record may take this much
# more memory (a 64 Mi-character record renders in under 1 GiB) and give at most this much
# text beyond 4x its messages' (role markers, a default system prompt, tool descriptions).
RENDER_HEADROOM_BYTES = 2 << 30
RENDER_SLACK_CHARS = 1 << 20


def record_format(row, where: str, text_field: str) -> str:
    """'chat', 'instruct' or 'text' for one jsonl record, when exactly one of them fits."""
    if not isinstance(row, dict):
        raise ConfigError(f"data prepare: {where} is not a JSON object. Each jsonl line is one object.")
    kinds = [k for k, fits in (("chat", "messages" in row), ("instruct", "prompt" in row and "completion" in row),
                               ("text", text_field in row)) if fits]
    if len(kinds) != 1:
        found = ", ".join(sorted(row)[:8]) or "none"
        raise ConfigError(f"data prepare: {where}: cannot tell the record's format (fields: {found}; "
                          f"{'it fits ' + ' and '.join(kinds) if kinds else 'none fits'}). Records have 'messages' "
                          f"(chat), 'prompt' + 'completion' (instruct) or {text_field!r} (text); name it with --format.")
    return kinds[0]


def chat_messages(row, where: str) -> list[dict]:
    """The record's messages, checked: roles system/user/assistant, string contents, an assistant turn."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"data prepare: {where} has no 'messages' list. A chat record is "
                          '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}.')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            role = m.get("role") if isinstance(m, dict) else None
            raise ConfigError(f"data prepare: {where}: message {i} needs a role in {ROLES} and a string content "
                              f"(got role {str(role)[:40]!r}).")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"data prepare: {where} has no assistant message: nothing in it would train. Every chat "
                          "record needs at least one assistant turn.")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def instruct_pair(row, where: str) -> tuple[str, str]:
    prompt, completion = (row.get("prompt"), row.get("completion")) if isinstance(row, dict) else (None, None)
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise ConfigError(f"data prepare: {where}: an instruct record has string fields 'prompt' and a non-empty "
                          "'completion' (messages lists go in a chat record: {\"messages\": [...]}).")
    return prompt, completion




class ExampleEncoder:
    """Turns records into (token ids, loss mask) with one tokenizer.

    Args:
        tok: workbench's tokenizer (tokenizer.py) that the shards are written with.
        hf: transformers' tokenizer of the same vocabulary when the tokenizer came from a model
            folder (its chat template and special tokens), else None.
    """

    def __init__(self, tok, hf=None):
        self.tok, self.hf = tok, hf
        self.template = getattr(hf, "chat_template", None) if hf is not None else None
        self.eos_id = hf.eos_token_id if hf is not None and hf.eos_token_id is not None else tok.eos_id
        self._generation = self.template is not None and _GENERATION.search(self.template) is not None

    @property
    def template_name(self) -> str:
        return "tokenizer" if self.template else "default"

    def encode(self, fmt: str, rows: list, where: list[str]) -> list[tuple[list[int], list[int]]]:
        """(ids, mask) of each record; fmt is 'chat' or 'instruct'."""
        if fmt == "instruct":
            return self._pieces([_instruct_pieces(*instruct_pair(r, w), self._end()) for r, w in zip(rows, where)])
        chats = [chat_messages(r, w) for r, w in zip(rows, where)]
        if self.template is None:
            return self._pieces([_default_pieces(m, self._end()) for m in chats])
        return [self._templated(m, w) for m, w in zip(chats, where)]

    def text(self, fmt: str, row, where: str) -> str:
        """The record as plain text (what a BPE trained here on chat data learns from)."""
        if fmt == "instruct":
            pieces = _instruct_pieces(*instruct_pair(row, where), None)
        else:
            pieces = _default_pieces(chat_messages(row, where), None)
        return "".join(p for p, _ in pieces if isinstance(p, str))

    def _end(self):
        return self.eos_id if self.eos_id is not None else "\n"

    def _pieces(self, examples: list[list[tuple[str | int, int]]]) -> list[tuple[list[int], list[int]]]:
        """Each example is (text or token id, trains) pieces; all texts are encoded in one batch."""
        texts = [p for ex in examples for p, _ in ex if isinstance(p, str)]
        encoded = iter(self.tok.encode_batch(texts))
        out = []
        for ex in examples:
            ids: list[int] = []
            mask: list[int] = []
            for piece, trains in ex:
                part = next(encoded) if isinstance(piece, str) else [piece]
                ids += part
                mask += [trains] * len(part)
            out.append((ids, mask))
        return out

    def _apply(self, messages: list[dict], where: str, bounded: bool = True, **kwargs):
        """transformers' apply_chat_template of one record; `bounded`: in at most RENDER_HEADROOM_BYTES
        more memory (a tokenizing call is not: the Rust tokenizer aborts the process where Python would
        raise MemoryError, so its text is rendered bounded first)."""
        try:
            with memory_headroom(RENDER_HEADROOM_BYTES if bounded else None):
                return self.hf.apply_chat_template(messages, **kwargs)
        except MemoryError:
            raise ConfigError(f"data prepare: {where}: the chat template needs more than {RENDER_HEADROOM_BYTES >> 30} "
                              "GiB to render one record; a template that repeats text (e.g. 'x' * N, a filter's width, "
                              "a loop over range()) is not a chat format. Use the model's released template.") from None
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, SecurityError, raise_exception in a template
            raise ConfigError(f"data prepare: {where}: the chat template does not render ({type(e).__name__}: "
                              f"{str(e)[:300]}).") from None

    def _render(self, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
        """The record as the template writes it, bounded in memory and in length."""
        text = self._apply(messages, where, tokenize=False, add_generation_prompt=generation_prompt)
        given = sum(len(str(m.get("content") or "")) for m in messages)
        if len(text) > 4 * given + RENDER_SLACK_CHARS:
            raise ConfigError(f"data prepare: {where}: the chat template renders {len(text):,} characters from "
                              f"messages of {given:,}; a chat format adds markers around the messages, not more than "
                              f"{RENDER_SLACK_CHARS:,} characters beyond 4x them. Use the model's released template.")
        return text

    def _templated(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        if self._generation:  # the template marks assistant text with {% generation %}: transformers' own mask
            self._render(messages, where)  # the text, bounded, before the tokenizing call renders it again
            out = self._apply(messages, where, bounded=False, return_dict=True, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), list(out["assistant_masks"])
        full, spans = self._render(messages, where), []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], where, generation_prompt=True) if i else ""
            upto = self._render(messages[:i + 1], where)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ConfigError(
                    f"data prepare: {where}: the chat template renders turn {i} differently once later turns follow "
                    "(e.g. it drops reasoning from past turns), so the assistant's tokens cannot be found by rendering "
                    "prefixes. Give one assistant turn per record, or mark the assistant's text in the template with "
                    "{% generation %} ... {% endgeneration %} (transformers' assistant mask).")
            spans.append((len(before), len(upto)))
        enc = self.hf.backend_tokenizer.encode(full, add_special_tokens=False)
        return list(enc.ids), _span_mask(enc.offsets, spans)


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token overlapping an assistant span (transformers' rule for its assistant mask)."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def _instruct_pieces(prompt: str, completion: str, end) -> list[tuple[str | int, int]]:
    pieces: list[tuple[str | int, int]] = [(prompt, 0)] if prompt else []
    pieces.append((completion, 1))
    if end is not None and end != "\n":
        pieces.append((end, 1))
    return pieces


def _default_pieces(messages: list[dict], end) -> list[tuple[str | int, int]]:
    pieces: list[tuple[str | int, int]] = []
    for m in messages:
        before, after = DEFAULT_TEMPLATE[m["role"]]
        trains = int(m["role"] == "assistant")
        pieces += [(before, 0), (m["content"], trains)]
        if trains and end is not None:
            pieces.append((end, 1))
        if after:
            pieces.append((after, 0))
    return [(p, t) for p, t in pieces if p != ""]


def default_prompt(messages: Iterable[dict], eos: str = "") -> str:
    """DEFAULT_TEMPLATE's text of `messages` followed by the start of the assistant's answer: the
    prompt to generate from with a model fine-tuned on default-rendered chats. `eos`: the EOS
    token's text, which ends earlier assistant turns (training put the token there)."""
    text = ""
    for m in messages:
        before, after = DEFAULT_TEMPLATE[m["role"]]
        text += before + m["content"] + (eos if m["role"] == "assistant" else "") + after
    return text + DEFAULT_TEMPLATE["assistant"][0]


@contextmanager
def memory_headroom(nbytes: int | None) -> Iterator[None]:
    """While the block runs, this process may grow its data by at most `nbytes` (Linux: the soft
    RLIMIT_DATA set to the current VmData + `nbytes`, then restored): an allocation past it raises
    MemoryError in the block instead of exhausting the host. Elsewhere, under a tighter limit
    already, or with `nbytes` None, nothing changes."""
    if nbytes is None:
        yield
        return
    try:
        import resource

        with open("/proc/self/status") as f:
            used = int(re.search(r"VmData:\s+(\d+) kB", f.read()).group(1)) * 1024  # type: ignore[union-attr]
    except (ImportError, OSError, AttributeError):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = used + nbytes if hard == resource.RLIM_INFINITY else min(used + nbytes, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield
        return
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
