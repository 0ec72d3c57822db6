"""Presets: exact parameter counts against the published sizes, computed without torch."""
import pytest

from workbench.shapes import PRESETS, resolve_shape
from workbench.spec import ModelSpec

# GPT-2: the Hugging Face model cards (Radford et al. 2019). Llama 2: Touvron et al. 2023 / the
# released checkpoints. Llama 3 / 3.1: the released checkpoints' parameter counts (8.03B, 70.6B,
# 405.9B; Llama Team 2024, Table 3 gives the shapes).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("preset, expected", PUBLISHED.items())
def test_parameter_counts_match_published_sizes(preset, expected):
    assert resolve_shape(ModelSpec(preset=preset)).num_params() == expected


def test_llama3_shapes():
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        sh = resolve_shape(ModelSpec(preset=name))
        assert (sh.vocab, sh.kv_heads, sh.seq_len, sh.tie_embeddings) == (128256, 8, 8192, False)
    assert PRESETS["llama2-70b"] == PRESETS["llama-70b"]  # the old name stays


def test_catalog_has_the_current_datacenter_gpus_with_dated_sources():
    from workbench.catalog import DEVICES

    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h100-nvl", "h200", "b200"):
        d = DEVICES[name]
        assert d.bf16_flops > 0 and d.memory_bytes > 0 and d.inter_node_bw > 0
        assert "datasheet" in d.source and "(20" in d.source  # the sheet and its date
    assert DEVICES["h100-nvl"].memory_bytes == 94 * 10**9 and DEVICES["h200"].memory_bytes == 141 * 10**9
    assert DEVICES["h100-pcie"].bf16_flops < DEVICES["h100-80gb"].bf16_flops < DEVICES["b200"].bf16_flops
