"""Published training runs (workbench/calibration.yaml) and the step-time model's prediction for each.

Used by the calibration test (every case within +-20% of published tokens/s per GPU),
bench/calibrate.py (fits the constants of workbench/steptime.py on the `fit` half) and
docs/planning.md (fit and held-out errors side by side).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from workbench.parallelism import Parallelism, num_micro_batches

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
    published: dict  # as printed: tflops_per_gpu, tokens_per_s_per_gpu and/or mfu
    attention: str  # "unfused" | "flash": the attention kernel the run used
    assumed: str = ""
    engine: str = "megatron-lm-2021"
    overlap: dict | None = None  # what the engine overlapped: grad_reduce, param_gather, tp_comm
    tie_embeddings: bool = False
    catalog_match: bool = True  # False: the run's GPU differs from the catalog device named (held out)
    fsdp: dict | None = None  # the run's FSDP settings as printed (llm-foundry: sharding, mixed_precision, precision)
    # The engine's own pipeline split (steptime.engine_split's keywords: Megatron-Core's
    # account_for_embedding / account_for_loss, or first / last stage layers); None: the runtime's.
    pipeline_split: dict | None = None

    @property
    def tflops_per_gpu(self) -> float:
        return self.published["tflops_per_gpu"]

    @property
    def world_size(self) -> int:
        """GPUs of the published run: its layout's Parallelism.world_size."""
        return Parallelism(**{axis: self.layout.get(axis, 1) for axis in ("dp", "tp", "pp")}).world_size

    def shape(self):
        from workbench.shapes import resolve_shape
        from workbench.spec import ModelSpec

        return resolve_shape(ModelSpec(**self.model, tie_embeddings=self.tie_embeddings))

    def published_tokens_per_s_per_gpu(self) -> float:
        """Tokens/s per GPU as printed, else the published TFLOP/s per GPU (or MFU x peak) over
        the publication's own FLOPs per token."""
        from workbench.catalog import get_device
        from workbench.steptime import flops_per_token

        if "tokens_per_s_per_gpu" in self.published:
            return float(self.published["tokens_per_s_per_gpu"])
        sh = self.shape()
        if "tflops_per_gpu" not in self.published:  # an MFU of the model's 6N + 12 L h s FLOPs
            peak = get_device(self.gpu).compute_flops[self.dtype]
            return self.published["mfu"] * peak / flops_per_token(sh)[0]
        if self.flops == "megatron":  # Narayanan et al. 2021, eq. 3, per token (includes recompute)
            layers, h, s, v = sh.layers, sh.hidden, sh.seq_len, sh.vocab
            per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        else:
            per_token = flops_per_token(sh)[0]
        return self.published["tflops_per_gpu"] * 1e12 / per_token

    def engine_overlap(self):
        """The Engine the run used, from its `engine` and `overlap` (workbench.steptime.Engine)."""
        from workbench.steptime import Engine

        o = self.overlap or {}
        return Engine(self.engine, grad_reduce=o.get("grad_reduce", True), prefetch=o.get("prefetch", True),
                      param_gather=o.get("param_gather", False), tp_comm=o.get("tp_comm", False),
                      per_tensor=o.get("per_tensor", False), distributed_optimizer=self.engine == "megatron-core",
                      backward_prefetch=o.get("backward_prefetch", "pre"), grad_reduce_bytes=self.fsdp_reduce_bytes())

    def fsdp_reduce_bytes(self) -> int:
        """Bytes per gradient element of the run's FSDP reduce-scatter: Composer's mixed_precision PURE
        reduces in the low-precision dtype (reduce_dtype = bf16), DEFAULT and FULL in fp32
        (composer/trainer/mosaic_fsdp.py get_mixed_precision, v0.13.4 lines 86-92; mosaic_fsdp_utils.py, v0.16.4)."""
        pure = (self.fsdp or {}).get("mixed_precision") == "PURE"
        return 2 if pure and self.dtype in ("bf16", "fp16") else 4


@lru_cache(maxsize=1)
def load_cases() -> tuple[Case, ...]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    raw = yaml.load(CALIBRATION_YAML.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    out = []
    for c in raw["cases"]:
        out.append(Case(name=c["name"], split=c["split"], source=c["source"], where=c["where"], gpu=c["gpu"],
                        gpus_per_node=c["gpus_per_node"], dtype=c["dtype"], flops=c["flops"], model=c["model"],
                        layout=c["layout"], global_batch=c["global_batch"], micro_batch=c["micro_batch"],
                        published=c["published"], attention=c["attention"], assumed=c.get("assumed", ""),
                        engine=c.get("engine", "megatron-lm-2021"), overlap=c.get("overlap"),
                        tie_embeddings=c.get("tie_embeddings", False), catalog_match=c.get("catalog_match", True),
                        fsdp=c.get("fsdp"), pipeline_split=c.get("pipeline_split")))
    return tuple(out)


def predict(case: Case):
    """The step-time model's StepTime for the case's layout as published."""
    from workbench.catalog import get_device
    from workbench.memory import Layout
    from workbench.memory.estimate import _stage_params
    from workbench.steptime import engine_split, split_params, step_time

    sh = case.shape()
    dp = case.layout.get("dp", 1)
    lay = Layout(**case.layout, micro_batch=case.micro_batch,
                 num_micro=num_micro_batches(case.global_batch, dp, case.micro_batch), dtype=case.dtype, device="cuda")
    split = None
    if case.pipeline_split is not None:
        split = engine_split(sh.layers, lay.pp, lay.chunks, **case.pipeline_split)
        p, shard = split_params(sh, lay.tp, lay.pp, lay.chunks, lay.dp, split)
    else:
        p, shard = _stage_params(sh, lay.tp, lay.pp, 0, lay.chunks, lay.dp)
    return step_time(sh, lay, get_device(case.gpu), case.global_batch, case.gpus_per_node, p, shard,
                     attention=case.attention, engine=case.engine_overlap(), split=split)


def priced(case: Case) -> bool:
    """Cases the model prices: not fp8 (neither our runtime nor the catalog has an fp8 path)."""
    return case.dtype in ("fp32", "fp16", "bf16")


def errors() -> list[tuple[Case, float, float]]:
    """[(case, predicted tokens/s per GPU, published tokens/s per GPU)] of every priced case."""
    out = []
    for c in filter(priced, load_cases()):
        st = predict(c)
        out.append((c, st.tokens_per_s / c.world_size, c.published_tokens_per_s_per_gpu()))
    return out
