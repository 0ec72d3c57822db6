"""Runs read back from disk for comparison, and the tail of each rank's stdout/stderr.

A run is a metrics JSONL file (`workbench run --metrics-out`, the contract in docs/architecture.md)
or a checkpoint folder (its manifests name the spec, the layout and the run id; a metrics file in
the folder gives the curves). Plain files in, plain dicts out: no widgets, no plotly.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from workbench.errors import ConfigError

_MANIFEST = "manifest.json"  # runtime.checkpoint_store.MANIFEST, read here without importing the runtime
_TAIL_BYTES = 64 << 10


def read_events(path: str | os.PathLike) -> list[dict]:
    """The metrics events of a JSONL file, in order; lines that are not an event (a progress line, a
    line cut short by a run that was killed) are skipped.

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"Cannot read the metrics file {path}: {e.strerror or e}. Give the path of a file "
                          "written by `workbench run --metrics-out FILE`.") from e
    events = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def layout_from_events(events: list[dict]) -> dict:
    """The dp/tp/pp degrees a run's memory events imply (every rank reports its mesh coordinates at
    step 1); {} when it has none."""
    coords = [e.get("coords") or {} for e in events if e.get("event") == "memory"]
    if not coords:
        return {}
    return {axis: 1 + max(int(c.get(axis, 0)) for c in coords) for axis in ("dp", "tp", "pp")}


def load_run(path: str | os.PathLike) -> dict:
    """One run from a metrics JSONL file or a checkpoint folder.

    Args:
        path: a ``.jsonl`` file, or a folder holding ``step-*/manifest.json`` (a checkpoint URI on this
            machine) and, optionally, metrics ``*.jsonl`` files: the newest checkpoint's run's own
            ``metrics-<run id>.jsonl`` (`save_events`), else the newest file.
    Returns:
        ``{"label", "path", "events", "layout", "run_id", "checkpoints", "note", "metrics"}``: `label`
        names the run and its layout (the legend's text), `layout` is the spec's layout (from a
        manifest) or the degrees the memory events imply, `checkpoints` the committed steps, `note`
        what is missing, `metrics` the file the events came from.
    Raises:
        ConfigError: nothing there, or neither metrics nor a checkpoint manifest.
    """
    p = Path(path).expanduser()
    metrics: Path | None
    steps: list[int]
    if p.is_file():
        events, manifest, steps, metrics = read_events(p), _sibling_manifest(p), [], p
    elif p.is_dir():
        manifest, steps = _newest_manifest(p)
        own = p / metrics_name(str((manifest or {}).get("run_id")))  # the notebook's (save_events)
        files = sorted(p.glob("*.jsonl"), key=lambda f: f.stat().st_mtime)
        metrics = own if own.is_file() else files[-1] if files else None
        events = read_events(metrics) if metrics else []
        if manifest is None and metrics is None:
            raise ConfigError(f"{p} holds no metrics (*.jsonl) and no checkpoint (step-*/{_MANIFEST}). Give a "
                              "file written by `workbench run --metrics-out FILE` or a checkpoint folder.")
    else:
        raise ConfigError(f"{p} does not exist. Give a metrics JSONL file or a checkpoint folder on this machine.")
    spec = (manifest or {}).get("spec") if isinstance((manifest or {}).get("spec"), dict) else {}
    layout = dict(spec.get("layout") or (manifest or {}).get("layout") or layout_from_events(events))
    micro = (spec.get("train") or {}).get("micro_batch")
    name = spec.get("name") or p.stem
    run_id = (manifest or {}).get("run_id")
    note = "" if events else "no metrics file: only its checkpoints and layout"
    return {"label": _label(name, layout, micro), "path": str(p), "events": events, "layout": layout,
            "run_id": run_id, "checkpoints": steps, "note": note, "metrics": str(metrics) if metrics else None}


def metrics_name(run_id: str) -> str:
    return f"metrics-{run_id}.jsonl"


def save_events(events: list[dict], folder: str | os.PathLike, run_id: str) -> Path:
    """Write a run's events as metrics JSONL into its checkpoint folder, `metrics-<run id>.jsonl`
    (replaced whole, so a resume that keeps the id rewrites it with the continued curve); `load_run`
    of the folder reads the file of the run whose checkpoint is the newest.

    Raises:
        OSError: the folder cannot be written.
    """
    path = Path(folder).expanduser() / metrics_name(run_id)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(e, default=str) + "\n" for e in events), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _label(name: str, layout: dict, micro_batch: int | None) -> str:
    from workbench.report.figures import layout_label

    return f"{name} ({layout_label(layout, micro_batch)})" if layout else name


def _newest_manifest(folder: Path) -> tuple[dict | None, list[int]]:
    """The newest readable checkpoint manifest under `folder` and every step that has one."""
    found = []
    for d in folder.glob("step-*"):
        if (d / _MANIFEST).is_file() and d.name[5:].isdigit():
            found.append((int(d.name[5:]), d / _MANIFEST))
    found.sort()
    for _, manifest_path in reversed(found):
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict):
            return manifest, [s for s, _ in found]
    return None, [s for s, _ in found]


def _sibling_manifest(metrics: Path) -> dict | None:
    """A metrics file kept inside a checkpoint folder names its run through the folder's manifest."""
    return _newest_manifest(metrics.parent)[0]


def load_runs(pattern: str) -> tuple[list[dict], list[str]]:
    """Every run a path or glob names (``runs/*.jsonl``, ``ckpt/*``): (runs, problems), one problem per
    path that could not be read, so one bad file does not hide the others."""
    paths = sorted(glob.glob(os.path.expanduser(pattern))) or [pattern]
    runs, problems = [], []
    for path in paths:
        try:
            runs.append(load_run(path))
        except ConfigError as e:
            problems.append(str(e))
    return runs, problems


def rank_logs(events: list[dict]) -> dict[int, dict]:
    """Where each rank's stdout and stderr go, from the newest "worker" event per rank (the local
    backend names the files Ray writes the rank's output to): {rank: {"stdout": path, "stderr": path}}."""
    out: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "worker" and (e.get("stdout") or e.get("stderr")):
            out[int(e["rank"])] = {k: e[k] for k in ("stdout", "stderr") if e.get(k)}
    return out


def tail(path: str, lines: int = 20) -> str:
    """The last `lines` lines of a text file ('' when it cannot be read); reads at most its last 64 KiB."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > _TAIL_BYTES and text:
        text = text[1:]  # the first line read is cut
    return "\n".join(text[-lines:])


def rank_tails(events: list[dict], lines: int = 20) -> dict[int, dict[str, str]]:
    """The tail of each rank's stdout and stderr: {rank: {"stdout": text, "stderr": text}}."""
    return {rank: {kind: tail(path, lines) for kind, path in files.items()}
            for rank, files in sorted(rank_logs(events).items())}
