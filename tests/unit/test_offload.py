"""The fp32 master optimizer (in memory and streamed from files) matches torch.optim exactly;
refused combinations say why before anything starts."""
import gc
import os

import pytest
import torch

from tests.helpers.events import losses, measured
from tests.helpers.reference import reference_run
from tests.helpers.state import assert_same_state
from workbench.errors import ConfigError
from workbench.parallel.master import MasterOptimizer, MemoryStore
from workbench.parallel.offload import build_file_store
from workbench.parallel.step import build_optimizer, functional_update
from workbench.runtime.loop import train
from workbench.spec import load_spec
from workbench.validate import check_runnable


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((37, 11), (5,), (300,))]


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("store", ["memory", "nvme"])
def test_master_optimizer_equals_torch_optim(optimizer, store, tmp_path):
    ref, mine = _params(), _params()
    opt = build_optimizer(ref, optimizer, lr=1e-2, weight_decay=0.1)
    make = MemoryStore if store == "memory" else build_file_store(str(tmp_path))
    master = MasterOptimizer(mine, None, make, chunk=64)  # 712 elements: 12 chunks, the last partial
    update, moments = functional_update(optimizer, lr=1e-2, weight_decay=0.1)
    master.bind(moments)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(ref, mine):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad * 4  # scaled, as a loss scale would; the master unscales by 1/4
        opt.step()
        master.step(update, 0.25)
    for a, b in zip(ref, mine):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    if store == "nvme":
        files = os.listdir(master.store.dir)
        assert sorted(files) == ["master.f32"] + [f"moment{i}.f32" for i in range(moments)]
        assert master.store.offloaded()["offload_staging"] == (1 + moments) * 64 * 4


def test_nvme_run_matches_and_cleans_up(tmp_path):
    base = {"model": {"preset": "gpt-tiny", "layers": 3, "seq_len": 32}, "train": {"steps": 2, "global_batch": 4, "micro_batch": 2}}
    ref, nvme = reference_run(base), []
    train({**base, "layout": {"offload": "nvme", "nvme_path": str(tmp_path)}}, nvme.append)
    assert losses(nvme) == ref.losses()
    m = measured(nvme)
    assert m["optimizer"] == 0 and m["optimizer_on_disk"] == 2 * m["master_on_disk"] > 0
    gc.collect()
    assert os.listdir(tmp_path) == []  # the store's files go with it


@pytest.mark.parametrize("layout,match", [
    ({"dp": 2, "zero": 1, "offload": "cpu"}, r"offload=cpu with zero=1: .*Use zero=2 or zero=3"),
    ({"dp": 2, "tp": 2, "zero": 3, "offload": "nvme"}, r"offload=nvme with zero=3, tp=2, pp=1: .*2-D"),
    ({"dp": 2, "pp": 2, "zero": 2, "offload": "nvme"}, r"offload=nvme with zero=2, tp=1, pp=2: .*pipeline"),
    ({"dp": 1, "zero": 3}, r"zero=3, offload=none on a single rank"),
])
def test_refused_combinations(layout, match):
    spec = load_spec({"model": {"preset": "gpt-tiny"}, "layout": layout})
    with pytest.raises(ConfigError, match=match):
        check_runnable(spec)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_master_state_round_trips_through_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    update, moments = functional_update("adamw", lr=1e-2, weight_decay=0.0)
    saved = MasterOptimizer(_params(0), None, build_file_store(str(tmp_path / "a")), chunk=100)
    saved.bind(moments)
    for p in saved.flat.params:
        p.grad = torch.ones_like(p)
    saved.step(update, 1.0)
    dcp.save({"master": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    loaded = MasterOptimizer(_params(1), None, MemoryStore, chunk=64)  # other weights, other store
    loaded.bind(moments)
    dcp.load({"master": loaded}, checkpoint_id=str(tmp_path / "ckpt"))
    assert loaded.num_steps == 1
    assert_same_state(loaded.state_dict(), saved.state_dict())
    for a, b in zip(saved.flat.params, loaded.flat.params):  # the master was written into the parameters
        assert torch.equal(a, b)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_nvme_is_runnable_at_every_zero_stage(zero):
    check_runnable(load_spec({"model": {"preset": "gpt-tiny"}, "layout": {"dp": 2, "zero": zero, "offload": "nvme"}}))


def test_mapped_file_is_written_back_and_dropped(tmp_path):
    from workbench.parallel.offload import PAGE, MappedFile

    f = MappedFile(str(tmp_path / "x.f32"), 64 * PAGE)
    f.flat.copy_(torch.arange(f.flat.numel(), dtype=torch.float32))
    assert f.resident_bytes() == 64 * PAGE  # written through the mapping: resident
    f.flush()
    f.evict(0, f.nbytes)
    assert f.resident_bytes() == 0  # measured from /proc/self/smaps, not assumed
    with open(f.path, "rb") as fh:  # the file holds the values
        assert torch.equal(torch.frombuffer(bytearray(fh.read()), dtype=torch.float32), torch.arange(f.flat.numel(), dtype=torch.float32))
    assert float(f.flat[12345]) == 12345.0  # read back on touch
    assert 0 < f.resident_bytes() < 64 * PAGE
