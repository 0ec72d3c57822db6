"""Import config: a DeepSpeed, Accelerate, Megatron-LM or torchtitan file becomes the spec being edited.

A file picker beside Load. An import that would change a setting of the spec being edited asks
first: every setting it would replace (old -> new) and the keys that have no counterpart are listed
under the header, one per line, as `workbench import` prints them (workbench/interop,
docs/interop.md), with "Apply import" and "Keep my spec"; nothing changes until Apply.
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
    """The "Import config" button; `.widget` to display beside Load, `.confirm` (Apply / Keep, shown
    while an import waits to be applied) under the message.

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
        self.replaced: list[str] = []  # what the last import changed (or would change): "key: old -> new"
        self.pending: tuple | None = None  # (spec, text of its note) while the import waits for Apply
        self.upload.observe(lambda ch: self._uploaded(ch["new"]), names="value")
        self.apply_button = w.Button(description="Apply import", icon="check", button_style="warning",
                                     layout=w.Layout(width="auto"))
        self.keep_button = w.Button(description="Keep my spec", icon="times", layout=w.Layout(width="auto"))
        self.apply_button.on_click(lambda _: self.apply())
        self.keep_button.on_click(lambda _: self.keep())
        self.confirm = w.HBox([self.apply_button, self.keep_button],
                              layout=w.Layout(display="none", grid_gap="8px", flex_flow="row wrap"))
        self.confirm.add_class("wb-import-confirm")
        self.widget = self.upload

    def load(self, filename: str, content: bytes) -> tuple[JobSpec, str, list[str]]:
        """Read an engine config as a spec and list what it would replace in the spec being edited
        (`replaced`); nothing is changed. Returns (spec, engine, warnings); raises ConfigError."""
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
        return spec, engine, warnings

    def apply(self) -> None:
        """Make the waiting import the spec being edited."""
        if self.pending is None:
            return
        (spec, text, kind), self.pending = self.pending, None
        self.confirm.layout.display = "none"
        self.state.set_raw(spec.to_dict())
        if self.on_loaded:
            self.on_loaded(spec)
        self.message.value = note_html(text, kind)

    def keep(self) -> None:
        """Drop the waiting import; the spec being edited stays as it is."""
        if self.pending is None:
            return
        name, self.pending = self.pending[0].name, None
        self.confirm.layout.display = "none"
        self.message.value = note_html(f"Import of {name} dropped: the spec being edited is unchanged.", "info")

    def _uploaded(self, files) -> None:
        if not files:
            return
        name = files[0]["name"]
        self.pending, self.confirm.layout.display = None, "none"  # a new pick replaces a waiting one
        try:
            spec, engine, warnings = self.load(name, files[0]["content"])
        except ConfigError as e:
            self.message.value = note_html(str(e), "error")
            return
        finally:
            self.upload.value = ()  # so that picking the same file again imports it again
        listed = "\n".join(self.replaced[:_MAX_SHOWN]) + (
            f"\n… and {len(self.replaced) - _MAX_SHOWN} more" if len(self.replaced) > _MAX_SHOWN else "")
        rest = ""
        if any("'auto'" in line for line in warnings):
            rest += (" 'auto' values are filled in by the Hugging Face Trainer at launch; the spec's own values "
                     "(shown in the form) stand in for them.")
        if warnings:
            rest += f" {len(warnings)} key(s) not mapped:\n" + "\n".join(warnings)

        def changes(verb: str) -> str:
            return f" {verb} {len(self.replaced)} setting(s) of the spec being edited:\n{listed}\n" if self.replaced \
                else ""

        self.pending = (spec, f"Imported {name} ({engine}) as {spec.name}." + changes("It replaced") + rest,
                        "info" if warnings else "ok")
        if not self.replaced:  # nothing of the spec being edited changes: nothing to ask
            self.apply()
            return
        self.confirm.layout.display = ""
        self.message.value = note_html(f"{name} ({engine}) is read; nothing is changed until Apply import." +
                                       changes("It would replace") + rest, "warning")

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
