"""What each cloud offers: GPU type x GPUs per node -> SageMaker instance, Vertex machine, Azure VM.

Pure tables, no SDK. A shape a cloud does not sell is a ConfigError that lists what it does sell
for that GPU, so the user can change `resources.gpus_per_node` instead of reading price pages.
Sources: the clouds' public instance pages (SageMaker pricing, Vertex "Configure compute
resources for custom training", Azure "GPU accelerated VM sizes"), 2025-2026.
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import ConfigError, did_you_mean

CLOUD_GPUS_NOTE = "The runtime runs on NVIDIA GPUs (NCCL) or on CPU (gloo); TPUs need torch_xla, which it does not use."

# SageMaker: GPUs per instance -> ml.* instance type. cpu: worker processes -> a CPU instance with
# at least one vCPU pair per process.
SAGEMAKER: dict[str, dict[int, str]] = {
    "a100-40gb": {8: "ml.p4d.24xlarge"},
    "a100-80gb": {8: "ml.p4de.24xlarge"},
    "h100-80gb": {8: "ml.p5.48xlarge"},
    "h200": {8: "ml.p5en.48xlarge"},
    "l4": {1: "ml.g6.2xlarge", 4: "ml.g6.12xlarge", 8: "ml.g6.48xlarge"},
    "a10g": {1: "ml.g5.2xlarge", 4: "ml.g5.12xlarge", 8: "ml.g5.48xlarge"},
    "v100-16gb": {1: "ml.p3.2xlarge", 4: "ml.p3.8xlarge", 8: "ml.p3.16xlarge"},
    "v100-32gb": {8: "ml.p3dn.24xlarge"},
    "t4": {1: "ml.g4dn.2xlarge", 4: "ml.g4dn.12xlarge"},
    "cpu": {1: "ml.c5.xlarge", 2: "ml.c5.2xlarge", 4: "ml.c5.4xlarge", 8: "ml.c5.9xlarge", 16: "ml.c5.18xlarge"},
}


@dataclass(frozen=True)
class VertexMachine:
    machine_type: str
    accelerator_type: str | None  # aiplatform_v1.AcceleratorType name; None for CPU


def _vm(machine: str, accel: str | None) -> VertexMachine:
    return VertexMachine(machine, accel)


VERTEX: dict[str, dict[int, VertexMachine]] = {
    "a100-40gb": {n: _vm(f"a2-highgpu-{n}g", "NVIDIA_TESLA_A100") for n in (1, 2, 4, 8)}
    | {16: _vm("a2-megagpu-16g", "NVIDIA_TESLA_A100")},
    "a100-80gb": {n: _vm(f"a2-ultragpu-{n}g", "NVIDIA_A100_80GB") for n in (1, 2, 4, 8)},
    "h100-80gb": {8: _vm("a3-highgpu-8g", "NVIDIA_H100_80GB")},
    "h200": {8: _vm("a3-ultragpu-8g", "NVIDIA_H200_141GB")},
    "l4": {1: _vm("g2-standard-8", "NVIDIA_L4"), 2: _vm("g2-standard-24", "NVIDIA_L4"),
           4: _vm("g2-standard-48", "NVIDIA_L4"), 8: _vm("g2-standard-96", "NVIDIA_L4")},
    "v100-16gb": {1: _vm("n1-standard-8", "NVIDIA_TESLA_V100"), 2: _vm("n1-standard-16", "NVIDIA_TESLA_V100"),
                  4: _vm("n1-standard-32", "NVIDIA_TESLA_V100"), 8: _vm("n1-standard-64", "NVIDIA_TESLA_V100")},
    "t4": {1: _vm("n1-standard-8", "NVIDIA_TESLA_T4"), 2: _vm("n1-standard-16", "NVIDIA_TESLA_T4"),
           4: _vm("n1-standard-32", "NVIDIA_TESLA_T4")},
    "cpu": {1: _vm("n1-standard-4", None), 2: _vm("n1-standard-8", None), 4: _vm("n1-standard-16", None),
            8: _vm("n1-standard-32", None), 16: _vm("n1-standard-64", None)},
}

AZURE: dict[str, dict[int, str]] = {
    "a100-40gb": {8: "Standard_ND96asr_v4"},
    "a100-80gb": {1: "Standard_NC24ads_A100_v4", 2: "Standard_NC48ads_A100_v4", 4: "Standard_NC96ads_A100_v4",
                  8: "Standard_ND96amsr_A100_v4"},
    "h100-80gb": {8: "Standard_ND96isr_H100_v5"},
    "h200": {8: "Standard_ND96isr_H200_v5"},
    "v100-16gb": {1: "Standard_NC6s_v3", 2: "Standard_NC12s_v3", 4: "Standard_NC24s_v3"},
    "v100-32gb": {8: "Standard_ND40rs_v2"},
    "t4": {1: "Standard_NC8as_T4_v3", 4: "Standard_NC64as_T4_v3"},
    "cpu": {1: "Standard_D4s_v3", 2: "Standard_D8s_v3", 4: "Standard_D16s_v3", 8: "Standard_D32s_v3",
            16: "Standard_D64s_v3"},
}

# Regions where each service runs training jobs (a subset is fine: unknown means "check the name").
SAGEMAKER_REGIONS = (
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "sa-east-1", "eu-west-1", "eu-west-2",
    "eu-west-3", "eu-central-1", "eu-north-1", "eu-south-1", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
    "ap-south-1", "ap-southeast-1", "ap-southeast-2", "ap-east-1", "af-south-1", "me-south-1",
)
VERTEX_REGIONS = (
    "us-central1", "us-east1", "us-east4", "us-east5", "us-south1", "us-west1", "us-west2", "us-west3", "us-west4",
    "northamerica-northeast1", "northamerica-northeast2", "southamerica-east1", "europe-west1", "europe-west2",
    "europe-west3", "europe-west4", "europe-west6", "europe-west9", "europe-north1", "europe-central2",
    "europe-southwest1", "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast3", "asia-south1",
    "asia-southeast1", "australia-southeast1", "me-west1",
)
# AWS Deep Learning Containers live in account 763104351884 except in opt-in regions.
DLC_ACCOUNTS = {"ap-east-1": "871362719292", "af-south-1": "626614931356", "eu-south-1": "692866216735",
                "me-south-1": "217643126080"}

_CLOUD_NAMES = {"sagemaker": "SageMaker", "vertex": "Vertex AI", "azureml": "Azure ML"}


def _shape(cloud: str, table: dict, gpu: str, per_node: int, nodes: int):
    offered = table.get(gpu)
    label = _CLOUD_NAMES[cloud]
    if gpu.startswith("tpu"):
        raise ConfigError(f"resources.gpu={gpu}: workbench does not dispatch TPU jobs. {CLOUD_GPUS_NOTE} "
                          "Pick an NVIDIA GPU type, e.g. h100-80gb.")
    if not offered:
        others = [g for g in table if g != "cpu"]
        raise ConfigError(f"resources.gpu={gpu}: {label} offers no {gpu} machines. GPU types {label} offers: "
                          f"{', '.join(others)}.")
    if per_node not in offered:
        counts = sorted(offered)
        unit = "worker processes" if gpu == "cpu" else f"{gpu} GPUs"
        raise ConfigError(
            f"resources.gpus_per_node={per_node}: {label} has no machine with {per_node} {unit}; it offers "
            f"{', '.join(map(str, counts))} per node. Set resources.gpus_per_node to one of these and "
            f"resources.nodes so that gpus_per_node x nodes = {per_node * nodes} (the layout's world size)."
        )
    return offered[per_node]


def sagemaker_instance(gpu: str, per_node: int, nodes: int = 1) -> str:
    """The SageMaker instance type for `per_node` devices of `gpu`. Raises ConfigError if not offered."""
    return _shape("sagemaker", SAGEMAKER, gpu, per_node, nodes)


def vertex_machine(gpu: str, per_node: int, nodes: int = 1) -> VertexMachine:
    """The Vertex machine and accelerator type for `per_node` devices of `gpu`. Raises ConfigError."""
    return _shape("vertex", VERTEX, gpu, per_node, nodes)


def azure_vm_size(gpu: str, per_node: int, nodes: int = 1) -> str:
    """The Azure VM size for `per_node` devices of `gpu`. Raises ConfigError if not offered."""
    return _shape("azureml", AZURE, gpu, per_node, nodes)


def check_region(cloud: str, region: str) -> None:
    """Raise ConfigError for a region name the cloud's training service does not have."""
    known = {"sagemaker": SAGEMAKER_REGIONS, "vertex": VERTEX_REGIONS}[cloud]
    if region not in known:
        hint = did_you_mean(region, known)
        raise ConfigError(f"backend.{cloud}.region: {region!r} is not a {_CLOUD_NAMES[cloud]} training region.{hint} "
                          f"Known regions: {', '.join(known)}.")


# Default training images per torch minor version. The runtime needs torch >= 2.6 (FSDP2, DTensor,
# pipelining); with a local torch newer than any listed image the newest one is used and the dry-run
# says so (checkpoints written by torch.distributed.checkpoint load across these versions).
MIN_TORCH = (2, 6)
_SM_DLC = {(2, 6): ("2.6.0", "py312", "cu126"), (2, 7): ("2.7.1", "py312", "cu128"),
           (2, 8): ("2.8.0", "py312", "cu129"), (2, 9): ("2.9.0", "py312", "cu130"),
           (2, 10): ("2.10.0", "py313", "cu130")}
# Vertex's own prebuilt PyTorch images stop at 2.4, older than the runtime needs: use PyTorch's
# official images (Docker Hub), which Vertex custom jobs can pull.
_VERTEX_IMAGES = {(2, 7): "2.7.1-cuda12.8-cudnn9-runtime", (2, 8): "2.8.0-cuda12.8-cudnn9-runtime",
                  (2, 9): "2.9.1-cuda12.8-cudnn9-runtime"}
_AZURE_ENVS = {(2, 8): "acpt-pytorch-2.8-cuda12.6"}


@dataclass(frozen=True)
class Image:
    uri: str
    torch: str  # torch version inside the image
    note: str = ""  # set when the image's torch differs from the local one


def local_torch_version() -> str:
    """The installed torch's version (e.g. '2.13.0'), read from package metadata without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").split("+")[0]
    except PackageNotFoundError:
        return "2.10.0"


def _pick(table: dict, torch_version: str):
    major, minor = (int(x) for x in torch_version.split(".")[:2])
    want = (major, minor)
    if want in table:
        return want, ""
    newest = max(table)
    if want < MIN_TORCH:
        raise ConfigError(f"torch {torch_version} is older than the runtime needs ({MIN_TORCH[0]}.{MIN_TORCH[1]}). "
                          "Upgrade torch, or name an image in the backend section.")
    older = [v for v in table if v <= want]
    chosen = max(older) if older else newest
    note = (f"no image for local torch {torch_version} in workbench's table; using the one with torch "
            f"{chosen[0]}.{chosen[1]}. Name an image in the backend section to pin another.")
    return chosen, note


def sagemaker_image(region: str, gpu: str, torch_version: str | None = None) -> Image:
    """The AWS PyTorch training DLC for the region, device kind and torch version."""
    key, note = _pick(_SM_DLC, torch_version or local_torch_version())
    ver, py, cu = _SM_DLC[key]
    tag = f"{ver}-cpu-{py}-ubuntu22.04-sagemaker" if gpu == "cpu" else f"{ver}-gpu-{py}-{cu}-ubuntu22.04-sagemaker"
    account = DLC_ACCOUNTS.get(region, "763104351884")
    return Image(f"{account}.dkr.ecr.{region}.amazonaws.com/pytorch-training:{tag}", ver, note)


def vertex_image(torch_version: str | None = None) -> Image:
    """PyTorch's official CUDA runtime image for the torch version (runs on CPU machines too)."""
    key, note = _pick(_VERTEX_IMAGES, torch_version or local_torch_version())
    tag = _VERTEX_IMAGES[key]
    return Image(f"docker.io/pytorch/pytorch:{tag}", tag.split("-")[0], note)


def azure_environment(torch_version: str | None = None) -> Image:
    """Azure ML's curated ACPT PyTorch environment (registry asset, latest label)."""
    key, note = _pick(_AZURE_ENVS, torch_version or local_torch_version())
    name = _AZURE_ENVS[key]
    return Image(f"azureml://registries/azureml/environments/{name}/labels/latest", f"{key[0]}.{key[1]}", note)
