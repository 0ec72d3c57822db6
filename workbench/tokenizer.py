"""Tokenizers for token shards: byte-level, a BPE trained offline on the corpus, or a local
tokenizer.json. One small interface (encode_batch, decode, vocab_size, eos_id) over all three.

The tokenizer travels with the shards (`tokenizer.json` next to the index) and with exported
models, so `workbench sample` decodes with exactly what the run trained on.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from workbench.errors import ConfigError

EOS = "<|endoftext|>"
BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; documents are joined without a separator (no EOS)."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    eos_id = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


EOS_ALIASES = ("<|end_of_text|>", "</s>", "<eos>")  # a tokenizer.json's end of document when it has no EOS


class HFTokenizer:
    """A `tokenizers.Tokenizer` (a trained BPE or any local tokenizer.json).

    `hf`: transformers' tokenizer when it came from a model folder (special tokens, chat template)."""

    def __init__(self, tok, kind: str, hf=None):
        self.tok, self.kind, self.hf = tok, kind, hf
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # the end-of-document token under its usual names (GPT-2, Llama 3, Llama 2 / Mistral, Gemma)
        self.eos_id = next((i for name in (EOS, *EOS_ALIASES) if (i := tok.token_to_id(name)) is not None), None)
        if self.eos_id is None and hf is not None:
            self.eos_id = hf.eos_token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips the character offsets, which shards do not keep.
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def to_str(self) -> str:
        return self.tok.to_str()


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on `texts` with the tokenizers library, offline.

    Raises:
        ConfigError: vocab_size below the 256 byte tokens + EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < BYTE_VOCAB + 1:
        raise ConfigError(f"tokenizer vocab_size={vocab_size}: a byte-level BPE needs at least 257 tokens "
                          "(256 bytes + <|endoftext|>). Use e.g. --vocab-size 2048, or --tokenizer bytes.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tok.train_from_iterator(texts, trainer=trainer)
    except (ConfigError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust panic arrives as pyo3's PanicException (a BaseException)
        raise ConfigError(f"tokenizer: training the BPE failed ({type(e).__name__}: {str(e)[:300]}). Try a smaller "
                          "--vocab-size, or --tokenizer bytes.") from None
    return HFTokenizer(tok, "bpe")


def tokenizer_from_str(text: str, kind: str = "json") -> HFTokenizer:
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_str(text), kind)


MAX_TOKENIZER_CHARS = 64 << 20  # a tokenizer.json is read whole by `tokenizers`: bound it first


def load_tokenizer_file(path: str) -> HFTokenizer:
    """A local (or fsspec) tokenizer.json. Raises ConfigError if it is missing or not one."""
    import fsspec

    try:
        fs, inner = fsspec.core.url_to_fs(path)
        kind = fs.info(inner).get("type")
        if kind != "file":  # a FIFO would block the open forever, a device never end
            raise ConfigError(f"tokenizer {path!r} is not a regular file (but a folder, pipe or device). Give "
                              "'bpe', 'bytes', a tokenizer.json or a Hugging Face model folder.")
        with fsspec.open(path, "r") as f:
            text = f.read(MAX_TOKENIZER_CHARS + 1)
        if len(text) > MAX_TOKENIZER_CHARS:
            raise ConfigError(f"tokenizer {path!r} is over {MAX_TOKENIZER_CHARS >> 20} Mi characters; released "
                              "tokenizer.json files are under 20 MiB (Llama 3's: 9 MiB). Give a tokenizers tokenizer.json.")
        return tokenizer_from_str(text)
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"tokenizer {path!r} does not exist. Give 'bpe', 'bytes' or the path of a tokenizer.json.") from None
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions on bad JSON
        raise ConfigError(f"tokenizer {path!r} is not a tokenizers tokenizer.json ({e}).") from None


def build_tokenizer(name: str, texts: Iterator[str] | None = None, vocab_size: int = 4096):
    """Tokenizer `name`: "bytes", "bpe" (trained on `texts`), a tokenizer.json path, or a local
    Hugging Face model folder (its tokenizer.json with its special tokens and chat template)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "bpe":
        return train_bpe(texts or iter(()), vocab_size)
    from pathlib import Path

    if "://" not in name and Path(name).is_dir():
        hf = load_hf_tokenizer(name)
        return HFTokenizer(hf.backend_tokenizer, "json", hf=hf)
    return load_tokenizer_file(name)


MAX_CONFIG_BYTES = 16 << 20  # tokenizer_config.json / chat_template.jinja: released ones are < 1 MiB
MAX_TOKENIZER_BYTES = 256 << 20  # a tokenizer.json's bytes (Llama 3's: 9 MiB)

def load_hf_tokenizer(folder: str):
    """transformers' PreTrainedTokenizerFast from a local model folder (tokenizer.json +
    tokenizer_config.json, and chat_template.jinja where newer transformers put the template).
    Its own class, never the folder's code; every file bounded before transformers reads it."""
    from pathlib import Path

    root = Path(folder)
    if not (root / "tokenizer.json").is_file():
        raise ConfigError(f"tokenizer {folder!r} is a folder without tokenizer.json. Give a Hugging Face model folder "
                          "with a fast tokenizer (tokenizer.json), or the path of a tokenizer.json.")
    for name, bound in (("tokenizer.json", MAX_TOKENIZER_BYTES), ("tokenizer_config.json", MAX_CONFIG_BYTES),
                        ("chat_template.jinja", MAX_CONFIG_BYTES), ("special_tokens_map.json", MAX_CONFIG_BYTES)):
        f = root / name
        if f.exists() and (not f.is_file() or f.stat().st_size > bound):
            raise ConfigError(f"tokenizer {folder!r}: {name} is not a file of at most {bound >> 20} MiB; released ones "
                              "are far smaller. Is this a Hugging Face model folder?")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("a tokenizer folder needs transformers: pip install 'workbench[hf]'.") from None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/JSONDecodeError on a bad folder
        raise ConfigError(f"tokenizer {folder!r}: transformers cannot load it ({type(e).__name__}: {str(e)[:300]}).") from None
