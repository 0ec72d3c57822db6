"""Import config: a DeepSpeed, Accelerate, Megatron-LM or torchtitan file becomes the spec being edited.

A file picker beside Load; what the import replaced in the spec being edited (every setting that
changed, old -> new) and the keys that have no counterpart are listed under the header, one per
line, as `workbench import` prints them (workbench/interop, docs/interop.md).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ipywidgets as w

from workbench.errors import ConfigError
from workbench.spec import JobSpec
from workbench.ui.live import note_html
from workbench.ui.state import WorkbenchState


class ImportConfig:
    """The "Import config" button; `.widget` to display.

    Args:
        state: the state whose spec the imported config replaces.
        message: where the result (or the ConfigError) is shown.
        on_loaded: called with the imported JobSpec (e.g. to show its name).
    """

    def __init__(self, state: WorkbenchState, message: w.HTML, on_loaded: Callable[[JobSpec], None] | None = None):
        self.state, self.message, self.on_loaded = state, message, on_loaded
        self.upload = w.FileUpload(description="Import config", accept=".json,.yaml,.yml,.toml,.sh,.txt",
                                   multiple=False, layout=w.Layout(width="150px"))
        self.upload.add_class("wb-import-config")  # app.py's CSS hides the widget's file count "(0)"
        self.replaced: list[str] = []  # what the last import changed: "key: old -> new"
        self.upload.observe(lambda ch: self._uploaded(ch["new"]), names="value")
        self.widget = self.upload

    def load(self, filename: str, content: bytes) -> tuple[JobSpec, str, list[str]]:
        """Replace the spec with an engine config's. Returns (spec, engine, warnings); raises ConfigError."""
        from workbench.interop import detect_format, import_text

        try:
            text = bytes(content).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{filename}: not a text file; pick a DeepSpeed JSON, Accelerate YAML, "
                              "Megatron-LM command line or torchtitan TOML.") from None
        engine = detect_format(text, filename)
        spec, warnings = import_text(text, engine, name=Path(filename).stem.replace("_", "-") or "job")
        before = self.state.spec.to_dict() if self.state.spec is not None else self.state.raw
        self.replaced = replaced(before, spec.to_dict())
        self.state.set_raw(spec.to_dict())
        if self.on_loaded:
            self.on_loaded(spec)
        return spec, engine, warnings

    def _uploaded(self, files) -> None:
        if not files:
            return
        name = files[0]["name"]
        try:
            spec, engine, warnings = self.load(name, files[0]["content"])
        except ConfigError as e:
            self.message.value = note_html(str(e), "error")
            return
        finally:
            self.upload.value = ()  # so that picking the same file again imports it again
        text = f"Imported {name} ({engine}) as {spec.name}."
        if self.replaced:
            text += f" It replaced {len(self.replaced)} setting(s) of the spec being edited:\n" + "\n".join(
                self.replaced[:_MAX_SHOWN]) + (f"\n… and {len(self.replaced) - _MAX_SHOWN} more"
                                               if len(self.replaced) > _MAX_SHOWN else "")
            text += "\n"
        if any("'auto'" in line for line in warnings):
            text += (" 'auto' values are filled in by the Hugging Face Trainer at launch; the spec's own values "
                     "(shown in the form) stand in for them.")
        if warnings:
            text += f" {len(warnings)} key(s) not mapped:\n" + "\n".join(warnings)
        self.message.value = note_html(text, "info" if warnings else "ok")


_MAX_SHOWN = 20


def replaced(before: dict, after: dict, prefix: str = "") -> list[str]:
    """Every setting that differs between two spec dicts, as "key: old -> new" (dotted keys)."""
    out = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        name = f"{prefix}{key}"
        if isinstance(old, dict) and isinstance(new, dict):
            out += replaced(old, new, name + ".")
        elif old != new and name != "name":
            out.append(f"{name}: {_short(old)} -> {_short(new)}")
    return out


def _short(value) -> str:
    text = "(unset)" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
