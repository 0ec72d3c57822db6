"""Dispatch panel: send the same spec to a Ray cluster or a cloud, or show the exact request first.

Each backend's settings are a form built from its spec section (`backend.<name>`), so every
backend keeps its own values and no setting can make the job invalid. "Show request" is the
backend's dry run (no credentials, no network); after "Submit" a poller thread refreshes the
job's status and log tail until it is done. Every failure is shown in the panel.
"""
from __future__ import annotations

import html
import json
import tempfile
import threading
import time

import ipywidgets as w

from workbench.errors import ConfigError
from workbench.spec import BackendSpec
from workbench.ui.live import labeled, note_html
from workbench.ui.state import WorkbenchState, apply_overrides

BACKENDS = [("local (Ray on this machine)", "local"), ("Ray cluster", "ray"), ("SageMaker", "sagemaker"),
            ("Vertex AI", "vertex"), ("Azure ML", "azureml")]
CLOUDS = {"sagemaker": "aws", "vertex": "gcp", "azureml": "azure"}  # backend -> price table's cloud
_FIELD = w.Layout(width="auto", flex="1 1 240px", min_width="160px", max_width="460px")
_LABEL = "130px"


class DispatchPanel:
    """Backend choice and its settings form, dry run, submit, status and logs; `.widget` to display."""

    def __init__(self, state: WorkbenchState, poll_s: float = 5.0):
        self.state = state
        self.poll_s = poll_s
        self.handle = None
        self._syncing = False
        self._no_code: str | None = None  # an empty folder: the code root of a job without a factory
        self._request_for: str | None = None  # the spec (as JSON) the request on screen was made for
        self._spot_pending = False  # spot ticked, not yet in the spec: it still needs a checkpoint interval
        self.backend = w.Dropdown(options=BACKENDS, layout=_FIELD)
        self.backend.add_class("wb-dispatch-backend")
        self.spot = w.Checkbox(description="spot / preemptible (checkpoints and resumes)", indent=False,
                               layout=w.Layout(width="auto"), style={"description_width": "initial"})
        self.spot.add_class("wb-dispatch-spot")
        self.spot_note = w.HTML()  # right under the box: what spot still needs (the job stays valid meanwhile)
        self.spot_note.add_class("wb-spot-note")
        self.field_errors = w.HTML()  # a setting that is not accepted (e.g. a malformed URL), under the form
        self.field_errors.add_class("wb-dispatch-field-error")
        self.ckpt_uri = w.Text(placeholder="s3://bucket/path, gs://…, az://…, or a local path", layout=_FIELD,
                               continuous_update=False)
        self.ckpt_uri.add_class("wb-checkpoint-uri")
        self.ckpt_every = w.IntText(layout=w.Layout(width="120px"))
        self.ckpt_every.add_class("wb-checkpoint-every")
        # One form per backend, from its spec section: {backend: {field: Text}}
        self.forms: dict[str, dict[str, w.Text]] = {name: _fields(name) for name in ("ray", *CLOUDS)}
        self.form_boxes = {name: w.VBox([labeled(t, k.replace("_", " "), _LABEL) for k, t in fields.items()])
                           for name, fields in self.forms.items()}
        self.settings = w.VBox()
        self.show_button = w.Button(description="Show request", icon="eye", layout=w.Layout(width="140px"))
        self.submit_button = w.Button(description="Submit", icon="cloud-upload", button_style="primary",
                                      layout=w.Layout(width="140px"))
        self.cancel_button = w.Button(description="Cancel job", icon="stop", disabled=True,
                                      layout=w.Layout(width="140px"))
        self.note = w.HTML()
        self.note.add_class("wb-dispatch-note")
        self.summary = w.HTML()
        self.request = w.HTML()
        self.status = w.HTML()
        self.logs = w.Textarea(disabled=True, placeholder="log tail", layout=w.Layout(width="auto", height="160px"))
        self.show_button.on_click(lambda _: self.show_request())
        self.submit_button.on_click(lambda _: self.submit())
        self.cancel_button.on_click(lambda _: self.cancel())
        for widget in (self.backend, self.spot, self.ckpt_uri, self.ckpt_every):
            widget.observe(lambda _: self._on_change(), names="value")
        for fields in self.forms.values():
            for text in fields.values():
                text.observe(lambda _: self._on_change(), names="value")
        self.widget = w.VBox([
            labeled(self.backend, "backend", _LABEL), self.settings, self.field_errors,
            labeled(self.spot, "capacity", _LABEL), self.spot_note,
            labeled(self.ckpt_uri, "checkpoint URI", _LABEL), labeled(self.ckpt_every, "every N steps", _LABEL),
            w.HBox([self.show_button, self.submit_button, self.cancel_button],
                   layout=w.Layout(flex_flow="row wrap", grid_gap="4px")),
            self.note, self.status, self.summary, self.request, self.logs], layout=w.Layout(max_width="100%"))
        state.observe(lambda topic: self.sync() if topic == "spec" else None)
        self.sync()

    # -- state <-> widgets ---------------------------------------------------------------
    def sync(self) -> None:
        """Show the state's backend settings; a field being edited keeps its text."""
        raw = self.state.raw
        backend = raw.get("backend") or {}
        name = backend.get("name", "local")
        ckpt = raw.get("checkpoint") or {}
        self._syncing = True
        try:
            _set(self.backend, name)
            _set(self.spot, bool(backend.get("spot", False)) or self._spot_pending)
            _set(self.ckpt_uri, ckpt.get("uri") or "")
            _set(self.ckpt_every, int(ckpt.get("every_steps", 0) or 0))
            for section, fields in self.forms.items():
                values = backend.get(section) or {}
                for key, text in fields.items():
                    value = values.get(key)
                    # a default stays a placeholder: typing must not append to it (#34)
                    _set(text, "" if value is None or str(value) == text.placeholder else str(value))
        finally:
            self._syncing = False
        self.settings.children = [self.form_boxes[name]] if name in self.forms else []
        self._drop_stale_request()

    def _drop_stale_request(self) -> None:
        """The dry run on screen goes (and cannot be copied) as soon as the spec it was made for changes:
        the layout, the GPUs, an imported or loaded config, any setting (#34)."""
        if self._request_for is not None and self._request_for != _key(self.state.raw):
            self._request_for = None
            self.summary.value = self.request.value = ""
            self.note.value = note_html("The spec changed since the request was shown: press Show request "
                                        "again for the request of the spec as it is now.", "info")

    def _on_change(self) -> None:
        if self._syncing:
            return
        name = self.backend.value
        overrides = {"backend.name": name, "backend.spot": self.spot.value,
                     "checkpoint.uri": self.ckpt_uri.value.strip() or None,
                     "checkpoint.every_steps": max(0, self.ckpt_every.value)}
        problems = []
        for section, fields in self.forms.items():  # every backend keeps its own values
            for key, text in fields.items():
                value = text.value.strip() or None
                problem = _url_problem(value) if value and key == "address" else None
                if problem:  # not written: the spec keeps the last accepted value
                    problems.append(f"backend.{section}.{key} {value!r} is not accepted: {problem}")
                    continue
                overrides[f"backend.{section}.{key}"] = value
        self.field_errors.value = note_html("\n".join(problems), "error") if problems else ""
        self.settings.children = [self.form_boxes[name]] if name in self.forms else []
        self.note.value = self.summary.value = self.request.value = ""  # they described other settings
        self._request_for = None
        self._spot_pending = False
        if self.spot.value and _refused(self.state.raw, overrides, "spot"):
            # Spot without a checkpoint interval would make the whole job invalid: the job keeps
            # on-demand capacity and the box says what spot still needs, in this panel's terms (#34).
            overrides["backend.spot"] = False
            self._spot_pending = True
        self.spot_note.value = note_html(
            "Spot needs periodic checkpoints, or a preemption loses the whole run: set 'every N steps' below "
            "(e.g. 100) and a checkpoint URI. Until then the job stays on on-demand capacity.", "error") \
            if self._spot_pending else ""
        self.state.update(overrides)

    # -- actions -------------------------------------------------------------------------
    def _dispatch(self, dry_run: bool):
        """backends.dispatch with every failure turned into a note in this panel."""
        st = self.state
        if st.spec is None:
            self.note.value = note_html("Fix the job first: " + (st.error or "invalid spec"), "error")
            return None
        try:
            from backends import dispatch

            return dispatch(st.spec, backend=self.backend.value, dry_run=dry_run, root=self._code_root(st.spec))
        except ConfigError as e:
            self.note.value = note_html(str(e), "error")
        except ImportError as e:
            missing = getattr(e, "name", None) or str(e)
            self.note.value = note_html(
                f"The {self.backend.value} backend needs {missing!s}, which is not installed here. "
                "Install the matching extra: pip install 'workbench[aws]' / '[gcp]' / '[azure]'.", "error")
        except Exception as e:  # noqa: BLE001 - credentials, network, the cloud's refusal: the user must see it
            self.note.value = note_html(f"{self.backend.value} refused the job: {type(e).__name__}: {e}", "error")
        return None

    def _code_root(self, spec) -> str:
        """The directory whose files the remote job gets: the factory's project, else an empty one
        (the workbench packages, the spec and the requirements always go), never the notebook's folder."""
        root = _factory_root(spec.model.factory) if spec.model.factory else None
        if root is None:
            self._no_code = self._no_code or tempfile.mkdtemp(prefix="workbench-no-code-")
        return root or self._no_code

    def show_request(self) -> None:
        """Show the backend's exact request (dry run: no credentials, no network)."""
        out = self._dispatch(dry_run=True)
        if out is None:
            self.summary.value = self.request.value = ""
            return
        self.note.value = note_html(f"Dry run for {out['backend']}: nothing was sent.", "ok")
        self._request_for = _key(self.state.raw)
        self.summary.value = _summary_html(self.state.spec, out["backend"])
        body = json.dumps(out, indent=2, default=str)
        self.request.value = (
            "<button class='wb-copy' style='margin:2px 0' onclick=\"navigator.clipboard.writeText("
            "this.nextElementSibling.innerText)\">Copy request</button>"
            f"<pre class='wb-request' style='max-height:320px;overflow:auto;background:var(--jp-layout-color2, #f7f7f7);color:var(--jp-content-font-color1, #222);"
            f"padding:8px;font-size:12px;white-space:pre'>{html.escape(body)}</pre>")

    def submit(self) -> None:
        self.submit_button.disabled = True
        self.note.value = note_html(f"Submitting to {self.backend.value}…", "info")
        try:
            handle = self._dispatch(dry_run=False)
        finally:
            self.submit_button.disabled = False
        if handle is None:
            return
        self.handle = handle
        self.submit_button.disabled, self.cancel_button.disabled = True, False
        self.note.value = note_html(f"Submitted {handle.job_id} to {self.backend.value}.", "ok")
        threading.Thread(target=self._poll, args=(handle,), name="workbench-ui-dispatch", daemon=True).start()

    def cancel(self) -> None:
        if self.handle is not None:
            try:
                self.handle.cancel()
            except Exception as e:  # noqa: BLE001 - shown, not raised into the kernel
                self.note.value = note_html(f"Cancel failed: {type(e).__name__}: {e}", "error")
                return
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


def _fields(section: str) -> dict[str, w.Text]:
    """One text field per key of `backend.<section>`, its default as the placeholder."""
    model = BackendSpec.model_fields[section].annotation
    out = {}
    for key, field in model.model_fields.items():
        text = w.Text(placeholder=str(field.default) if field.default is not None else "", layout=_FIELD,
                      tooltip=field.description, continuous_update=False)
        text.add_class(f"wb-{section}-{key}")
        out[key] = text
    return out


def _refused(raw: dict, overrides: dict, word: str) -> bool:
    """True when `raw` with `overrides` is refused by load_spec for a reason that names `word`."""
    from workbench.spec import load_spec

    try:
        load_spec(apply_overrides(raw, overrides))
    except ConfigError as e:
        return word in str(e)
    except Exception:  # noqa: BLE001 - any other refusal is the form's to show
        return False
    return False


def _url_problem(text: str) -> str | None:
    """Why `text` is not an http(s):// or ray:// address with a host (None: it is one)."""
    from urllib.parse import urlsplit

    if any(c.isspace() for c in text):
        return "it contains a space. Give one address, e.g. http://ray-head.internal:8265"
    if text.count("://") != 1:
        return "it holds more than one address (or none). Give one, e.g. http://ray-head.internal:8265"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        return f"{e}. Give host:port, e.g. http://ray-head.internal:8265"
    if parts.scheme not in ("http", "https", "ray"):
        return f"the scheme {parts.scheme!r} is not http, https or ray. E.g. http://ray-head.internal:8265"
    if not parts.hostname:
        return "it names no host. E.g. http://ray-head.internal:8265"
    del port
    return None


def _key(raw: dict) -> str:
    return json.dumps(raw, sort_keys=True, default=str)


def _set(widget, value) -> None:
    if widget.value != value:
        widget.value = value


def _factory_root(factory: str) -> str | None:
    """The folder holding the factory's top-level module or package ("pkg.mod:fn" -> pkg's parent)."""
    import importlib.util
    from pathlib import Path

    found = importlib.util.find_spec(factory.partition(":")[0].split(".")[0])
    if found is None or not found.origin:
        return None
    origin = Path(found.origin)
    return str(origin.parent.parent if origin.name == "__init__.py" else origin.parent)


def _summary_html(spec, backend: str) -> str:
    """Instance, GPUs, spot, price per hour and checkpoint URI of the request, above it."""
    res, nodes = spec.resources, spec.resources.nodes
    rows = [("GPUs", f"{nodes} × {res.gpus_per_node} {res.gpu}"), ("spot", "yes" if spec.backend.spot else "no")]
    if backend in CLOUDS:
        rows.insert(0, ("instance", f"{_instance(spec, backend)} × {nodes}"))
        rows.append(("price / h", _price(spec, backend)))
    rows.append(("checkpoint URI", spec.checkpoint.uri or f"(default) <bucket>/workbench/{spec.name}/checkpoints/"))
    cells = "".join(f"<tr><th style='text-align:left;padding-right:12px'>{k}</th><td>{html.escape(str(v))}</td></tr>"
                    for k, v in rows)
    return f"<table class='wb-request-summary' style='font-size:13px;margin:4px 0'>{cells}</table>"


def _instance(spec, backend: str) -> str:
    from backends import instances

    res = spec.resources
    try:
        if backend == "sagemaker":
            return spec.backend.sagemaker.instance_type or instances.sagemaker_instance(res.gpu, res.gpus_per_node,
                                                                                       res.nodes)
        if backend == "vertex":
            return spec.backend.vertex.machine_type or instances.vertex_machine(res.gpu, res.gpus_per_node,
                                                                               res.nodes).machine_type
        return instances.azure_vm_size(res.gpu, res.gpus_per_node, res.nodes)
    except ConfigError:
        return "?"


def _price(spec, backend: str) -> str:
    from workbench.prices import PRICES_DATE, load_prices

    price = load_prices().get(spec.resources.gpu, {}).get(CLOUDS[backend])
    if price is None:
        return "not in the price table"
    per_gpu = price.spot if spec.backend.spot else price.on_demand
    kind = "spot" if spec.backend.spot else "on demand"
    return f"${per_gpu * spec.resources.num_gpus:,.2f} ({kind}, list price of {PRICES_DATE})"
