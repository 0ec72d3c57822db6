"""bench_data at tiny sizes: both comparisons measure something real, and the report shows them."""
import pytest
import torch

from bench.common import write_result


@pytest.mark.timeout(240)
def test_data_benchmark_and_its_report_section(tmp_path):
    from bench import bench_data
    from bench.report import write_report

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = bench_data.run(quick=True)
    finally:
        torch.set_num_threads(threads)
    steps = r["whole"]["cpu_step_s"]
    assert set(steps) == {"synthetic", "tokens (memmap shards)"} and all(v["median"] > 0 for v in steps.values())
    assert isinstance(r["tokens_vs_synthetic"], float) and 0 < r["alone"]["share_of_step"] < 1
    rates = r["prepare"]["mb_per_s"]
    assert all(v["median"] > 0 for v in rates.values()) and r["prepare"]["prepare_vs_encode"] > 0
    write_result("data", r, tmp_path)
    text = write_report(tmp_path, tmp_path / "benchmarks.md", tmp_path / "img").read_text()
    assert "## g) Real data" in text and "MB/s" in text and "of a step" in text
