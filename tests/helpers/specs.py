"""Spec builders the tests share: the tiny GPT job most training, checkpoint and chaos tests run
(raw dicts, as a notebook or a YAML file gives them), and the cloud example with overrides."""
from __future__ import annotations

from pathlib import Path


def tiny_gpt(uri: str | Path | None = None, *, name: str = "tiny", steps: int = 6, global_batch: int = 8,
             micro_batch: int = 4, model: dict | None = None, layout: dict | None = None, dtype: str | None = None,
             train: dict | None = None, resources: dict | None = None, **ckpt) -> dict:
    """A raw spec of the tiny GPT (`model` overrides the preset's fields): `steps` steps of
    `global_batch` in micro-batches of `micro_batch`, and `train`'s extra fields (lr, schedule,
    eval...). `layout`, `dtype` (precision.dtype) and `resources` only when given (the defaults:
    one process, fp32, as many workers as the layout has ranks). `uri` adds a checkpoint section
    with `ckpt`'s fields (every_steps, keep, async_save...)."""
    spec: dict = {"name": name, "model": {"preset": "gpt-tiny", **(model or {})},
                  "train": {"steps": steps, "global_batch": global_batch, "micro_batch": micro_batch, **(train or {})}}
    if layout is not None:
        spec["layout"] = dict(layout)
    if dtype is not None:
        spec["precision"] = {"dtype": dtype}
    if resources is not None:
        spec["resources"] = dict(resources)
    if uri is not None:
        spec["checkpoint"] = {"uri": str(uri), **ckpt}
    else:
        assert not ckpt, f"checkpoint fields {sorted(ckpt)} without a uri"
    return spec


def world(layout: dict) -> int:
    """The ranks a layout needs: dp x tp x pp."""
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)


def cloud_spot(**overrides):
    """examples/cloud-spot.yaml loaded (a JobSpec), with dotted-path overrides ("backend.name": ...)."""
    from workbench.spec import load_spec

    spec = load_spec("examples/cloud-spot.yaml")
    return spec.replace(**overrides) if overrides else spec
