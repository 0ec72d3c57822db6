"""A checkpoint folder is data, never code (issue 31): a pickle planted in each file kind a
checkpoint has (the RNG file, DCP's .metadata, a non-tensor value inside a shard, the manifest's
spec), with its size and CRC-32 re-signed in the manifest, is refused by resume with exit 2, and
the payload never runs (a marker file it would create stays absent)."""
import io
import json
import os
import pickle
import re
import sys

import pytest
import torch
import yaml

from tests.helpers.events import loss_by_step, losses
from tests.helpers.reference import reference_run
from tests.helpers.specs import tiny_gpt
from workbench.cli import main as cli_main
from workbench.errors import ConfigError
from workbench.runtime.checkpoint_safe import load_metadata, scan_step
from workbench.runtime.checkpoint_store import MANIFEST, Store
from workbench.runtime.loop import train


class Payload:
    """Runs a shell command when unpickled (what an attacker with write access to the store plants)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def spec(uri) -> dict:
    return tiny_gpt(uri, name="data-only", steps=2, global_batch=4, every_steps=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clean")
    train(spec(folder / "ckpt"), [].append)
    return folder / "ckpt"


@pytest.fixture
def ckpt(trained, tmp_path):
    import shutil

    shutil.copytree(trained, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def resign(step_dir, *names):
    """Update the manifest's size and CRC-32 of the named files, as a forger would."""
    store = Store(str(step_dir.parent))
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for name in names:
        manifest["files"][name] = store.checksum(str(step_dir / name))
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def torch_payload(marker) -> bytes:
    buf = io.BytesIO()
    torch.save({"torch": Payload(marker)}, buf)
    return buf.getvalue()


def plant_rng(step_dir, marker):
    (step_dir / "rng-rank00000.pt").write_bytes(torch_payload(marker))
    resign(step_dir, "rng-rank00000.pt")


def plant_metadata(step_dir, marker):
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    resign(step_dir, ".metadata")


def plant_value(step_dir, marker):
    """Append a payload to a shard and point one non-tensor value (an optimizer's param_groups
    entry) at it, through a .metadata that itself names only DCP's classes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(step_dir / ".metadata", "rb") as f:
        metadata = load_metadata(f)
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    info = metadata.storage_data[MetadataIndex(fqn)]
    shard = step_dir / info.relative_path
    payload, offset = torch_payload(marker), shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo(info.relative_path, offset, len(payload),
                                                            info.transform_descriptors)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    resign(step_dir, ".metadata", info.relative_path)


PLANTS = {"rng": plant_rng, "metadata": plant_metadata, "value": plant_value}


@pytest.mark.parametrize("kind", PLANTS)
def test_a_planted_pickle_is_refused_by_the_driver_and_by_every_rank(ckpt, tmp_path, kind, capsys):
    marker = tmp_path / f"pwned-{kind}"
    step_dir = ckpt / "step-000000002"
    PLANTS[kind](step_dir, marker)
    store = Store(str(ckpt))
    manifest, rejected = store.newest_complete()
    assert manifest is not None and not rejected  # the forgery passes size and CRC-32: only the content betrays it
    assert scan_step(store, 2, manifest)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec(ckpt)))
    assert cli_main(["run", str(spec_file), "--resume", "--no-progress"]) == 2  # before any worker starts
    err = capsys.readouterr().err
    assert "not plain checkpoint data" in err and "nothing in them ran" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="not plain checkpoint data"):  # a rank resuming on its own (torchrun, clouds)
        train(spec(ckpt), [].append, resume=True)
    assert not marker.exists()
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000000002"]  # nothing was deleted


def test_a_manifest_naming_a_factory_runs_nothing(ckpt, tmp_path, monkeypatch, capsys):
    """The manifest's spec is data too: a factory it names is compared, never imported."""
    marker = tmp_path / "pwned-manifest"
    (tmp_path / "evil_model.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                            "def build(**kw):\n    raise SystemExit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    step_dir = ckpt / "step-000000002"
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for factory in ("evil_model:build", "os:system"):
        manifest["spec"]["model"] = {"factory": factory, "kwargs": {"command": f"touch {marker}"}, "vocab": 256,
                                     "seq_len": 64}
        (step_dir / MANIFEST).write_text(json.dumps(manifest))
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(spec(ckpt)))
        assert cli_main(["run", str(spec_file), "--resume", "--no-progress"]) == 2
        assert re.search("cannot (resume|use the checkpoint)", capsys.readouterr().err)
        with pytest.raises(ConfigError):
            train(spec(ckpt), [].append, resume=True)
    assert not marker.exists() and "evil_model" not in sys.modules


def test_rng_files_hold_tensors_and_numbers_only(ckpt):
    state = torch.load(ckpt / "step-000000002" / "rng-rank00000.pt", weights_only=True)
    assert {type(v) for v in state.values()} <= {torch.Tensor, int, float, type(None)}


def test_a_clean_checkpoint_resumes_on_the_same_curve(ckpt, tmp_path):
    """The allow-listed readers load everything our checkpoints hold (model, AdamW state, RNG)."""
    full = reference_run({**spec(tmp_path / "full"), "train": {"steps": 4, "global_batch": 4, "micro_batch": 4}})
    resumed = []
    train({**spec(ckpt), "train": {"steps": 4, "global_batch": 4, "micro_batch": 4}}, resumed.append, resume=True)
    assert losses(resumed) == full.losses()[2:]


def forge_empty(step_dir, marker):
    """The manifest lists the shard as an empty file (size 0, CRC-32 of nothing)."""
    (step_dir / "__0_0.distcp").write_bytes(b"")
    resign(step_dir, "__0_0.distcp")


def forge_random(step_dir, marker):
    """The shard replaced by random bytes of the same size, its CRC-32 re-signed."""
    shard = step_dir / "__0_0.distcp"
    shard.write_bytes(os.urandom(shard.stat().st_size))
    resign(step_dir, "__0_0.distcp")


FOUR = {"steps": 4, "global_batch": 4, "micro_batch": 4}


@pytest.fixture(scope="module")
def trained4(tmp_path_factory):
    """Checkpoints at steps 2 and 4, and the uninterrupted run's losses."""
    folder = tmp_path_factory.mktemp("four") / "ckpt"
    return folder, reference_run({**spec(folder), "train": FOUR}).losses()


@pytest.mark.parametrize("forge", [forge_empty, forge_random, plant_rng, plant_metadata, plant_value],
                         ids=lambda f: f.__name__)
def test_a_forged_newest_step_falls_back_to_the_intact_one_on_the_same_curve(trained4, tmp_path, forge):
    """Issue 32, item 5: what passes size and CRC-32 but does not load is skipped, named, and the
    run resumes from the newest intact step, exactly."""
    import shutil

    from workbench.launch import check_resume_from_checkpoint
    from workbench.spec import load_spec

    shutil.copytree(trained4[0], tmp_path / "ckpt")
    four = {**spec(tmp_path / "ckpt"), "train": FOUR}
    marker = tmp_path / "pwned"
    forge(tmp_path / "ckpt" / "step-000000004", marker)
    manifest, rejected = Store(str(tmp_path / "ckpt")).newest_complete(check=scan_step)
    if forge is not forge_random:  # the driver sees these before any worker starts; random tensor bytes only the load
        assert manifest["step"] == 2 and rejected[0][0] == 4 and "not plain checkpoint data" in rejected[0][1]
    check_resume_from_checkpoint(load_spec(four))  # an intact step remains: no refusal
    events = []
    with pytest.warns(UserWarning, match="checkpoint step 4 under .* (could not be loaded|not plain)"):
        train(four, events.append, resume=True)
    assert {"event": "restart", "attempt": 0, "from_step": 2, "rejected": [4]} in events
    assert list(loss_by_step(events).items()) == [(3, trained4[1][2]), (4, trained4[1][3])]
    assert not marker.exists()


def test_metadata_that_points_outside_the_step_is_refused(ckpt, tmp_path, capsys):
    """A forged .metadata may only read the step's own files: not a tensor file elsewhere on the host."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = ckpt / "step-000000002"
    outside = tmp_path / "outside.pt"
    with open(step_dir / ".metadata", "rb") as f:
        metadata = load_metadata(f)
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    torch.save(torch.full(tuple(metadata.state_dict_metadata[fqn].size), 7.0), outside)
    metadata.storage_data[index] = _StorageInfo("../../outside.pt", 0, outside.stat().st_size)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    resign(step_dir, ".metadata")
    manifest, rejected = Store(str(ckpt)).newest_complete(check=scan_step)
    assert manifest is None and "outside the step's own files" in rejected[0][1]
    with pytest.raises(ConfigError, match="outside the step's own files"):
        train(spec(ckpt), [].append, resume=True)
    assert cli_main(["export", str(ckpt), "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "outside the step's own files" in capsys.readouterr().err


def test_a_manifest_spec_that_is_a_string_is_never_read_as_a_path(ckpt, tmp_path, capsys):
    secret = tmp_path / "secret.ini"
    secret.write_text("aws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY\n")
    step_dir = ckpt / "step-000000002"
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["spec"] = str(secret)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec(ckpt)))
    assert cli_main(["run", str(spec_file), "--resume", "--no-progress"]) == 2
    assert cli_main(["export", str(ckpt), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "records no spec" in err and "wJalr" not in err
