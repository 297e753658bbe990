"""The Python stages of tools/node_smoke.sh (the runner: time boxes, PASS / FAIL / SKIP lines).

    python tools/node_smoke.py versions
    python tools/node_smoke.py model --out DIR [--shape 1.5B|tiny]
    python tools/node_smoke.py data --out DIR
    python tools/node_smoke.py check-run --run DIR --log LOG --steps N [--resumed-from K]
    python tools/node_smoke.py check-separate --run DIR --steps N
    python tools/node_smoke.py report --run DIR --model DIR --log LOG ... --out report.json

Exit status: 0 pass, anything else fails (the last line, ``FAIL: ...``, says why). Nothing here
reaches the network: the model is random weights of a Qwen2.5 shape (convert/synthetic.py) with the
toy task's tokenizer (toy/tokenizer.py), the data the toy task's problems (toy/task.py) in the DAPO
parquet schema.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
MISMATCH_MAX = 1.05  # as tools/gpu_smoke.py: engine vs trainer log-probs of the same tokens, bf16
NUM_EVAL = 3  # fewer problems than the 4 rollout replicas: the case that hung vLLM's lockstep
NUM_TRAIN = 32
WORLD_SIZE = 8
# "tiny": the 1.5B config at a size a CPU test writes in a second (TP 2 and PP 2 still divide it).
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
SHAPES = ("1.5B", "tiny")
MEMORY_KEYS = {"generating": "memory/device_used_gb_generating", "training": "memory/device_used_gb_training"}
RUNNER_RE = re.compile(r"vLLM (\S+), model runner (v\d+), sleep level (\d+)")
RESUMED_RE = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_DIR_RE = re.compile(r"^step_(\d+)$")


def fail(message: str) -> SystemExit:
    return SystemExit(f"FAIL: {message}")


# -- versions ----------------------------------------------------------------------------------
def stage_versions(args) -> None:
    """gpu_smoke.py's versions check (every installed part imports against this torch), the GPUs
    one by one, and, with CUDA, Transformer Engine and vLLM must be there (the container's stack)."""
    import gpu_smoke
    import torch

    gpu_smoke.step_versions(argparse.Namespace(require=[]))
    if not torch.cuda.is_available():
        print(f"note: no CUDA device; the stages that need {WORLD_SIZE} GPUs will skip")
        return
    count = torch.cuda.device_count()
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        print(f"  gpu {i:<12} {props.name}, {props.total_memory / 2**30:.0f} GiB")
    missing = [m for m in ("transformer_engine", "vllm") if not gpu_smoke.have(m)]
    if missing:
        raise fail(f"{', '.join(missing)} not installed: the train stage needs both (run inside container/)")
    if count < WORLD_SIZE:
        print(f"note: {count} GPU(s); the train, resume and report stages need {WORLD_SIZE} and will skip")


# -- model -------------------------------------------------------------------------------------
def model_config(shape: str, tokenizer) -> dict:
    """The Qwen2.5 config of ``shape`` with the toy tokenizer's special ids (random weights)."""
    from megatron_dapo.convert.synthetic import QWEN25_CONFIGS
    from megatron_dapo.toy.base import stop_token_ids

    config = {**QWEN25_CONFIGS["1.5B"], **(TINY if shape == "tiny" else {})}
    config.update(bos_token_id=None, eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    return config


def stage_model(args) -> None:
    """An HF dir a run reads: random bf16 weights of ``--shape``, the toy tokenizer (~140 tokens: the
    model's vocabulary is larger, which read_hf_dir allows), generation_config.json's stop ids.
    A complete dir of the same shape is reused (the marker ``.node_smoke``)."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.convert.synthetic import write_random_hf_checkpoint
    from megatron_dapo.hf_dir import read_hf_dir
    from megatron_dapo.toy.tokenizer import save_toy_tokenizer

    out = Path(args.out)
    marker = out / ".node_smoke"
    if marker.is_file() and json.loads(marker.read_text()).get("shape") == args.shape:
        print(f"  reused {out} ({args.shape} shape, written before)")
        return
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_toy_tokenizer(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    config = model_config(args.shape, tokenizer)
    nbytes = write_random_hf_checkpoint(config, tmp, dtype=torch.bfloat16)
    gen = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"], "bos_token_id": None}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    read_hf_dir(tmp, weights=True)  # what the trainer checks at the door
    (tmp / ".node_smoke").write_text(json.dumps({"shape": args.shape, "bytes": nbytes}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"  {out}: Qwen2.5-{args.shape} shape ({config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, vocabulary {config['vocab_size']}), random bf16 weights "
          f"{nbytes / 1e9:.2f} GB, toy tokenizer ({len(tokenizer)} tokens)")


# -- data --------------------------------------------------------------------------------------
def stage_data(args) -> None:
    """train.parquet and eval.parquet (exactly NUM_EVAL problems) in the DAPO schema, read back
    with the trainer's own loader."""
    from megatron_dapo.data.loading import load_prompts
    from megatron_dapo.toy import task

    out = Path(args.out)
    train, val = task.make_splits(seed=1, num_train=NUM_TRAIN, num_val=NUM_EVAL, num_digits=5)
    paths = {"train": task.write_parquet(train, out / "train.parquet"),
             "eval": task.write_parquet(val, out / "eval.parquet")}
    counts = {}
    for name, path in paths.items():
        counts[name] = len(load_prompts(path).records)
        print(f"  {path}: {counts[name]} problems")
    if counts["eval"] != NUM_EVAL:
        raise fail(f"{paths['eval']} loads as {counts['eval']} problems, not {NUM_EVAL}")
    print(f"  {counts['train']} train and {counts['eval']} eval problems (DAPO schema) in {out}")


# -- check-run ---------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict]:
    """metrics.jsonl's records (a line cut short by a crash is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def trained_steps(records: list[dict]) -> dict[int, dict]:
    """{step: its record} of the steps that trained (eval-only records, step 0, excluded)."""
    return {r["step"]: r for r in records if "actor/pg_loss" in r}


def check_run(run: Path, log_text: str, steps: int, resumed_from: int | None = None) -> list[str]:
    """What a finished run of ``steps`` steps must show; the problems (empty: it passed)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return [f"{metrics} was not written"]
    records = read_records(metrics)
    problems = []
    got = sorted(trained_steps(records))
    if got != list(range(1, steps + 1)):
        problems.append(f"steps trained {got}, wanted 1..{steps}")
    if not any(r.get("step") == 0 and any(k.startswith("eval/") for k in r) for r in records):
        problems.append("no evaluation at step 0 (eval.before_train)")
    ckpts = run / "checkpoints"
    saved = sorted(int(m.group(1)) for p in (ckpts.iterdir() if ckpts.is_dir() else ())
                   if (m := STEP_DIR_RE.match(p.name)) and p.is_dir())
    if steps not in saved:
        problems.append(f"no checkpoint of step {steps} in {ckpts} (saved: {saved})")
    if resumed_from is not None:
        resumed = [int(m.group(2)) for m in RESUMED_RE.finditer(log_text)]
        if resumed_from not in resumed:
            problems.append(f"the log has no 'resumed from ... at step {resumed_from}' (found: {resumed})")
    return problems


def stage_check_run(args) -> None:
    log = Path(args.log)
    problems = check_run(Path(args.run), log.read_text(errors="replace") if log.is_file() else "", args.steps,
                         args.resumed_from)
    if problems:
        raise fail("; ".join(problems))
    resumed = f", resumed from step {args.resumed_from}" if args.resumed_from is not None else ""
    print(f"  {args.steps} step(s) trained{resumed}, evaluated at step 0, checkpoint of step {args.steps} saved")


def check_separate(run: Path, steps: int) -> list[str]:
    """What the separate stage's run (staleness 1, no save) must show; the problems (empty: passed).
    Every step after the first trained on a batch generated while the step before trained (lag 1:
    its weights went to the engines after that batch), and the waits were measured."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return [f"{metrics} was not written"]
    trained = trained_steps(read_records(metrics))
    problems = []
    if sorted(trained) != list(range(1, steps + 1)):
        problems.append(f"steps trained {sorted(trained)}, wanted 1..{steps}")
    lags = {s: r.get("rollout/version_lag_max") for s, r in trained.items() if s > 1}
    if any(lag != 1 for lag in lags.values()):
        problems.append(f"rollout/version_lag_max per step {lags}, wanted 1 after the first")
    missing = [k for k in ("timing_s/trainer_waited", "timing_s/engines_idle", "timing_s/weight_sync")
               if any(k not in r for r in trained.values())]
    if missing:
        problems.append(f"records without {missing}")
    return problems


def stage_check_separate(args) -> None:
    problems = check_separate(Path(args.run), args.steps)
    if problems:
        raise fail("; ".join(problems))
    trained = trained_steps(read_records(Path(args.run) / "metrics.jsonl"))
    waited = sum(r["timing_s/trainer_waited"] for r in trained.values())
    total = sum(r["timing_s/step"] for r in trained.values() if "timing_s/step" in r)
    print(f"  {args.steps} steps at staleness 1, lag 1 after the first; trainer rank 0 waited {waited:.0f} s of "
          f"{total:.0f} s")


# -- report ------------------------------------------------------------------------------------
def vllm_runners(logs: dict[str, str]) -> dict[str, list[dict]]:
    """{log name: the distinct 'vLLM <version>, model runner vN, sleep level N' lines in it}."""
    out = {}
    for name, text in logs.items():
        seen = sorted({m.groups() for m in RUNNER_RE.finditer(text)})
        out[name] = [{"vllm": v, "model_runner": r, "sleep_level": int(s)} for v, r, s in seen]
    return out


def planned_peaks(run: Path, model: Path, world_size: int, capacity_gb: float | None) -> dict:
    """The memory plan's two peaks for the run's resolved config (run/config.yaml). Imported here:
    a change in memory_plan.py breaks only the report."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.memory_plan import plan

    cfg = load_config(run / "config.yaml")
    hf = json.loads((model / "config.json").read_text())
    result = plan(cfg, hf, world_size, capacity_gb=capacity_gb)
    return {"generating": result.generating_gb, "training": result.training_gb, "capacity_gb": result.capacity_gb}


def build_report(run: Path, model: Path, logs: dict[str, str], *, world_size: int, capacity_gb: float | None
                 ) -> tuple[dict, list[str]]:
    """(the report, the problems that fail the stage)."""
    metrics = run / "metrics.jsonl"
    problems: list[str] = []
    records = read_records(metrics) if metrics.is_file() else []
    if not metrics.is_file():
        problems.append(f"{metrics} was not written")
    steps = trained_steps(records)
    if metrics.is_file() and not steps:
        problems.append("no step trained")
    runners = vllm_runners(logs)
    try:
        plan_gb = planned_peaks(run, model, world_size, capacity_gb)
    except Exception as e:  # noqa: BLE001 - the report still says everything else
        plan_gb = {"error": f"{type(e).__name__}: {e}"}
        problems.append(f"the memory plan failed: {plan_gb['error']}")
    per_step = {}
    for step, r in sorted(steps.items()):
        mismatch = r.get("rollout/logprob_mismatch")
        if not (isinstance(mismatch, (int, float)) and math.isfinite(mismatch) and mismatch <= MISMATCH_MAX):
            problems.append(f"step {step}: rollout/logprob_mismatch={mismatch} (want <= {MISMATCH_MAX})")
        memory = {}
        for phase, key in MEMORY_KEYS.items():
            used = r.get(key)
            planned = plan_gb.get(phase)
            memory[phase] = {"used_gb": used if isinstance(used, (int, float)) else "not logged",
                             "planned_gb": planned if planned is not None else "no plan"}
        per_step[str(step)] = {"logprob_mismatch": mismatch,
                               "timing_s": {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("timing_s/")},
                               "memory": memory}
    report = {"metrics": str(metrics), "vllm": runners, "mismatch_max": MISMATCH_MAX, "steps": per_step,
              "plan": plan_gb, "world_size": world_size, "problems": problems}
    return report, problems


def _gb(value) -> str:
    return f"{value:.2f} GB" if isinstance(value, (int, float)) else str(value)


def format_report(report: dict) -> str:
    lines = []
    for name, found in report["vllm"].items():
        text = "; ".join(f"vLLM {f['vllm']}, model runner {f['model_runner']}, sleep level {f['sleep_level']}"
                         for f in found) or "no vLLM line found"
        lines.append(f"  {name}: {text}")
    order = ["rollout", "old_log_probs", "train", "weight_sync", "eval", "step"]  # train.py's timers, in order
    found = {k for s in report["steps"].values() for k in s["timing_s"]}
    phases = [p for p in order if p in found] + sorted(found - set(order))
    lines.append(f"  {'step':>4}  {'mismatch':>8}  " + "  ".join(f"{p:>13}" for p in phases))
    for step, s in report["steps"].items():
        m = s["logprob_mismatch"]
        times = (s["timing_s"].get(p) for p in phases)
        lines.append(f"  {step:>4}  {'-' if m is None else f'{m:8.4f}':>8}  "
                     + "  ".join(f"{t:12.1f}s" if isinstance(t, (int, float)) else f"{'-':>13}" for t in times))
    for step, s in report["steps"].items():
        for phase, m in s["memory"].items():
            lines.append(f"  step {step} device memory {phase:<10} used {_gb(m['used_gb']):>10}, "
                         f"planned {_gb(m['planned_gb'])}")
    if "capacity_gb" in report["plan"]:
        lines.append(f"  plan: of {report['plan']['capacity_gb']:.0f} GB per GPU at world size {report['world_size']}")
    return "\n".join(lines)


def device_capacity_gb() -> float | None:
    """The first GPU's memory as CUDA reports it, in GB (1e9, as memory_plan.py); None without one
    (the plan's own table: an H100's)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available() else None


def stage_report(args) -> None:
    logs = {Path(p).name: (Path(p).read_text(errors="replace") if Path(p).is_file() else "") for p in args.log}
    capacity = args.gpu_memory_gb or device_capacity_gb()
    report, problems = build_report(Path(args.run), Path(args.model), logs, world_size=args.world_size,
                                    capacity_gb=capacity)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    print(f"  report: {args.out}")
    if problems:
        raise fail("; ".join(problems))
    runners = sorted({f["model_runner"] for found in report["vllm"].values() for f in found})
    print(f"  {len(report['steps'])} step(s), mismatch <= {MISMATCH_MAX}, vLLM model runner "
          f"{'/'.join(runners) or 'not found in the logs'}")


STAGES = {"versions": stage_versions, "model": stage_model, "data": stage_data, "check-run": stage_check_run,
          "check-separate": stage_check_separate, "report": stage_report}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    sub.add_parser("versions", help="python, torch, CUDA, NCCL, the GPUs; TE and vLLM import")
    p = sub.add_parser("model", help="a random-weight Qwen2.5-shaped HF dir with the toy tokenizer")
    p.add_argument("--out", required=True, help="the HF dir to write")
    p.add_argument("--shape", choices=SHAPES, default="1.5B", help="1.5B (the smoke run), tiny (tests)")
    p = sub.add_parser("data", help=f"train.parquet and eval.parquet ({NUM_EVAL} problems), DAPO schema")
    p.add_argument("--out", required=True, help="the directory to write them into")
    p = sub.add_parser("check-run", help="a finished run trained every step, evaluated, saved (and resumed)")
    p.add_argument("--run", required=True, help="the run's logging.dir")
    p.add_argument("--log", required=True, help="the run's console log")
    p.add_argument("--steps", type=int, required=True, help="train.total_steps of the run")
    p.add_argument("--resumed-from", type=int, help="the log must say it resumed from this step")
    p = sub.add_parser("check-separate", help="a separate-placement run at staleness 1: every step, lag 1, waits")
    p.add_argument("--run", required=True, help="the run's logging.dir")
    p.add_argument("--steps", type=int, required=True, help="train.total_steps of the run")
    p = sub.add_parser("report", help="vLLM runner, mismatch, phase times, memory vs the plan -> report.json")
    p.add_argument("--run", required=True, help="the run's logging.dir (metrics.jsonl, config.yaml)")
    p.add_argument("--model", required=True, help="model.hf_path (its config.json, for the plan)")
    p.add_argument("--log", action="append", default=[], help="a console log to search (repeatable)")
    p.add_argument("--out", required=True, help="the report.json to write")
    p.add_argument("--world-size", type=int, default=WORLD_SIZE, help="processes of the run (the plan's)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory per GPU for the plan; default: the first GPU's")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    STAGES[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
