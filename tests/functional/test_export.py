"""A trained policy out to HF (`megatron-dapo export`): a short CPU run's training checkpoint exports
at TP=1 and, under torchrun, at TP=2 (resharded on load) to the same bytes; transformers loads the
dir and its logits equal the Megatron model's on the same checkpoint; `megatron-dapo eval` on the
exported dir gives exactly the numbers it gives on the checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.demo import copy_demo_base

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
ENV = {k: v for k, v in os.environ.items()
       if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}
CLI = [sys.executable, "-m", "megatron_dapo.cli"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
            "megatron_dapo.cli"]


def _ok(cmd: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def run(demo_base, tmp_path_factory) -> Path:
    run_dir = copy_demo_base(demo_base, tmp_path_factory.mktemp("export") / "run")
    _ok([*CLI, "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"), f"logging.dir={run_dir}",
         "train.total_steps=3", "eval.every=0", "eval.before_train=false", "logging.tensorboard=false"])
    return run_dir


def _megatron_logits(run: Path, ids: torch.Tensor, out: Path) -> torch.Tensor:
    """The trained Megatron model's logits on ``ids``, in a fresh process (reference)."""
    code = f"""
import torch
from pathlib import Path
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
apply_cpu_compat()
from megatron_dapo.config_loading import load_config
from megatron_dapo.convert.safetensors_io import read_hf_config
from megatron_dapo.mcore.checkpoint import latest_checkpoint, load_checkpoint
from megatron_dapo.mcore.logit_check import megatron_logits
from megatron_dapo.mcore.model import build_model
from megatron_dapo.mcore.parallel import initialize_parallel
cfg = load_config("{run / 'config.yaml'}")
hf = read_hf_config("{run / 'toy_base'}")
initialize_parallel(hf, parallel=cfg.parallel, model=cfg.model, seed=0)
chunks = build_model(hf, model=cfg.model, parallel=cfg.parallel)
load_checkpoint(latest_checkpoint("{run / 'checkpoints'}"), model=chunks, load_rng=False)
torch.save(megatron_logits(chunks, torch.load("{out}.ids"), None), "{out}")
from megatron_dapo.mcore.parallel import destroy_parallel
destroy_parallel()  # gloo left alive can abort the interpreter at exit
"""
    torch.save(ids, f"{out}.ids")
    _ok([sys.executable, "-c", code])
    return torch.load(out)


def test_export_at_any_tp_loads_in_transformers_with_the_trainers_logits(run, tmp_path):
    config = str(run / "config.yaml")
    out1 = _ok([*CLI, "export", "--config", config, "--out", str(tmp_path / "tp1")])
    assert "exported" in out1.stdout and "step_00000003" in out1.stdout
    _ok([*TORCHRUN, "export", "--config", config, "parallel.tensor_model_parallel_size=2", "--out",
         str(tmp_path / "tp2")])
    one, two = ((tmp_path / "tp1" / "model.safetensors").read_bytes(),
                (tmp_path / "tp2" / "model.safetensors").read_bytes())
    assert one == two, "exported at TP=2 (resharded on load) differs from TP=1"
    meta = json.loads((tmp_path / "tp1" / "export.json").read_text())
    assert meta["step"] == 3 and meta["checkpoint"].endswith("step_00000003")
    assert not (tmp_path / "tp1" / "warmup.json").exists()  # the toy base's report is not this model's

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tp1", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "tp1")
    assert tok.chat_template and model.generation_config.eos_token_id
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = model(input_ids=ids).logits
    ref = _megatron_logits(run, ids, tmp_path / "ref.pt")[..., : model.config.vocab_size]
    diff = (hf - ref).abs().max().item()
    assert diff < 1e-4, f"max |logit difference| {diff}"
    # the export is of the trained weights, not the base: the base's logits differ
    base = AutoModelForCausalLM.from_pretrained(run / "toy_base", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (base(input_ids=ids).logits - hf).abs().max().item() > 1e-3


def test_eval_on_the_exported_dir_equals_eval_on_the_checkpoint(run, tmp_path):
    config = str(run / "config.yaml")
    _ok([*CLI, "export", "--config", config, "--out", str(tmp_path / "hf")])
    _ok([*CLI, "eval", "--config", config])
    data = run / "toy_data"
    _ok([*CLI, "eval", "--config", config, "toy.enable=false", f"model.hf_path={tmp_path / 'hf'}",
         f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
         f"logging.dir={tmp_path / 'eval_hf'}", "checkpoint.resume=never"])
    on_ckpt = json.loads((run / "eval.json").read_text())
    on_export = json.loads((tmp_path / "eval_hf" / "eval.json").read_text())
    assert on_ckpt.pop("step") == 3 and on_export.pop("step") == 0
    assert on_export == on_ckpt
    assert on_ckpt["eval/avg@4"] > 0  # a real evaluation ran
