"""Instance tables and default images: what each cloud offers for a GPU type and count."""
from __future__ import annotations

import pytest

from backends import instances as I
from workbench.catalog import DEVICES
from workbench.errors import ConfigError


def test_every_catalog_gpu_is_either_offered_or_refused_with_the_alternatives():
    for table, lookup in ((I.SAGEMAKER, I.sagemaker_instance), (I.VERTEX, I.vertex_machine), (I.AZURE, I.azure_vm_size)):
        for gpu in DEVICES:
            for count, shape in table.get(gpu, {}).items():
                assert lookup(gpu, count) == shape
            if gpu not in table:
                with pytest.raises(ConfigError, match="offers no|TPU"):
                    lookup(gpu, 1)


def test_known_shapes():
    assert I.sagemaker_instance("h100-80gb", 8) == "ml.p5.48xlarge"
    assert I.sagemaker_instance("a100-40gb", 8) == "ml.p4d.24xlarge"
    assert I.vertex_machine("a100-80gb", 4) == I.VertexMachine("a2-ultragpu-4g", "NVIDIA_A100_80GB")
    assert I.vertex_machine("cpu", 2).accelerator_type is None
    assert I.azure_vm_size("h100-80gb", 8) == "Standard_ND96isr_H100_v5"


def test_unofferable_shapes_state_the_offer_and_the_fix():
    with pytest.raises(ConfigError, match=r"gpus_per_node=2: SageMaker has no machine with 2 a100-40gb GPUs; it offers 8"):
        I.sagemaker_instance("a100-40gb", 2, nodes=4)
    with pytest.raises(ConfigError, match="Vertex AI offers no a10g"):
        I.vertex_machine("a10g", 1)
    with pytest.raises(ConfigError, match="Azure ML offers no l4"):
        I.azure_vm_size("l4", 1)
    with pytest.raises(ConfigError, match="TPU"):
        I.vertex_machine("tpu-v5e", 4)


def test_regions_unknown_with_suggestion():
    I.check_region("sagemaker", "eu-west-1")
    with pytest.raises(ConfigError, match="Did you mean 'us-east-1'"):
        I.check_region("sagemaker", "us-east1")
    with pytest.raises(ConfigError, match="Did you mean 'us-central1'"):
        I.check_region("vertex", "us-centrall1")


def test_region_tables_agree_with_the_sdks():
    boto3 = pytest.importorskip("boto3")
    aws = set(boto3.session.Session().get_available_regions("sagemaker"))
    assert set(I.SAGEMAKER_REGIONS) <= aws, set(I.SAGEMAKER_REGIONS) - aws
    base = pytest.importorskip("google.cloud.aiplatform.constants.base")
    assert set(I.VERTEX_REGIONS) <= set(base.SUPPORTED_REGIONS), set(I.VERTEX_REGIONS) - set(base.SUPPORTED_REGIONS)


def test_images_match_torch_or_say_why_not():
    img = I.sagemaker_image("us-east-1", "h100-80gb", "2.8.1")
    assert img.uri == ("763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:"
                       "2.8.0-gpu-py312-cu129-ubuntu22.04-sagemaker") and img.note == ""
    assert "-cpu-py312-ubuntu22.04" in I.sagemaker_image("eu-west-1", "cpu", "2.8.0").uri
    assert I.sagemaker_image("af-south-1", "t4", "2.8.0").uri.startswith("626614931356.dkr.ecr.af-south-1")
    newer = I.sagemaker_image("us-east-1", "t4", "2.99.0")
    assert "2.10.0-gpu" in newer.uri and "2.99.0" in newer.note
    assert I.vertex_image("2.9.0").uri == "docker.io/pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime"
    assert I.azure_environment("2.8.0").uri.endswith("/acpt-pytorch-2.8-cuda12.6/labels/latest")
    with pytest.raises(ConfigError, match="older than the runtime needs"):
        I.vertex_image("2.4.0")
