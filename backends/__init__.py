"""Where jobs run: local Ray, an existing Ray cluster, SageMaker, Vertex AI, Azure ML.

Each backend module imports its SDK lazily, so `import backends` costs nothing.
"""
from __future__ import annotations

import importlib

from backends.base import Backend, JobHandle, JobState, JobStatus
from workbench.errors import ConfigError

_MODULES = {
    "local": "backends.local_ray:LocalRayBackend",
    "ray": "backends.ray_cluster:RayClusterBackend",
    "sagemaker": "backends.sagemaker:SageMakerBackend",
    "vertex": "backends.vertex:VertexBackend",
    "azureml": "backends.azureml:AzureMLBackend",
}


def get_backend(name: str, **options) -> Backend:
    """The backend called `name`, built with `options` (e.g. root= for the ones that ship code)."""
    if name not in _MODULES:
        raise ConfigError(f"backend {name!r} is unknown. Known backends: {', '.join(_MODULES)}.")
    module, _, cls = _MODULES[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)


def dispatch(spec, backend: str | None = None, dry_run: bool = False, root=None):
    """Submit `spec` to a backend (default: the spec's backend.name); `root` is the project
    directory whose code the remote job gets (default: the current directory; local: unused).

    Returns:
        A JobHandle, or with dry_run=True the request as ``{"backend": name, "request": {...}}``.
    Raises:
        ConfigError: an invalid spec or a setting the target cannot honour.
    """
    from workbench.spec import load_spec

    name = backend or load_spec(spec).backend.name
    spec = load_spec(spec, [f"backend.name={name}"])
    target = get_backend(name, root=root) if root is not None and name != "local" else get_backend(name)
    if dry_run:
        return {"backend": name, "request": target.dry_run(spec)}
    return target.submit(spec)


__all__ = ["Backend", "JobHandle", "JobState", "JobStatus", "dispatch", "get_backend"]
