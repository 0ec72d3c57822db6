"""Experiment trackers: TensorBoard event files and MLflow runs get the same step, eval and memory
numbers as the metrics JSONL, and the spec. Rank 0 only; each is imported only when named.

Keys: train/loss, train/lr, train/tokens_per_s, train/step_time_s, eval/loss, eval/perplexity,
memory/<part>_bytes (rank 0's measured memory). The spec goes in as text (TensorBoard) and as
params plus a spec.yaml artifact (MLflow).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

Sink = Callable[[dict], None]
_STEP_KEYS = ("loss", "lr", "tokens_per_s", "step_time_s")
_MLFLOW_STATUS = {"completed": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}


def _scalars(event: dict) -> dict[str, float]:
    kind = event.get("event")
    if kind == "step":
        return {f"train/{k}": float(event[k]) for k in _STEP_KEYS if k in event}
    if kind == "eval":
        return {"eval/loss": float(event["loss"]), "eval/perplexity": float(event["perplexity"])}
    if kind == "memory":
        return {f"memory/{k}_bytes": float(v) for k, v in event["measured"].items() if isinstance(v, (int, float))}
    return {}


class TensorBoardTracker:
    def __init__(self, logdir: str, spec):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir)
        self.writer.add_text("spec", "```yaml\n" + spec.to_yaml() + "```", global_step=0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self, status: str) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run per job attempt, in the experiment named after the job."""

    def __init__(self, uri: str, spec):
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses its local file store unless asked; a file: URI is that request.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(spec.name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(spec.name)
        self.run_id = self.client.create_run(experiment_id, run_name=spec.name).info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in _flatten(spec.to_dict()).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, spec.to_yaml(), "spec.yaml")

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS.get(status, "FAILED"))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _is_rank0() -> bool:
    import torch.distributed as dist

    return (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0


@contextlib.contextmanager
def tracked(spec, sink: Sink) -> Iterator[Sink]:
    """`sink`, teed on rank 0 into the trackers the spec names; they are closed with the run's
    end status (failed when the loop raises)."""
    cfg = spec.tracking
    if not (cfg.tensorboard or cfg.mlflow) or not _is_rank0():
        yield sink
        return
    trackers = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(cfg.tensorboard, spec))
    if cfg.mlflow:
        trackers.append(MLflowTracker(cfg.mlflow, spec))
    status = ["failed"]

    def tee(event: dict) -> None:
        sink(event)
        scalars = _scalars(event)
        if scalars:
            for t in trackers:
                t.log(scalars, int(event["step"]))
        if event.get("event") == "end":
            status[0] = event["status"]

    try:
        yield tee
    finally:
        for t in trackers:
            t.close(status[0])
