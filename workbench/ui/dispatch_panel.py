"""Dispatch panel: send the same spec to a Ray cluster or a cloud, or show the exact request first.

"Show request" is the backend's dry run (no credentials, no network). After "Submit" a poller
thread refreshes the job's status and log tail until it is done.
"""
from __future__ import annotations

import html
import json
import threading
import time

import ipywidgets as w
import yaml

from workbench.errors import ConfigError
from workbench.ui.live import labeled, note_html
from workbench.ui.state import WorkbenchState

BACKENDS = [("local (Ray on this machine)", "local"), ("Ray cluster", "ray"), ("SageMaker", "sagemaker"),
            ("Vertex AI", "vertex"), ("Azure ML", "azureml")]
_WIDE = w.Layout(width="420px")


class DispatchPanel:
    """Backend choice and settings, dry run, submit, status and logs; `.widget` to display."""

    def __init__(self, state: WorkbenchState, poll_s: float = 5.0):
        self.state = state
        self.poll_s = poll_s
        self.handle = None
        self._syncing = False
        self.backend = w.Dropdown(options=BACKENDS, layout=_WIDE)
        self.address = w.Text(placeholder="http://head-node:8265", layout=_WIDE)
        self.spot = w.Checkbox(description="spot / preemptible capacity (checkpoints and resumes)", indent=False)
        self.ckpt_uri = w.Text(placeholder="s3://bucket/path, gs://…, az://…, or a local path", layout=_WIDE)
        self.ckpt_every = w.BoundedIntText(min=0, max=10**7, layout=w.Layout(width="120px"))
        self.settings = w.Textarea(layout=w.Layout(width="420px", height="110px"))
        self.show_button = w.Button(description="Show request", icon="eye", layout=w.Layout(width="140px"))
        self.submit_button = w.Button(description="Submit", icon="cloud-upload", button_style="primary",
                                      layout=w.Layout(width="140px"))
        self.cancel_button = w.Button(description="Cancel job", icon="stop", disabled=True,
                                      layout=w.Layout(width="140px"))
        self.note = w.HTML()
        self.request = w.HTML()
        self.status = w.HTML()
        self.logs = w.Textarea(disabled=True, placeholder="log tail", layout=w.Layout(width="100%", height="160px"))
        self.show_button.on_click(lambda _: self.show_request())
        self.submit_button.on_click(lambda _: self.submit())
        self.cancel_button.on_click(lambda _: self.cancel())
        for widget in (self.backend, self.address, self.spot, self.ckpt_uri, self.ckpt_every):
            widget.observe(lambda _: self._on_change(), names="value")
        self.settings.observe(lambda _: self._on_change(), names="value")
        self.settings_row = labeled(self.settings, "settings (YAML)", "130px")
        self.address_row = labeled(self.address, "Ray address", "130px")
        self.widget = w.VBox([
            labeled(self.backend, "backend", "130px"), self.address_row, self.settings_row,
            labeled(self.spot, "capacity", "130px"), labeled(self.ckpt_uri, "checkpoint URI", "130px"),
            labeled(self.ckpt_every, "every N steps", "130px"),
            w.HBox([self.show_button, self.submit_button, self.cancel_button]),
            self.note, self.status, self.request, self.logs])
        state.observe(lambda topic: self.sync() if topic == "spec" else None)
        self.sync()

    # -- state <-> widgets ---------------------------------------------------------------
    def sync(self) -> None:
        raw = self.state.raw
        backend = raw.get("backend") or {}
        name = backend.get("name", "local")
        self._syncing = True
        try:
            self.backend.value = name
            self.address.value = (backend.get("ray") or {}).get("address", "http://127.0.0.1:8265")
            self.spot.value = bool(backend.get("spot", False))
            ckpt = raw.get("checkpoint") or {}
            self.ckpt_uri.value = ckpt.get("uri") or ""
            self.ckpt_every.value = int(ckpt.get("every_steps", 0))
            if name in ("sagemaker", "vertex", "azureml"):
                section = backend.get(name) or {}
                self.settings.value = yaml.safe_dump(section, sort_keys=False) if section else ""
        finally:
            self._syncing = False
        self.address_row.layout.display = "" if name == "ray" else "none"
        self.settings_row.layout.display = "" if name in ("sagemaker", "vertex", "azureml") else "none"
        self.note.value = note_html(self.state.error, "error") if self.state.error else ""

    def _on_change(self) -> None:
        if self._syncing:
            return
        name = self.backend.value
        overrides = {"backend.name": name, "backend.spot": self.spot.value,
                     "checkpoint.uri": self.ckpt_uri.value.strip() or None,
                     "checkpoint.every_steps": self.ckpt_every.value}
        if name == "ray":
            overrides["backend.ray.address"] = self.address.value.strip() or None
        if name in ("sagemaker", "vertex", "azureml"):
            try:
                section = yaml.safe_load(self.settings.value) or {}
            except yaml.YAMLError as e:
                self.note.value = note_html(f"settings: not valid YAML: {e}", "error")
                return
            if not isinstance(section, dict):
                self.note.value = note_html("settings: expected key: value lines, e.g. region: us-east-1", "error")
                return
            overrides[f"backend.{name}"] = section
        self.state.update(overrides)

    # -- actions -------------------------------------------------------------------------
    def _dispatch(self, dry_run: bool):
        """backends.dispatch with every user-fixable failure turned into an inline note."""
        st = self.state
        if st.spec is None:
            self.note.value = note_html(st.error or "invalid spec", "error")
            return None
        try:
            from backends import dispatch

            return dispatch(st.spec, backend=self.backend.value, dry_run=dry_run)
        except ConfigError as e:
            self.note.value = note_html(str(e), "error")
        except ImportError as e:
            missing = getattr(e, "name", None) or str(e)
            self.note.value = note_html(
                f"The {self.backend.value} backend needs {missing!s}, which is not installed here. "
                "Install the matching extra: pip install 'workbench[aws]' / '[gcp]' / '[azure]'.")
        return None

    def show_request(self) -> None:
        """Show the backend's exact request (dry run: no credentials, no network)."""
        out = self._dispatch(dry_run=True)
        if out is None:
            self.request.value = ""
            return
        self.note.value = note_html(f"Dry run for {out['backend']}: nothing was sent.", "ok")
        body = html.escape(json.dumps(out, indent=2, default=str))
        self.request.value = (f"<pre class='wb-request' style='max-height:320px;overflow:auto;background:#f7f7f7;"
                              f"padding:8px;font-size:12px'>{body}</pre>")

    def submit(self) -> None:
        self.submit_button.disabled = True
        handle = self._dispatch(dry_run=False)
        if handle is None:
            self.submit_button.disabled = False
            return
        self.handle = handle
        self.cancel_button.disabled = False
        self.note.value = note_html(f"Submitted {handle.job_id} to {self.backend.value}.", "ok")
        threading.Thread(target=self._poll, args=(handle,), name="workbench-ui-dispatch", daemon=True).start()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.cancel_button.disabled = True

    def _poll(self, handle) -> None:
        while True:
            try:
                st = handle.status()
                self.status.value = (f"<b>{html.escape(handle.job_id)}</b>: {st.state.value}"
                                     + (f" — {html.escape(st.message)}" if st.message else "")
                                     + (f" ({st.interruptions} spot interruption(s))" if st.interruptions else ""))
                self.logs.value = handle.logs(tail=50)
            except Exception as e:  # a flaky status call must not kill the poller; show it and retry
                self.status.value = html.escape(f"status unavailable: {type(e).__name__}: {e}")
                st = None
            if st is not None and st.state.done:
                self.submit_button.disabled = False
                self.cancel_button.disabled = True
                return
            time.sleep(self.poll_s)
