"""Cloud GPU prices (USD per GPU-hour, on-demand and spot), dated and overridable.

List prices of the 8-GPU (or largest) training instance of each type, divided by its GPUs,
as shown on the providers' public pricing pages in the month below (US East / us-central1).
Spot is on-demand times a documented fraction: spot prices move daily, so these are planning
figures; override them with `plan(spec, prices=...)` or WORKBENCH_PRICES=path.yaml.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

PRICES_DATE = "2026-11"

MAX_PRICES_BYTES = 1 << 20  # a price table ($WORKBENCH_PRICES) is a few KiB

# Spot as a fraction of on-demand: typical discounts for GPU training instances (60-70%)
# reported by each provider's spot pages ("up to 90% off"); an assumption, not a quote.
SPOT_FRACTION = {"aws": 0.40, "gcp": 0.35, "azure": 0.40}

# device -> cloud -> (instance, gpus, on-demand USD/hour for the instance, source page)
_TABLE: dict[str, dict[str, tuple[str, int, float, str]]] = {
    "h100-80gb": {
        "aws": ("p5.48xlarge", 8, 55.04, "Amazon EC2 On-Demand pricing, p5.48xlarge (after the June 2025 P5 cut)"),
        "gcp": ("a3-highgpu-8g", 8, 88.25, "Google Cloud GPU pricing, A3 (a3-highgpu-8g)"),
        "azure": ("Standard_ND96isr_H100_v5", 8, 98.32, "Azure Linux VM pricing, ND H100 v5"),
    },
    "h200": {
        "aws": ("p5en.48xlarge", 8, 63.30, "Amazon EC2 On-Demand pricing, p5en.48xlarge"),
        "gcp": ("a3-ultragpu-8g", 8, 84.81, "Google Cloud GPU pricing, A3 Ultra (a3-ultragpu-8g)"),
        "azure": ("Standard_ND96isr_H200_v5", 8, 84.80, "Azure Linux VM pricing, ND H200 v5"),
    },
    "a100-80gb": {
        "aws": ("p4de.24xlarge", 8, 27.45, "Amazon EC2 On-Demand pricing, p4de.24xlarge"),
        "gcp": ("a2-ultragpu-8g", 8, 40.22, "Google Cloud GPU pricing, A2 Ultra (a2-ultragpu-8g)"),
        "azure": ("Standard_ND96amsr_A100_v4", 8, 32.77, "Azure Linux VM pricing, NDm A100 v4"),
    },
    "a100-40gb": {
        "aws": ("p4d.24xlarge", 8, 21.96, "Amazon EC2 On-Demand pricing, p4d.24xlarge (after the June 2025 cut)"),
        "gcp": ("a2-highgpu-8g", 8, 29.39, "Google Cloud GPU pricing, A2 (a2-highgpu-8g)"),
        "azure": ("Standard_ND96asr_v4", 8, 27.20, "Azure Linux VM pricing, ND A100 v4"),
    },
    "l4": {
        "aws": ("g6.48xlarge", 8, 13.35, "Amazon EC2 On-Demand pricing, g6.48xlarge"),
        "gcp": ("g2-standard-96", 8, 8.00, "Google Cloud GPU pricing, G2 (g2-standard-96)"),
    },
    "a10g": {"aws": ("g5.48xlarge", 8, 16.29, "Amazon EC2 On-Demand pricing, g5.48xlarge")},
    "v100-16gb": {
        "aws": ("p3.16xlarge", 8, 24.48, "Amazon EC2 On-Demand pricing, p3.16xlarge"),
        "gcp": ("n1-highmem-96 + 8 x V100", 8, 25.52, "Google Cloud GPU pricing, NVIDIA V100 + N1 VM"),
        "azure": ("Standard_NC24s_v3", 4, 12.24, "Azure Linux VM pricing, NCv3"),
    },
    "v100-32gb": {"aws": ("p3dn.24xlarge", 8, 31.21, "Amazon EC2 On-Demand pricing, p3dn.24xlarge")},
    "t4": {
        "aws": ("g4dn.12xlarge", 4, 3.91, "Amazon EC2 On-Demand pricing, g4dn.12xlarge"),
        "gcp": ("n1-standard-32 + 4 x T4", 4, 2.92, "Google Cloud GPU pricing, NVIDIA T4 + N1 VM"),
        "azure": ("Standard_NC64as_T4_v3", 4, 4.35, "Azure Linux VM pricing, NCasT4_v3"),
    },
    "tpu-v5e": {"gcp": ("v5litepod (per chip)", 1, 1.20, "Google Cloud TPU pricing, TPU v5e")},
    "tpu-v5p": {"gcp": ("v5p (per chip)", 1, 4.20, "Google Cloud TPU pricing, TPU v5p")},
}


@dataclass(frozen=True)
class Price:
    cloud: str
    instance: str
    gpus: int
    on_demand: float  # USD per GPU-hour
    spot: float  # USD per GPU-hour
    source: str


def load_prices(override: str | dict | None = None) -> dict[str, dict[str, Price]]:
    """device -> cloud -> Price per GPU-hour.

    Args:
        override: a YAML path or a dict {device: {cloud: {instance, gpus, on_demand, spot}}}
            (on_demand and spot per GPU-hour; spot optional). Default: $WORKBENCH_PRICES if set.
    Raises:
        ConfigError: an unreadable file or an entry without on_demand.
    """
    table = {dev: {cloud: Price(cloud, inst, n, usd / n, usd / n * SPOT_FRACTION[cloud], src)
                   for cloud, (inst, n, usd, src) in clouds.items()}
             for dev, clouds in _TABLE.items()}
    override = override if override is not None else (os.environ.get("WORKBENCH_PRICES") or None)
    if override is None:
        return table
    for dev, clouds in _read(override).items():
        if not isinstance(clouds, dict) and clouds is not None:
            from workbench.errors import ConfigError

            raise ConfigError(f"prices[{str(dev)[:40]}]: expected a mapping of cloud -> prices, e.g. "
                              "{aws: {on_demand: 6.88, spot: 2.75}}.")
        for cloud, entry in (clouds or {}).items():
            table.setdefault(dev, {})[cloud] = _entry(dev, cloud, entry)
    return table


def _read(override) -> dict:
    from workbench.errors import ConfigError

    if isinstance(override, dict):
        return override
    if not isinstance(override, (str, os.PathLike)):
        raise ConfigError(f"prices: a YAML path or a dict, not {type(override).__name__}.")
    from pathlib import Path

    from workbench.spec_input import clip, parse_yaml, read_bounded

    where = f"prices {clip(repr(str(override)), 300)}"
    data = parse_yaml(read_bounded(Path(override), "prices file", MAX_PRICES_BYTES), where, "price table") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of device -> cloud -> prices.")
    return data


def _entry(dev: str, cloud: str, entry) -> Price:
    from workbench.errors import ConfigError

    if not isinstance(entry, dict) or "on_demand" not in entry:
        raise ConfigError(f"prices[{dev}][{cloud}]: needs on_demand (USD per GPU-hour), e.g. "
                          "{on_demand: 6.88, spot: 2.75}.")
    try:
        od = float(entry["on_demand"])
        spot = float(entry.get("spot", od * SPOT_FRACTION.get(cloud, 0.4)))
        gpus = int(entry.get("gpus", 1))
    except (TypeError, ValueError, OverflowError):
        od = spot = gpus = -1
    if not (0 <= od < 1e6 and 0 <= spot < 1e6 and 0 < gpus <= 1024):
        raise ConfigError(f"prices[{str(dev)[:40]}][{str(cloud)[:40]}]: on_demand and spot are USD per GPU-hour "
                          "(0 to 1e6) and gpus a count (1 to 1024), e.g. {on_demand: 6.88, spot: 2.75, gpus: 8}.")
    return Price(cloud, str(entry.get("instance", "user price")), gpus, od, spot, str(entry.get("source", "user override")))
