"""The ``megatron-dapo`` command: one entry point, a subcommand per job."""

import argparse
import os
import signal
import sys

from megatron_dapo import ranks
from megatron_dapo.config_loading import defaults_yaml, dump_yaml, load_config
from megatron_dapo.errors import ConfigError, InputError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file (may inherit with `defaults:`); omitted: conf/base.yaml defaults")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="dotted overrides, applied last")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """A job that reads a run: the run's directory (its config.yaml) or --config, then overrides."""
    p.add_argument("--config", help="YAML file naming the run (logging.dir); instead of a run directory")
    p.add_argument("overrides", nargs="*", metavar="[RUN_DIR] key.path=value",
                   help="the run's directory (its logging.dir: the run's own config.yaml is read, the layout fitted "
                        "to this job), then dotted overrides, applied last")
    p.add_argument("--step", type=_number(int, 0), help="the checkpoint of this step; default: the newest intact one")


def cmd_config(args: argparse.Namespace) -> int:
    """Prints the resolved configuration (or, with --defaults, conf/base.yaml; with --world-size, the
    checked layout at that many processes)."""
    if args.defaults:
        sys.stdout.write(defaults_yaml())
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.world_size:
        from megatron_dapo.layout import describe_layout, model_shape

        print(describe_layout(cfg, args.world_size, *model_shape(cfg.model, args.shape)))
        return 0
    sys.stdout.write(dump_yaml(cfg))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    """Scores responses with the reward (``--responses``), or self-checks it on a data set."""
    from megatron_dapo.reward.selfcheck import run_selfcheck, score_file

    cfg = load_config(args.config, args.overrides)
    kw = dict(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    if args.responses:
        return score_file(args.responses, args.out, **kw)
    return run_selfcheck(args.data or list(cfg.data.val_files), on_bad_row=cfg.data.on_bad_row, **kw)


def cmd_plan(args: argparse.Namespace) -> int:
    """The checked layout and the per-GPU memory plan (memory_plan.py); exit 2 when it does not fit."""
    from megatron_dapo.layout import describe_layout, model_shape
    from megatron_dapo.memory_plan import plan
    from megatron_dapo.plan_checks import check_fits, check_waits
    from megatron_dapo.plan_report import format_plan

    cfg = load_config(args.config, args.overrides)
    world = args.world_size or ranks.world_size()
    hf_config, source = model_shape(cfg.model, args.shape)  # read once: the layout and the plan share it
    print(f"run directory: {cfg.logging.dir} (checkpoints: {cfg.checkpoint_root})")
    print(describe_layout(cfg, world, hf_config, source))
    result = plan(cfg, hf_config, world, gpu=args.gpu, capacity_gb=args.gpu_memory_gb, mfu=args.mfu,
                  gpus_per_node=args.gpus_per_node)
    print(format_plan(result), flush=True)
    check_fits(result, cfg)
    check_waits(result, cfg.rollout)
    return 0


def _number(kind: type, low: float, high: float | None = None):
    """An argparse type: a number in (low, high] (argparse names the flag in its error)."""
    def parse(text: str):
        value = kind(text)
        if not value > low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in ({low}, {high if high is not None else 'inf'}], got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording for non-numbers
    return parse


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from megatron_dapo.gpu_models import GPU_MODELS

    p.add_argument("--world-size", type=_number(int, 0), help="processes (GPUs) in all; default: $WORLD_SIZE or 1")
    p.add_argument("--shape", help="the model's shape when model.hf_path is not on this machine: a Qwen2.5 size (0.5B, "
                                   "1.5B, 7B, 32B), a Qwen3 dense one (Qwen3-0.6B ... Qwen3-32B) or Qwen3-30B-A3B")
    p.add_argument("--gpu", choices=sorted(GPU_MODELS), default="h100",
                   help="the GPU model: its memory as CUDA reports it, HBM bandwidth and bf16 peak "
                        "(docs/memory_plan.md)")
    p.add_argument("--gpu-memory-gb", type=_number(float, 0), default=None,
                   help="memory per GPU in GB (1e9 bytes) as CUDA would report it; wins over --gpu's")
    p.add_argument("--gpus-per-node", type=_number(int, 0), default=None,
                   help="GPUs per node for the per-node host memory; default: --gpu's server (8)")
    p.add_argument("--mfu", type=_number(float, 0, 1), default=0.3,
                   help="model FLOPs utilisation for the step-time estimate, in (0, 1]")


def cmd_train(args: argparse.Namespace) -> int:
    """DAPO training (resumes automatically from the run's latest checkpoint)."""
    if args.dry_run:
        return cmd_plan(args)
    from megatron_dapo.preemption import StopRequest

    stop = StopRequest().install()  # first: a signal during the imports and set-up is handled too
    try:
        from megatron_dapo.train import main as train_main
        from megatron_dapo.train import setup_logging

        setup_logging()
        cfg = load_config(args.config, args.overrides)
        engines = None
        if cfg.rollout.placement == "separate":
            engines = _serve_or_join(cfg, stop)
            if engines is None:  # an engine rank, done serving
                _end_megatron(args)
                return 0
        rc = train_main(cfg, stop=stop, engines=engines)
        _end_megatron(args)
        return rc
    except Exception as e:
        stop.abandon_if_stopping(e)  # a peer abandoned its step (its collective broke): exit 0 too
        raise
    finally:
        # As the process's own command the handlers stay to the end: a stop signal after the run
        # (interpreter shutdown takes seconds) would otherwise kill a finished run with rc -15
        # (benchmarks/fault_campaign.py caught one). In-process callers get theirs back.
        if not getattr(args, "process_entry", False):
            stop.restore()


def _serve_or_join(cfg, stop):
    """rollout.placement=separate: the world splits into trainer and engine ranks (rollout/worlds.py).
    An engine rank serves generations until the trainers stop it and gets None; a trainer rank gets
    its handle on the engines (rollout/separate.py ``RemoteEngines``) for ``train``, told to stop however
    the run ends."""
    import logging

    from megatron_dapo import ranks
    from megatron_dapo.rollout.engine_server import serve
    from megatron_dapo.rollout.separate import RemoteEngines
    from megatron_dapo.rollout.worlds import rank_counts, split_world
    from megatron_dapo.launch_checks import check_settings

    check_settings(cfg, rank_counts(cfg.rollout, ranks.world_size())[1])  # every rank, before any group
    split = split_world(cfg.rollout.num_ranks, tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                        timeout_minutes=cfg.parallel.timeout_minutes, wait_minutes=cfg.rollout.wait_timeout_minutes)
    if split.is_trainer:
        return RemoteEngines(split)
    logging.getLogger("megatron_dapo").setLevel(logging.NOTSET)  # each engine rank's events are its own
    logger = logging.getLogger("megatron_dapo.train")
    try:
        served = serve(split)
    except Exception as error:
        if stop.signum is None:
            raise
        # A signal's grace ran out and the trainers left mid-exchange: as they do, exit 0 (the
        # launcher requeues on 0), the checkpoint is theirs; named: it may be the engine's.
        logger.warning("engine rank %d: the trainers left after %s (%s: %s)", split.side_rank, stop.name,
                       type(error).__name__, str(error)[:300])
        served = -1
    logger.info("engine rank %d: served %d generation requests", split.side_rank, served)
    return None


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluates a run's checkpoint (the newest, or --step's) on data.val_files; no training data read."""
    from megatron_dapo.run_config import load_job_config
    from megatron_dapo.train import evaluate_run, setup_logging

    setup_logging()
    evaluate_run(load_job_config(args.config, args.overrides, world_size=ranks.world_size()), step=args.step)
    _end_megatron(args)
    return 0


def _end_megatron(args: argparse.Namespace) -> None:
    """After a run that succeeded: a process group left alive aborted the interpreter at exit in
    CI (rc -6, "terminate called without an active exception", after a complete run). Torn down
    when the process ends next (the console script) or when the run started a one-process world
    of its own (the next run starts another); a caller under torchrun that runs again keeps its
    group. Not on a failure: a peer may still be inside a collective."""
    from megatron_dapo.mcore.parallel import shutdown_distributed

    if getattr(args, "process_entry", False) or not ranks.launched():
        shutdown_distributed()


def cmd_export(args: argparse.Namespace) -> int:
    """A training checkpoint of the run -> an HF dir (mcore/run_export.py); also under torchrun."""
    from megatron_dapo.convert import ConversionError
    from megatron_dapo.mcore.run_export import export_run
    from megatron_dapo.run_config import load_job_config
    from megatron_dapo.train import setup_logging

    setup_logging()  # the settings fitted to this job, each in one line
    cfg = load_job_config(args.config, args.overrides, world_size=ranks.world_size())
    try:
        ckpt = export_run(cfg, args.out, step=args.step, dtype=args.dtype,
                          force=args.force, progress=not args.no_progress)
    except ConversionError as e:
        raise InputError(str(e)) from None
    if ranks.rank() == 0:
        print(f"exported {ckpt} -> {args.out} (HF: config, generation config, tokenizer, safetensors)", flush=True)
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    """One prompt through a DAPO step: responses, both rewards, advantages, loss shares (worked_example.py)."""
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
    from megatron_dapo.worked_example import format_example, run_example

    apply_cpu_compat()  # set-up's layout checks import megatron.core
    cfg = load_config(args.config, args.overrides)
    print(format_example(run_example(cfg, args.prompt), cfg), flush=True)
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Downloaded DAPO-Math-17K / AIME files -> deduplicated train / eval files (data/prepare.py)."""
    from megatron_dapo.data.prepare import format_report, prepare_data
    from megatron_dapo.reward.math_dapo import integer_ground_truth

    report = prepare_data(args.out, train=args.train, integer=integer_ground_truth, eval=args.eval,
                          on_bad_row=args.on_bad_row, force=args.force,
                          say=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(report, args.out), flush=True)
    return 0


def cmd_samples(args: argparse.Namespace) -> int:
    """A run's sample dumps in the terminal, filtered (observe/samples_cli.py; docs/observability.md)."""
    from megatron_dapo.observe.samples_cli import main as samples_main

    return samples_main(args)


def cmd_report(args: argparse.Namespace) -> int:
    """Writes the run's report.html from what its run dir holds (observe/report.py) and prints its path."""
    from pathlib import Path

    from megatron_dapo.observe.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise InputError(f"no run directory {run_dir} (the run's logging.dir)")
    path = write_report(run_dir)
    if path is None:  # the run dir could not be written; write_report printed why
        return 1
    print(path, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="megatron-dapo", description=__doc__)
    parser.add_argument("--version", action="version", version=f"megatron-dapo {version('megatron-dapo')}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate and print the resolved configuration")
    _add_config_args(p)
    p.add_argument("--defaults", action="store_true", help="print every key with its default and comment")
    p.add_argument("--world-size", type=_number(int, 0),
                   help="instead: check and print the layout at this many processes")
    p.add_argument("--shape", help="with --world-size: the model's shape when model.hf_path is not on this "
                                   "machine: a Qwen2.5 size (0.5B, 1.5B, 7B, 32B), a Qwen3 dense one "
                                   "(Qwen3-0.6B ... Qwen3-32B) or Qwen3-30B-A3B")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("train", help="DAPO training; also under torchrun")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the layout and memory plan, and exit")
    _add_plan_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plan", help="the layout and per-GPU memory, itemised; refuses a layout that does not fit")
    _add_config_args(p)
    _add_plan_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("eval", help="avg@n / pass@n / cons@n of a run's checkpoint on data.val_files; also under "
                                    "torchrun")
    _add_run_args(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="a run's training checkpoint -> an HF dir (any TP/PP; also under torchrun)")
    _add_run_args(p)
    p.add_argument("--out", required=True, help="output HF model dir (must be empty unless --force)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="output dtype; default: the trained weights' own")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("example", help="one prompt through a DAPO step: responses, rewards, advantages, loss shares")
    _add_config_args(p)
    p.add_argument("--prompt", type=int, default=0, help="index of the training prompt (after dedup and filtering)")
    p.set_defaults(func=cmd_example)

    p = sub.add_parser("prepare-data", help="downloaded DAPO-Math-17K / AIME files -> deduplicated train / eval files")
    p.add_argument("--train", nargs="+", required=True, help="training file(s): parquet or JSONL, DAPO schema")
    p.add_argument("--eval", nargs="+", help="evaluation file(s), e.g. the AIME-2024 parquet")
    p.add_argument("--out", required=True, help="output dir: train.parquet, eval.parquet, prepare.json")
    p.add_argument("--on-bad-row", choices=["error", "skip"], default="error",
                   help="error: stop at the first bad row (file, row, field); skip: count and drop bad rows")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("score", help="score a JSONL of responses, or self-check the reward on a data set")
    _add_config_args(p)
    p.add_argument("--data", action="append", help="data file(s) for the self-check (default: data.val_files)")
    p.add_argument("--responses", help="JSONL with 'response' and 'ground_truth' per line")
    p.add_argument("--out", help="with --responses: write each row with its score here")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("samples", help="read a run's sample dumps (samples/*.jsonl), filtered")
    p.add_argument("run_dir", help="the run's directory (logging.dir)")
    p.add_argument("--step", help="a step number, or 'all'; default: the latest step with a dump")
    p.add_argument("--where", metavar="EXPR", help="comma-separated terms, all must hold: wrong, correct, truncated, "
                   "kept, dropped, flagged, eval, train, disagree ('!' negates), or field=value, !=, >, <")
    p.add_argument("--disagree", action="store_true", help="only responses the two scorers judge differently")
    p.add_argument("--phase", choices=["train", "eval"], help="only training or evaluation responses")
    p.add_argument("--alarm", metavar="NAME", help="read the dumps of this alarm (alarm_N_NAME.jsonl) instead")
    p.add_argument("--n", type=_number(int, 0), default=10, help="show at most this many responses (default 10)")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="highlight the answer line with ANSI colour; auto: when stdout is a terminal")
    p.set_defaults(func=cmd_samples)

    p = sub.add_parser("report", help="write a run's report.html and print its path")
    p.add_argument("run_dir", help="the run's directory (logging.dir)")
    p.set_defaults(func=cmd_report)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, overrides also after a flag (`eval RUN --step 3 eval.n=8`: argparse alone
    stops taking positionals at the flag and refuses the rest)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.parse_args(argv)  # argparse's own one-line error for what it does not know
    return args


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.quiet import quiet_start_up

    quiet_start_up()
    args = parse_args(argv)
    args.process_entry = argv is None  # the console script and ``python -m`` pass none; callers do
    try:
        return args.func(args)
    except BrokenPipeError:  # `megatron-dapo samples RUN | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE  # what a shell reports for a command that SIGPIPE ended (141)
    except InputError as e:  # bad input is one line, not a traceback (errors.py)
        from megatron_dapo import ranks

        config = isinstance(e, ConfigError)
        # A config error is every rank's on a node (the same files, overrides and machine): its first
        # rank says it, so a machine-dependent one (TE without CUDA) still shows from each node that
        # meets it. Other bad input may be one rank's (its shard of a file): each rank says it.
        if not config or ranks.local_rank() == 0:
            print(f"megatron-dapo: {'config error' if config else 'error'}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
