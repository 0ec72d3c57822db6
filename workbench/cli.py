"""The `workbench` command: run, validate, memory, plan, calibrate, dispatch, import, export-config, data
prepare, export, sample (see docs/architecture.md, Contracts)."""
from __future__ import annotations

import argparse
import json
import sys

from workbench.errors import ConfigError, WorkerError
from workbench.spec_input import clip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description="Plan, run and dispatch parallel training jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        c.add_argument("spec", help="job spec (YAML)")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec field, e.g. --set layout.dp=4 (repeatable)")
        return c

    run = command("run", "Run the job on the backend named in the spec (default: local Ray).")
    run.add_argument("--metrics-out", help="write metrics events as JSON lines to this file")
    run.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    run.add_argument("--resume-or-fresh", action="store_true",
                     help="like --resume, but start at step 1 when every checkpoint is corrupt (--resume stops, exit 2)")
    run.add_argument("--report", help="write a self-contained HTML report of the run to this file")
    run.add_argument("--no-progress", action="store_true", help="no terminal progress bar")

    validate = command("validate", "Check the spec as run does before any worker starts; exit 2 with the reason.")
    validate.add_argument("--resume", action="store_true",
                          help="check as `run --resume` does (the checkpoints under checkpoint.uri can be resumed)")
    validate.add_argument("--resume-or-fresh", action="store_true", help="check as `run --resume-or-fresh` does")
    memory = command("memory", "Predicted memory per rank.")
    memory.add_argument("--json", action="store_true", help="machine-readable output")
    plan = command("plan", "Candidate layouts for the spec's resources, best first.")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    for c in (validate, memory, plan):
        c.add_argument("--trust-factory", action="store_true",
                       help="let planning import and call model.factory (it is code); same as model.trust_factory: true")
    plan.add_argument("--top", type=_positive_int, default=10, help="how many candidates to show (default 10)")
    plan.add_argument("--profile", help="a hardware profile from `workbench calibrate` (default: $WORKBENCH_PROFILE, "
                      "else the one saved for the spec's GPU type, else the catalog's figures)")
    dispatch = command("dispatch", "Submit the job to a backend, or print the request with --dry-run.")
    dispatch.add_argument("--backend", help="local | ray | sagemaker | vertex | azureml (default: the spec's)")
    dispatch.add_argument("--dry-run", action="store_true", help="print the exact request; needs no credentials or network")
    cal = command("calibrate", "Measure this cluster (GEMMs, memory, collectives) for plan's step times and the notebook to use.")
    cal.add_argument("-o", "--output", help="write the profile here (default: $WORKBENCH_HOME/profiles/<device>.yaml)")
    cal.add_argument("--quick", action="store_true", help="fewer sizes, shorter timings (under a minute on a laptop)")
    _interop_commands(sub, command)
    _training_commands(sub)
    return p


def _interop_commands(sub, command) -> None:
    from workbench.interop.common import ENGINES

    imp = sub.add_parser("import", help="Translate a DeepSpeed, Accelerate, Megatron-LM or torchtitan config into a spec.",
                         description="Translate an engine's config into a job spec (YAML); every key with no "
                         "counterpart is named in a warning on stderr (docs/interop.md).")
    imp.add_argument("file", help="ds_config.json, Accelerate YAML, Megatron-LM command line, or torchtitan TOML")
    imp.add_argument("--format", choices=ENGINES, help="the config's engine (default: detected from the content)")
    imp.add_argument("-o", "--output", help="write the spec here instead of stdout")
    imp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="set what the file leaves to the launcher, e.g. --set layout.dp=8 (repeatable)")
    exp = command("export-config", "Write the spec as a DeepSpeed, Accelerate, Megatron-LM or torchtitan config.")
    exp.add_argument("--to", required=True, choices=ENGINES, help="the engine")
    exp.add_argument("-o", "--output", help="write the config here instead of stdout")


def _training_commands(sub) -> None:
    """data prepare, export, sample: from a text corpus to a model other tools load."""
    data = sub.add_parser("data", help="Prepare training data.", description="Prepare training data.")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="Tokenize text/jsonl/parquet files into token shards + index.",
                               description="Tokenize text/jsonl/parquet files (or a saved Hugging Face dataset) into "
                               "token shards + index.json for data.source: tokens.")
    prep.add_argument("inputs", nargs="+", help="files or directories (.txt/.md, .jsonl, .parquet, .arrow)")
    prep.add_argument("--out", required=True, help="output directory or fsspec URI (e.g. s3://bucket/tokens)")
    prep.add_argument("--tokenizer", default="bpe", help="bpe (trained here on the inputs), bytes, a tokenizer.json path, "
                      "or a Hugging Face model folder (its tokenizer and chat template)")
    prep.add_argument("--format", default="auto", choices=["auto", "text", "chat", "instruct"],
                      help="text: documents; chat: {messages: [{role, content}]} records; instruct: {prompt, completion} "
                      "records (chat and instruct write a loss mask: only the assistant/completion tokens train); "
                      "auto (default): what the records' fields say")
    prep.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    prep.add_argument("--text-field", default="text", help="text column of jsonl/parquet/Arrow inputs (default: text)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    export = sub.add_parser("export", help="Export a checkpoint as a Hugging Face transformers folder.",
                            description="Export a checkpoint (any layout) as safetensors + config.json for transformers.")
    export.add_argument("checkpoint", help="a checkpoint.uri (its newest checkpoint) or a step-NNNNNNNNN directory")
    export.add_argument("--to", choices=["hf"], required=True, help="format (hf: Hugging Face transformers)")
    export.add_argument("out", help="output directory")
    smp = sub.add_parser("sample", help="Continue a prompt with a checkpoint and the run's tokenizer.",
                         description="Continue a prompt with a checkpoint and the run's tokenizer.")
    smp.add_argument("checkpoint", help="a checkpoint.uri (its newest checkpoint) or a step-NNNNNNNNN directory")
    smp.add_argument("--prompt", default="", help="text to continue")
    smp.add_argument("--max-new-tokens", type=int, default=100)
    smp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    smp.add_argument("--top-k", type=int, default=50)
    smp.add_argument("--seed", type=int, default=0)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 0 < n <= 1 << 20:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: a whole number from 1 to {1 << 20:,}")
    return n


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"error: {_printable(clip(str(e)))}", file=sys.stderr)
        return 2
    except WorkerError as e:
        code = getattr(e, "exit_code", 1)  # e.g. 69: the local Ray cluster did not start (backends/ray_start.py)
        print(f"error: {_printable(str(e))}" if code != 1 else f"error: training failed: {_printable(str(e))}",
              file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _printable(text: str) -> str:
    """`text` safe for a terminal whatever it quotes (a key, a file name, a --set value): control
    characters (an escape sequence would clear the screen or fake output) and undecodable bytes
    escaped, line breaks and tabs kept."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


def _load(args, layout: bool = True):
    from workbench.spec import load_spec

    trust = ["model.trust_factory=true"] if getattr(args, "trust_factory", False) else []
    return load_spec(args.spec, [*args.overrides, *trust], layout=layout)


def _resume(args) -> bool | str:
    from workbench.runtime.checkpoint_store import RESUME_OR_FRESH

    return RESUME_OR_FRESH if args.resume_or_fresh else args.resume


def _run(args) -> int:
    from workbench.launch import run

    result = run(_load(args), metrics_out=args.metrics_out, resume=_resume(args), progress=not args.no_progress,
                 report=args.report)
    return 0 if result.status == "completed" else result.exit_code


def _validate(args) -> int:
    from workbench.validate import check_runnable

    spec = _load(args)
    if spec.backend.name == "local":  # validate == run: every refusal run makes before a worker starts
        from backends.local_start import check_before_start

        check_before_start(spec, _resume(args))
    else:  # the cloud checks its own checkpoint URI when the job starts there
        check_runnable(spec)
    print(f"ok: {spec!r}")
    return 0


def _memory(args) -> int:
    from workbench.memory import estimate_memory

    est = estimate_memory(_load(args))
    print(json.dumps(est.to_dict(), indent=2) if args.json else est.table())
    return 0


def _plan(args) -> int:
    from workbench.planner import plan

    result = plan(_load(args, layout=False), profile=args.profile)  # plan searches layouts
    print(json.dumps(result.to_dict(top=args.top), indent=2) if args.json else result.table(top=args.top))
    return 0


def _calibrate(args) -> int:
    from workbench.calibrate import calibrate, summary

    profile, path = calibrate(_load(args, layout=False), out=args.output, quick=args.quick)
    print(summary(profile))
    print(f"wrote {path}; `workbench plan` and the notebook's planner now use it for {profile.device} step times")
    return 0


def _dispatch(args) -> int:
    from backends import dispatch

    spec = _load(args)
    out = dispatch(spec, backend=args.backend, dry_run=args.dry_run)
    if args.dry_run:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(f"submitted: {out.job_id}")
    return 0


def _import(args) -> int:
    import yaml

    from workbench.interop import import_config

    spec, warnings = import_config(args.file, args.format, args.overrides)
    # only what the config said: a default written out would read as the user's choice on export-config
    said = spec.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    return _emit(yaml.safe_dump(said, sort_keys=False), warnings, args.output)


def _export_config(args) -> int:
    from workbench.interop import export_config

    text, warnings = export_config(_load(args), args.to)
    return _emit(text, warnings, args.output)


def _emit(text: str, warnings: list[str], output: str | None) -> int:
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    if output:
        try:
            with open(output, "w") as f:
                f.write(text)
        except OSError as e:
            raise ConfigError(f"cannot write {output!r}: {e}.") from None
    else:
        sys.stdout.write(text)
    return 0


def _data(args) -> int:
    from workbench.shards import prepare

    index = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                    text_field=args.text_field, shard_tokens=args.shard_tokens, progress=not args.no_progress,
                    format=args.format)
    what = f"{index['num_documents']:,} documents"
    if "examples" in index:  # fine-tuning data: say how much trains and how long the examples are (for seq_len)
        what = (f"{index['num_documents']:,} {index['data_format']} examples, {index['loss_tokens']:,} of the tokens train; "
                f"median {index['examples']['median_tokens']:,} tokens, longest {index['examples']['max_tokens']:,}")
    print(f"wrote {index['num_tokens']:,} tokens ({what}, {len(index['shards'])} shards, "
          f"{index['tokenizer']} tokenizer of {index['vocab_size']:,}) to {args.out}")
    return 0


def _export(args) -> int:
    from workbench.export import export_hf

    print(f"wrote {export_hf(args.checkpoint, args.out)}")
    return 0


def _sample(args) -> int:
    from workbench.sample import sample

    print(sample(args.checkpoint, args.prompt, args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, seed=args.seed))
    return 0


_COMMANDS = {"run": _run, "validate": _validate, "memory": _memory, "plan": _plan, "dispatch": _dispatch,
             "data": _data, "export": _export, "sample": _sample, "import": _import,
             "export-config": _export_config, "calibrate": _calibrate}

if __name__ == "__main__":
    sys.exit(main())
