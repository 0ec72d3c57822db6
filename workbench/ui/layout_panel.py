"""Layout panel: model, GPUs and the parallel layout as form widgets bound to the state's spec.

Every edit becomes a dotted-key override of the raw spec; `load_spec` validates it and an
invalid combination shows its ConfigError text under the form (never a traceback).
"""
from __future__ import annotations

import ipywidgets as w

from workbench.catalog import DEVICES
from workbench.parallelism import PIPELINE_SCHEDULES, Parallelism, is_multi_stage
from workbench.spec import JobSpec
from workbench.ui.live import FigureBox, labeled, note_html, section
from workbench.ui.state import WorkbenchState

SHAPE_KEYS = ("layers", "hidden", "heads", "seq_len")
_FIELD = w.Layout(width="150px")


def _get(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


# Where an error is shown: under the first section its text names (the key, or a degree like "dp(2)").
_SECTION_KEYS = {
    "model": ("model.", "model:"), "resources": ("resources.", "GPUs"),
    "layout": ("layout.", "dp(", "tp(", "pp(", "zero"), "train": ("train.", "precision.", "micro_batch"),
    "spec": (),
}


def _section_of(error: str) -> str:
    """The form section an error belongs to: the one whose key appears first in its text."""
    hits = [(error.find(k), name) for name, keys in _SECTION_KEYS.items() for k in keys if k in error]
    return min(hits)[1] if hits else "spec"


def _build_fields(presets: list[str]) -> dict[str, w.ValueWidget]:
    """One widget per dotted spec key the form edits (their values come from `LayoutPanel.sync`)."""
    return {
        "model.preset": w.Dropdown(options=presets, layout=_FIELD),
        **{f"model.{k}": w.IntText(layout=_FIELD) for k in SHAPE_KEYS},
        "resources.gpu": w.Dropdown(options=list(DEVICES), layout=_FIELD),
        "resources.nodes": w.IntText(layout=_FIELD),
        "resources.gpus_per_node": w.IntText(layout=_FIELD),
        "layout.dp": w.IntText(layout=_FIELD),
        "layout.tp": w.IntText(layout=_FIELD),
        "layout.pp": w.IntText(layout=_FIELD),
        "layout.zero": w.ToggleButtons(options=[0, 1, 2, 3], style={"button_width": "34px"}),
        "layout.offload": w.Dropdown(options=["none", "cpu", "nvme"], layout=_FIELD),
        "layout.activation_checkpointing": w.Dropdown(options=["none", "selective", "full"], layout=_FIELD),
        "layout.pp_schedule": w.Dropdown(options=list(PIPELINE_SCHEDULES), layout=_FIELD),
        "layout.virtual_stages": w.IntText(layout=_FIELD, tooltip=(
            "Stages per pipeline rank of interleaved-1f1b and zero-bubble (more: a smaller bubble, "
            "more sends)")),
        "layout.sequence_parallel": w.Checkbox(indent=False, layout=w.Layout(width="auto"), tooltip=(
            "Shard the residual stream, norms and saved inputs along the sequence between tensor-parallel "
            "regions (Megatron-style); needs tp >= 2")),
        "precision.dtype": w.ToggleButtons(options=["fp32", "bf16", "fp16"], style={"button_width": "52px"}),
        "train.micro_batch": w.IntText(layout=_FIELD),
        "train.global_batch": w.IntText(layout=_FIELD),
        "train.steps": w.IntText(layout=_FIELD),
    }


class LayoutPanel:
    """Form for the spec's model, resources, layout, precision and batch; `.widget` to display."""

    def __init__(self, state: WorkbenchState):
        from workbench.shapes import PRESETS

        self.state = state
        self.presets = PRESETS
        self._syncing = False
        self.fields: dict[str, w.ValueWidget] = _build_fields(list(PRESETS) + (["custom"] if "custom" not in PRESETS
                                                                               else []))
        self.follow = w.Checkbox(value=True, description="GPUs = dp × tp × pp", indent=False)
        # A local Hugging Face folder (config.json + safetensors): model.init = "hf", model.path = it;
        # the shape then comes from its config.json (the preset and shape fields show it, read-only).
        self.model_path = w.Text(placeholder="/path/to/model", continuous_update=False, layout=_FIELD,
                                 tooltip="A local Hugging Face model folder (config.json + *.safetensors): "
                                         "the run starts from its weights, the shape comes from its config.json")
        self.model_path.add_class("wb-model-path")
        self._model_before: dict | None = None  # the model section the folder replaced, back when it is cleared
        self.size_note = w.HTML()  # a model given by its size alone (model.params): what the form shows instead
        self.size_note.add_class("wb-model-size")
        self.summary = w.HTML()
        # No bounds on the number fields (they would clamp silently, tp=100 -> 64): load_spec says
        # what is wrong, under the section the error names.
        self.errors = {name: w.HTML() for name in _SECTION_KEYS}
        self.lr_box = FigureBox()  # the spec's learning-rate schedule
        self.lr_box.show(_lr_figure(JobSpec().train))
        for key, field in self.fields.items():
            field.add_class("wb-" + key.replace(".", "-"))  # stable hooks for the browser test and CSS
            field.observe(lambda ch, key=key: self._on_change(key), names="value")
        self.follow.observe(lambda ch: self._on_change("follow"), names="value")
        self.model_path.observe(lambda ch: self._on_folder(), names="value")
        self.shape_rows = {k: labeled(self.fields[f"model.{k}"], k.replace("_", " ")) for k in SHAPE_KEYS}
        self.widget = self._build_widget()
        state.observe(self._on_state)
        self.sync()

    def _build_widget(self) -> w.VBox:
        """The form's sections, each with its error line under it, then the summary and the schedule."""
        f, e = self.fields, self.errors
        return w.VBox([
            e["spec"],
            section("Model", labeled(f["model.preset"], "preset"), self.size_note,
                    *self.shape_rows.values(), labeled(self.model_path, "HF folder"), e["model"]),
            section("GPUs", labeled(f["resources.gpu"], "type"), self.follow,
                    labeled(f["resources.nodes"], "nodes"), labeled(f["resources.gpus_per_node"], "per node"),
                    e["resources"]),
            section("Parallel layout", labeled(f["layout.dp"], "data (dp)"), labeled(f["layout.tp"], "tensor (tp)"),
                    labeled(f["layout.pp"], "pipeline (pp)"), labeled(f["layout.pp_schedule"], "pp schedule"),
                    labeled(f["layout.virtual_stages"], "virtual stages"),
                    labeled(f["layout.sequence_parallel"], "sequence par."),
                    labeled(f["layout.zero"], "ZeRO stage"), labeled(f["layout.offload"], "offload"),
                    labeled(f["layout.activation_checkpointing"], "act. ckpt"), e["layout"]),
            section("Numerics and batch", labeled(f["precision.dtype"], "precision"),
                    labeled(f["train.micro_batch"], "micro-batch"), labeled(f["train.global_batch"], "global batch"),
                    labeled(f["train.steps"], "steps"), e["train"]),
            self.summary, section("Learning rate", self.lr_box),
        ], layout=w.Layout(width="330px", min_width="330px", padding="0 12px 0 0"))

    # -- state -> widgets ------------------------------------------------------------------
    def sync(self) -> None:
        """Show the state's raw spec in the form (defaults filled in) without echoing changes back."""
        raw, defaults = self.state.raw, JobSpec().to_dict()
        self._syncing = True
        try:
            preset = _get(raw, "model.preset")
            base = self.presets.get(preset, {})
            folder = _folder(raw)
            if folder is not None:  # the shape is the folder's config.json (when it resolves)
                base = _folder_shape(self.state.spec)
            if self.model_path.value.strip() != (folder or ""):
                self.model_path.value = folder or ""
            sized = _params_only(raw)
            for key, field in self.fields.items():
                value = _get(raw, key)
                if key == "model.preset":
                    value = preset or "custom"
                elif key.startswith("model.") and sized:
                    continue  # no shape to show: the rows are hidden (_show_status)
                elif key.startswith("model.") and (value is None or folder is not None):
                    value = base.get(key.split(".")[1], field.value if folder is not None else 1)
                elif key == "resources.gpus_per_node" and self.state.spec is not None:
                    value = self.state.spec.resources.gpus_per_node  # derived from the layout when not given
                elif value is None:
                    value = _get(defaults, key)
                if value is not None and (not hasattr(field, "options") or value in field.options):
                    field.value = value
            self._show_status()
        finally:
            self._syncing = False

    def _on_state(self, topic: str) -> None:
        if topic == "spec":
            self.sync()

    def _show_status(self) -> None:
        st = self.state
        where = _section_of(st.error) if st.error else None
        for name, box in self.errors.items():
            box.value = note_html(st.error, "error") if name == where else ""
        self.fields["resources.gpus_per_node"].disabled = self.follow.value
        self.fields["layout.pp_schedule"].disabled = self.fields["layout.pp"].value == 1
        self.fields["layout.virtual_stages"].disabled = (self.fields["layout.pp"].value == 1
                                                         or not is_multi_stage(self.fields["layout.pp_schedule"].value))
        from_folder = _folder(st.raw) is not None
        sized = _params_only(st.raw)
        for row in self.shape_rows.values():
            row.layout.display = "none" if sized else ""
        self.size_note.value = (
            f"<div style='font-size:12px;line-height:1.4;margin:2px 0 4px 0'>Given by its size: "
            f"<b>{_size(float(st.raw['model']['params']))}</b> (model.params): model states only, no "
            "activations, nothing to run. Pick a preset to give it a shape.</div>") if sized else ""
        for k in ("preset", *SHAPE_KEYS):  # a folder's shape is its config.json's (but a shorter seq_len)
            self.fields[f"model.{k}"].disabled = from_folder and k != "seq_len"
        if st.spec is None:
            self.summary.value = ""
            return
        s = st.spec
        lay, res = s.layout, s.resources
        micro = Parallelism.from_spec(s).num_micro
        try:
            n = s.model.shape().num_params() if s.model.params is None else int(s.model.params)
            size = f"{n / 1e9:.2f} B params" if n >= 1e9 else f"{n / 1e6:.2f} M params"
        except Exception:  # a factory model: its size is known only once built
            size = "factory model"
        self.summary.value = (
            f"<div style='font-size:12px;color:var(--jp-content-font-color2, #444);line-height:1.5'>{size}<br>"
            f"{lay.world_size} ranks = dp {lay.dp} × tp {lay.tp} × pp {lay.pp} on "
            f"{res.nodes} × {res.gpus_per_node} {res.gpu}<br>{micro} micro-batch(es) of {s.train.micro_batch} "
            f"per dp rank per step</div>")
        self.lr_box.show(_lr_figure(s.train))

    # -- widgets -> state ------------------------------------------------------------------
    def _on_change(self, key: str) -> None:
        if self._syncing:
            return
        f = self.fields
        if key == "model.preset":
            self._reset_shape()
        overrides: dict = {k: f[k].value for k in f if not k.startswith(("model.", "resources."))}
        overrides["resources.gpu"] = f["resources.gpu"].value
        overrides["resources.nodes"] = f["resources.nodes"].value
        # Without gpus_per_node, load_spec asks for exactly the GPUs the layout needs.
        overrides["resources.gpus_per_node"] = None if self.follow.value else f["resources.gpus_per_node"].value
        if _folder(self.state.raw) is not None:  # the model is the folder's: the form's shape fields are its view
            if key == "model.seq_len" or "seq_len" in self.state.raw["model"]:  # the one shape field it may set
                overrides["model.seq_len"] = f["model.seq_len"].value
            self.state.update(overrides)
            return
        preset = f["model.preset"].value
        if _params_only(self.state.raw) and (key != "model.preset" or preset == "custom"):
            self.state.update(overrides)  # a size, not a shape: the model stays as given (#34)
            return
        base = self.presets.get(preset, {})
        overrides["model.preset"] = None if preset == "custom" else preset
        overrides["model.params"] = None
        for k in SHAPE_KEYS:
            value = f[f"model.{k}"].value
            overrides[f"model.{k}"] = None if base.get(k) == value else value
        self.state.update(overrides)

    def _on_folder(self) -> None:
        """The HF folder field: a folder makes the model that folder's (`model.init: hf`, `model.path`);
        clearing it brings back the model section it replaced. A folder that does not load shows its
        one ConfigError under the Model section, right under this field."""
        if self._syncing:
            return
        folder = self.model_path.value.strip()
        model = dict(self.state.raw.get("model") or {})
        if folder:
            if _folder(self.state.raw) is None:
                self._model_before = model
            self.state.update({"model": {"init": "hf", "path": folder}})
        elif _folder(self.state.raw) is not None:
            before, self._model_before = self._model_before, None
            self.state.update({"model": before or {"preset": self.fields["model.preset"].value}})

    def _reset_shape(self) -> None:
        base = self.presets.get(self.fields["model.preset"].value, {})
        self._syncing = True
        try:
            for k in SHAPE_KEYS:
                if base.get(k) is not None:
                    self.fields[f"model.{k}"].value = base[k]
        finally:
            self._syncing = False


def _params_only(raw: dict) -> bool:
    """The raw spec's model is given by its size alone (`model.params`, no preset, shape or folder;
    a factory beside it counts as sized too: the form cannot show its shape either)."""
    model = raw.get("model") or {}
    return (isinstance(model, dict) and model.get("params") is not None and not model.get("preset")
            and model.get("init") != "hf" and not any(model.get(k) for k in (*SHAPE_KEYS, "vocab")))


def _folder(raw: dict) -> str | None:
    """The HF folder the raw spec's model loads (`model.init: hf`), else None."""
    model = raw.get("model") or {}
    return str(model.get("path") or "") if isinstance(model, dict) and model.get("init") == "hf" else None


def _folder_shape(spec) -> dict:
    """The shape fields of a spec whose model is a folder ({} while it does not resolve)."""
    if spec is None:
        return {}
    try:
        shape = spec.model.shape()
    except Exception:  # noqa: BLE001 - a folder that does not resolve: its error is the form's
        return {}
    return {k: getattr(shape, k, None) for k in SHAPE_KEYS}


def _lr_figure(train):
    from workbench.report.figures import lr_figure

    fig = lr_figure(train, height=170)
    fig.update_layout(margin=dict(l=50, r=10, t=40, b=36), title_font_size=12)
    return fig


def _size(params: float) -> str:
    return f"{params / 1e9:.3g} B parameters" if params >= 1e9 else f"{params / 1e6:.3g} M parameters"
