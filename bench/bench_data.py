"""(g) What real data costs: training on token shards vs the synthetic stream, and
`data prepare`'s MB/s vs the tokenizers library's own batch encoding of the same files.

1. Whole runs of the same model and layout, alternated: data.source tokens (memmap shards) vs
   synthetic; this process's CPU time per step (robust on a shared machine). Goal: the data
   path costs < 2% of a step. The data path alone (one rank's batch read per step) is timed too.
2. `prepare` (read, encode, write shards + index) vs `Tokenizer.encode_batch` over the same
   files' lines (reading included), with the same trained BPE; MB of text per second.
Run: python -m bench.bench_data [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import interleave, stats, table, tiny_spec, write_result

GOAL_DATA = 0.02


def config(quick: bool) -> dict:
    if quick:
        return {"preset": "gpt-tiny", "steps": 5, "skip": 1, "global_batch": 4, "micro_batch": 2, "reps": 1,
                "corpus_mb": 0.5, "files": 2, "prepare_reps": 1}
    return {"preset": "gpt-mini", "steps": 26, "skip": 4, "global_batch": 4, "micro_batch": 2, "reps": 8,
            "corpus_mb": 16, "files": 8, "prepare_reps": 5}


def make_corpus(root: Path, mb: float, files: int) -> list[Path]:
    """`files` text files of `mb` MB in all, from the public-domain text shipped with workbench
    (paragraphs shuffled per file, so the BPE's word cache sees realistic repetition)."""
    import random

    from workbench.data import DEFAULT_TEXT

    paragraphs = [p for p in DEFAULT_TEXT.read_text().split("\n\n") if p.strip()]
    rng, out = random.Random(0), []
    per_file = int(mb * 2**20 / files)
    for i in range(files):
        parts, size = [], 0
        while size < per_file:
            p = rng.choice(paragraphs)
            parts.append(p)
            size += len(p) + 2
        path = root / f"part-{i:03d}.txt"
        path.write_text("\n\n".join(parts))
        out.append(path)
    return out


def whole_runs(cfg: dict, shards: str) -> dict:
    from workbench.runtime.loop import train

    runs: dict[str, list[float]] = {}
    train_cfg = {"steps": cfg["steps"], "global_batch": cfg["global_batch"], "micro_batch": cfg["micro_batch"]}
    specs = {"synthetic": tiny_spec(cfg["preset"], train=train_cfg),
             "tokens (memmap shards)": tiny_spec(cfg["preset"], train=train_cfg,
                                                 data={"source": "tokens", "path": shards, "seed": 0})}

    def runner(name):
        def once():
            cpu = []
            train(specs[name], lambda e: cpu.append(time.process_time()) if e["event"] == "step" else None)
            steps = [b - a for a, b in zip(cpu[cfg["skip"]:], cpu[cfg["skip"] + 1:])]
            runs.setdefault(name, []).append(statistics.mean(steps))
            return runs[name][-1]
        return once

    interleave({n: runner(n) for n in specs}, reps=cfg["reps"], warmup=1)
    ratios = [t / s - 1 for t, s in zip(runs["tokens (memmap shards)"], runs["synthetic"])]
    return {"cpu_step_s": {k: stats(v) for k, v in runs.items()}, "runs": runs,
            "tokens_vs_synthetic": statistics.median(ratios)}


def data_path_alone(cfg: dict, shards: str, step_s: float) -> dict:
    """One rank's batch per step from the shards, timed alone, as a share of a step."""
    from workbench.data import build_token_source
    from workbench.spec import load_spec

    spec = load_spec(tiny_spec(cfg["preset"], data={"source": "tokens", "path": shards, "seed": 0}))
    src = build_token_source(spec)
    n = 200
    start = time.process_time()
    for k in range(1, n + 1):
        src.rank_batch(k, cfg["global_batch"], 0, 1)
    per_batch = (time.process_time() - start) / n
    return {"batch_read_s": per_batch, "share_of_step": per_batch / step_s}


def prepare_vs_encode(cfg: dict, files: list[Path], tmp: Path) -> dict:
    from tokenizers import Tokenizer

    from workbench.shards import prepare

    prepare(files[:1], str(tmp / "bpe"), tokenizer="bpe", vocab_size=2048, progress=False)
    tok_file = str(tmp / "bpe" / "tokenizer.json")
    tok = Tokenizer.from_file(tok_file)
    mb = sum(f.stat().st_size for f in files) / 1e6

    def ours():
        start = time.perf_counter()
        prepare([str(f) for f in files], str(tmp / "out"), tokenizer=tok_file, progress=False)
        return mb / (time.perf_counter() - start)

    def library():
        start = time.perf_counter()
        for f in files:
            tok.encode_batch(f.read_text().splitlines(keepends=True), add_special_tokens=False)
        return mb / (time.perf_counter() - start)

    t = interleave({"workbench data prepare": ours, "tokenizers encode_batch": library}, reps=cfg["prepare_reps"])
    ratios = [a / b for a, b in zip(t["workbench data prepare"], t["tokenizers encode_batch"])]
    return {"mb": mb, "mb_per_s": {k: stats(v) for k, v in t.items()}, "prepare_vs_encode": statistics.median(ratios)}


def run(quick: bool = False) -> dict:
    from workbench.shards import prepare

    cfg = config(quick)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as folder:
        tmp = Path(folder)
        files = make_corpus(tmp, cfg["corpus_mb"], cfg["files"])
        shards = str(tmp / "bytes")
        prepare([str(f) for f in files], shards, tokenizer="bytes", progress=False)  # fits gpt-*'s 256 tokens
        whole = whole_runs(cfg, shards)
        alone = data_path_alone(cfg, shards, whole["cpu_step_s"]["tokens (memmap shards)"]["median"])
        prepared = prepare_vs_encode(cfg, files, tmp)
    return {"config": cfg, "whole": whole, "alone": alone, "prepare": prepared,
            "tokens_vs_synthetic": whole["tokens_vs_synthetic"], "goal_data": GOAL_DATA}


def summary_rows(result: dict) -> list[list]:
    p = result["prepare"]["mb_per_s"]
    return [["g) data", "tokens shards vs synthetic, CPU s/step - 1", result["tokens_vs_synthetic"], "",
             f"< {GOAL_DATA:.0%}"],
            ["g) data", "shard batch read / step (CPU)", result["alone"]["share_of_step"], "", f"< {GOAL_DATA:.0%}"],
            ["g) data", "data prepare MB/s / tokenizers encode_batch MB/s", result["prepare"]["prepare_vs_encode"],
             "", f"{p['workbench data prepare']['median']:.1f} vs {p['tokenizers encode_batch']['median']:.1f} MB/s"]]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick)
    path = write_result("data", result)
    print(table([[k, s["median"], s["min"], s["max"]] for k, s in result["whole"]["cpu_step_s"].items()],
                ["variant", "CPU s/step", "min", "max"]))
    print(table([[k, s["median"], s["min"], s["max"]] for k, s in result["prepare"]["mb_per_s"].items()],
                ["tokenize", "MB/s", "min", "max"]))
    for row in summary_rows(result):
        print(f"{row[1]}: {row[2]:.4f} ({row[4]})")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
