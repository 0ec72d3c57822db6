"""The DeepSpeed arm of bench/bench_nvme.py (#37) without DeepSpeed's build: its config comes from the
interop mapping of the nvme arm's own spec, the swap-folder census reads DeepSpeed's and our folder
layouts per rank, the prediction says which model DeepSpeed keeps in files at all, and the section
says why the arm did not run when it did not."""
import os

from bench import bench_nvme
from bench.common import tiny_spec


def _spec(preset: str, folder: str = "/tmp/wb-nvme") -> dict:
    return tiny_spec(preset, train={"steps": 3, "global_batch": 8, "micro_batch": 2},
                     layout={"dp": 2, "zero": 3, "nvme_path": folder, "offload": "nvme"})


def test_the_deepspeed_config_is_the_mappings_zero_infinity_of_the_same_spec():
    cfg, _ = bench_nvme.deepspeed_config(_spec("gpt-mini"))
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"] == zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/tmp/wb-nvme"}
    # global 8 = micro 2 x accumulation 2 x dp 2, as the nvme arm splits it
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (8, 2, 2)
    assert "optimizer" not in cfg and cfg["zero_force_ds_cpu_optimizer"] is False  # torch's AdamW is passed in


def test_deepspeed_swaps_nothing_for_gpt_tiny_and_the_optimizer_state_alone_for_gpt_mini():
    """Why the first DeepSpeed run's folder was empty: below 1 MiB nothing is swapped."""
    tiny = bench_nvme.predicted_swap_bytes(_spec("gpt-tiny"), 2)
    assert tiny["deepspeed"] == 0 and tiny["ours"] == 12 * tiny["partition_numel"] > 0
    assert 4 * tiny["partition_numel"] < bench_nvme.DS_MIN_AIO_BYTES
    mini = bench_nvme.predicted_swap_bytes(_spec("gpt-mini"), 2)
    assert mini["deepspeed_params"] == 0 and mini["deepspeed_params_swappable"] == 0  # every partition < 1 MiB
    assert mini["deepspeed_optimizer"] == mini["ours"] == 12 * mini["partition_numel"]


def test_swap_bytes_counts_deepspeeds_and_our_files_per_rank(tmp_path):
    def write(rel: str, n: int) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * n)

    write("zero_stage_3/optimizer/rank0/5_param.tensor.swp", 4096)
    write("zero_stage_3/optimizer/rank1/5_param.tensor.swp", 1024)
    write("zero_stage_3/float32params/rank1/3_param.tensor.swp", 2048)
    write("rank0-shards-abc/shards.f32", 100)
    os.makedirs(tmp_path / "zero_stage_3" / "float32params" / "rank0")  # empty: not counted
    got = bench_nvme.swap_bytes(str(tmp_path))
    assert got["0"]["files"] == 2 and got["0"]["bytes"] == 4196
    assert got["0"]["by_kind"] == {"zero_stage_3/optimizer": 4096, "shards + moments": 100}
    assert got["1"]["by_kind"] == {"zero_stage_3/optimizer": 1024, "zero_stage_3/float32params": 2048}
    assert bench_nvme.swap_bytes(str(tmp_path / "zero_stage_3" / "float32params" / "rank0")) == {}


def _result(deepspeed: dict | str) -> dict:
    s = {"median": 1.0, "min": 1.0, "max": 1.0}
    io = {"mib": 1, "write": {"dd": s}, "read": {"dd": s}, "write_ratio_mapped_dd": s, "write_ratio_pwrite_dd": s,
          "read_ratio_mapped_dd": s, "read_ratio_pread_dd": s}
    return {"model": "gpt-mini", "layout": "dp2 zero3", "rounds": 1, "step_s": {"nvme": s}, "ratio_nvme_none": s,
            "ratio_nvme_cpu": s, "io": io, "load_average": [1.0, 2.0], "deepspeed": deepspeed}


def test_the_section_says_why_deepspeed_did_not_run_and_what_it_measured_when_it_did():
    pred = bench_nvme.predicted_swap_bytes(_spec("gpt-mini"), 2)
    ours = {"0": {"files": 3, "bytes": 12 * pred["partition_numel"], "disk_bytes": 0,
                  "by_kind": {"shards + moments": 1}}}
    skipped = bench_nvme.section(_result({"predicted_bytes_per_rank": pred, "nvme_swap": ours, "nvme_losses": [5.6],
                                          "not_run": bench_nvme.QUICK_DEEPSPEED_REASON}))
    assert "not run: skipped in quick mode" in skipped and "MIN_AIO_BYTES" in skipped
    assert "DeepSpeed ZeRO-Infinity: no libaio." in bench_nvme.section(_result("no libaio"))  # an older result
    s = {"median": 2.0, "min": 1.5, "max": 2.5}
    ran = bench_nvme.section(_result({
        "predicted_bytes_per_rank": pred, "nvme_swap": ours, "nvme_losses": [5.6, 5.2], "losses": [5.6, 5.2],
        "config": bench_nvme.deepspeed_config(_spec("gpt-mini"))[0], "step_s": s, "nvme_step_s": 2.5,
        "ratio_deepspeed_nvme": {"median": 0.8, "min": 0.7, "max": 0.9}, "init_s": s,
        "swap": {"after init": {}, "after step 1": ours, "after the run": ours},
        "loss_agreement": bench_nvme._loss_agreement([5.6, 5.2], [5.6, 5.2])}))
    assert "deepspeed / nvme 0.80x" in ran and "relative difference 0.0e+00 at step 1" in ran
    assert "after init no files" in ran
