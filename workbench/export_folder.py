"""An export's folder, written whole or not at all: `workbench export --to hf DIR` replaces only a
new, empty or earlier export's folder (files it did not write could stay beside the model, and
loaders prefer a stale index over model.safetensors), writes beside it under a hidden name and
renames into place, so a reader sees the old export or the new one, never a mix or a torn file."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workbench.errors import ConfigError

# What an export writes (transformers versions differ in the tokenizer's side files). A folder
# holding only these is an earlier export, which a new one replaces whole.
EXPORT_FILES = frozenset({"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                          "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})


def export_target(out_dir: str) -> Path:
    """The real folder an export replaces (symlinks followed); its parent exists afterwards.

    Raises:
        ConfigError: `out_dir` is a file, holds files an export does not write (they would stay
            beside the new model, and a loader may prefer them: an index over model.safetensors),
            or its parent cannot be created.
    """
    target = Path(os.path.realpath(Path(out_dir).expanduser()))
    if target.exists() and not target.is_dir():
        raise ConfigError(f"export --to hf {out_dir}: that is a file, but an export is a folder (config.json, "
                          "model.safetensors). Give a new or empty folder, or an earlier export's folder to replace.")
    if target.is_dir():
        foreign = sorted(entry.name for entry in os.scandir(target)
                         if entry.name not in EXPORT_FILES or not entry.is_file(follow_symlinks=False))
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConfigError(f"export --to hf {out_dir}: the folder holds files an export does not write ({shown}). "
                              "They would stay beside the exported model, and loaders may read them instead (an "
                              "index or other weight shards win over model.safetensors). Nothing was written. Export "
                              "into a new or empty folder, or remove those files first.")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"export --to hf {out_dir}: cannot create the folder {target.parent} "
                          f"({e.strerror or e}). Give a folder you can write to.") from None
    return target


@contextmanager
def written_whole(target: Path, out_dir: str) -> Iterator[Path]:
    """A new hidden folder beside `target` (`export_target`) to write the export into; when the block
    ends, it replaces `target` by a rename (same file system: atomic), or is removed and `target`
    stays as it was.

    Raises:
        ConfigError: the folder cannot be created or written (the OSError's reason, and that
            `out_dir` is unchanged).
    """
    import secrets

    staging = target.parent / f".{target.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        staging.mkdir()  # the umask's permissions, as a plain mkdir of out_dir would have
        yield staging
        _swap_into_place(staging, target)
    except OSError as e:
        raise ConfigError(f"export --to hf {out_dir}: writing failed ({e.strerror or e}); {out_dir} was left as it "
                          "was. Free space or fix permissions, then export again.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename the written folder to `target`; an earlier export there is moved aside first and
    removed after (put back if the rename fails)."""
    if not target.exists():
        os.rename(staging, target)
        return
    old = staging.with_name(staging.name.replace(".export-", ".replaced-", 1))
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
