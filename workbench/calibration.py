"""Published training runs (workbench/calibration.yaml) and the step-time model's prediction for each.

Used by the calibration test (every case within +-20% of published tokens/s per GPU),
bench/calibrate.py (fits the constants of workbench/steptime.py on the `fit` half) and
docs/planning.md (fit and held-out errors side by side).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CALIBRATION_YAML = Path(__file__).with_name("calibration.yaml")


@dataclass(frozen=True)
class Case:
    name: str
    split: str  # "fit" | "held_out"
    source: str
    where: str
    gpu: str
    gpus_per_node: int
    dtype: str
    flops: str  # the publication's FLOP count: "megatron" | "model"
    model: dict
    layout: dict
    global_batch: int
    micro_batch: int
    tflops_per_gpu: float
    attention: str  # "unfused" | "flash": the attention kernel the run used
    assumed: str = ""

    @property
    def world_size(self) -> int:
        return self.layout.get("dp", 1) * self.layout.get("tp", 1) * self.layout.get("pp", 1)

    def shape(self):
        from workbench.shapes import resolve_shape
        from workbench.spec import ModelSpec

        return resolve_shape(ModelSpec(**self.model, tie_embeddings=False))

    def published_tokens_per_s_per_gpu(self) -> float:
        """The published TFLOP/s per GPU over the publication's own FLOPs per token."""
        from workbench.steptime import flops_per_token

        sh = self.shape()
        if self.flops == "megatron":  # Narayanan et al. 2021, eq. 3, per token (includes recompute)
            layers, h, s, v = sh.layers, sh.hidden, sh.seq_len, sh.vocab
            per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        else:
            per_token = flops_per_token(sh)[0]
        return self.tflops_per_gpu * 1e12 / per_token


@lru_cache(maxsize=1)
def load_cases() -> tuple[Case, ...]:
    import yaml

    raw = yaml.safe_load(CALIBRATION_YAML.read_text())
    out = []
    for c in raw["cases"]:
        out.append(Case(name=c["name"], split=c["split"], source=c["source"], where=c["where"], gpu=c["gpu"],
                        gpus_per_node=c["gpus_per_node"], dtype=c["dtype"], flops=c["flops"], model=c["model"],
                        layout=c["layout"], global_batch=c["global_batch"], micro_batch=c["micro_batch"],
                        tflops_per_gpu=c["published"]["tflops_per_gpu"], attention=c["attention"],
                        assumed=c.get("assumed", "")))
    return tuple(out)


def predict(case: Case):
    """The step-time model's StepTime for the case's layout as published."""
    from workbench.catalog import get_device
    from workbench.memory import Layout
    from workbench.memory.estimate import _stage_params
    from workbench.steptime import step_time

    sh = case.shape()
    dp = case.layout.get("dp", 1)
    lay = Layout(**case.layout, micro_batch=case.micro_batch, num_micro=case.global_batch // (dp * case.micro_batch),
                 dtype=case.dtype, device="cuda")
    p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
    return step_time(sh, lay, get_device(case.gpu), case.global_batch, case.gpus_per_node, p, shard,
                     attention=case.attention)


def errors() -> list[tuple[Case, float, float]]:
    """[(case, predicted tokens/s per GPU, published tokens/s per GPU)]."""
    out = []
    for c in load_cases():
        st = predict(c)
        out.append((c, st.tokens_per_s / c.world_size, c.published_tokens_per_s_per_gpu()))
    return out
