"""Bad input ends as one line naming the problem and the fix, exit code 2, before any model is built,
and the run directory stays untouched. Each case is a real `megatron-dapo` command
(in-process through cli.main, so one interpreter serves them all; one case also as a subprocess to
show that the whole stderr is that one line)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo import cli
from megatron_dapo.config import ToyConfig
from megatron_dapo.toy import task as toy_task
from tests.helpers.records import records

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
            warmup_steps=1, num_train=40, num_val=8)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF dir (the toy base, barely warmed up) and good and bad data files."""
    from megatron_dapo.toy.base import make_toy_base

    d = tmp_path_factory.mktemp("inputs")
    hf = make_toy_base(d / "hf", seed=0, cfg=ToyConfig(**TINY))
    train, val = toy_task.make_splits(seed=0, num_train=40, num_val=8, num_digits=5)
    files = {"hf": hf, "train": toy_task.write_parquet(train, d / "train.parquet"),
             "val": toy_task.write_parquet(val, d / "val.parquet")}
    (d / "bad.jsonl").write_text(json.dumps(train[0]) + "\n{not json\n")
    (d / "empty.jsonl").write_text("")
    (d / "zero_bytes.parquet").write_bytes(b"")
    pq.write_table(pa.Table.from_pylist(train[:1]).slice(0, 0), d / "zero_rows.parquet")
    pq.write_table(pa.table({"question": ["1+1?"], "label": [2]}), d / "schema.parquet")
    (d / "all_bad.jsonl").write_text("".join(json.dumps({"problem": "x", "answer": 1.5}) + "\n" for _ in range(3)))
    files.update({k: d / f for k, f in (("bad_jsonl", "bad.jsonl"), ("empty", "empty.jsonl"),
                                         ("zero_bytes", "zero_bytes.parquet"), ("zero_rows", "zero_rows.parquet"),
                                         ("schema", "schema.parquet"), ("all_bad", "all_bad.jsonl"))})
    return files


def _train(capsys, run_dir: Path, *overrides: str) -> tuple[int, str]:
    rc = cli.main(["train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"), f"logging.dir={run_dir}",
                   "logging.tensorboard=false", *overrides])
    return rc, capsys.readouterr().err


def _real_run(inputs, **files) -> list[str]:
    data = {"train": inputs["train"], "val": inputs["val"], **files}
    return ["toy.enable=false", f"model.hf_path={inputs['hf']}", f"data.train_files=[{data['train']}]",
            f"data.val_files=[{data['val']}]"]


CASES = {  # name -> (file overrides, expected message part)
    "missing train file": (dict(train="/nonexistent/train.parquet"), "prompt file not found: "
                           "/nonexistent/train.parquet"),
    "wrong parquet schema": (dict(train="schema"), "schema.parquet: no 'prompt' or 'problem' column"),
    "malformed JSONL": (dict(train="bad_jsonl"), "bad.jsonl: line 2: field '<line>': invalid JSON"),
    "empty file": (dict(train="empty"), "data.train_files=" ),
    "0-row parquet": (dict(train="zero_rows"), "no usable prompts (0 rows)"),
    "all rows skipped": (dict(train="all_bad"), "no usable prompts (3 rows, 3 skipped as bad: bad_ground_truth 3); "
                         "point data.train_files at a DAPO-format"),
    "0-byte parquet": (dict(train="zero_bytes"), "zero_bytes.parquet: not a readable parquet file"),
    "empty eval file": (dict(val="zero_rows"), "data.val_files="),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_data_is_one_line_and_touches_nothing(inputs, tmp_path, capsys, name):
    files, expected = CASES[name]
    files = {k: inputs.get(v, v) for k, v in files.items()}
    run_dir = tmp_path / "run"
    extra = ["data.on_bad_row=skip"] if name == "all rows skipped" else []
    rc, err = _train(capsys, run_dir, *_real_run(inputs, **files), *extra)
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("megatron-dapo: error: ") and expected in line, err
    assert "Traceback" not in err
    assert not run_dir.exists(), list(run_dir.rglob("*"))


def test_no_training_files_is_one_line(tmp_path, capsys, inputs):
    """data.train_files=[] (the schema's default) is named with its fix, not a traceback from the loader."""
    rc, err = _train(capsys, tmp_path / "run", *_real_run(inputs), "data.train_files=[]")
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("megatron-dapo: error: data.train_files is empty: give it a "
                                                   "DAPO-format parquet or JSONL file"), err
    assert not (tmp_path / "run").exists()


def test_missing_hf_dir(tmp_path, capsys, inputs):
    rc, err = _train(capsys, tmp_path / "run", *_real_run(inputs), f"model.hf_path={tmp_path / 'nope'}")
    assert rc == 2 and f"model.hf_path={tmp_path / 'nope'}: no config.json there" in err
    assert not (tmp_path / "run").exists()


def test_missing_start_checkpoint(tmp_path, capsys, inputs):
    """A typo in model.checkpoint must not start training from random weights."""
    rc, err = _train(capsys, tmp_path / "run", *_real_run(inputs), f"model.checkpoint={tmp_path / 'ckpt'}")
    assert rc == 2 and f"model.checkpoint={tmp_path / 'ckpt'}: no checkpoint there" in err
    assert not (tmp_path / "run").exists()


def test_missing_config_file(tmp_path, capsys):
    rc = cli.main(["train", "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert rc == 2 and "nope.yaml" in err and "Traceback" not in err, err


def test_toy_size_change_is_refused(tmp_path, capsys):
    """A run dir made with one toy model refuses another size instead of training the old one."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.toy.bootstrap import materialise

    run_dir = tmp_path / "run"
    toy = [f"toy.{k}={v}" for k, v in TINY.items()]
    cfg = load_config(ROOT / "conf" / "cpu_tiny.yaml", [f"logging.dir={run_dir}", *toy])
    materialise(cfg, run_dir, rank=0)  # the first run's toy task and base
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    rc, err = _train(capsys, run_dir, *toy, "toy.hidden_size=48")
    assert rc == 2
    assert "made with other toy settings (hidden_size 32 -> 48;" in err.strip().splitlines()[-1], err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_score_responses_names_the_bad_line(tmp_path, capsys):
    path = tmp_path / "responses.jsonl"
    path.write_text(json.dumps({"response": "Answer: 4", "ground_truth": "4"}) + "\nnot json\n")
    rc = cli.main(["score", "--responses", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"megatron-dapo: error: {path}: line 2: not JSON" in err, err


@pytest.mark.slow
def test_a_fresh_process_prints_one_error_line(inputs, tmp_path):
    """As a user sees it: a fresh process prints one error line and no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--config", str(ROOT / "conf" / "cpu_tiny.yaml"),
           f"logging.dir={tmp_path / 'run'}", *_real_run(inputs, train=inputs["schema"])]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("megatron-dapo:")]
    assert len(errors) == 1 and "schema.parquet" in errors[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_converted_checkpoint_of_another_shape_is_one_line(inputs, tmp_path, capsys):
    """model.checkpoint converted from a wider model would end in a 71-line CheckpointingException from
    megatron's loader: its hf/config.json is checked against model.hf_path up front."""
    from megatron_dapo.toy.base import make_toy_base

    wide = make_toy_base(tmp_path / "wide", seed=0, cfg=ToyConfig(**{**TINY, "hidden_size": 48}))
    ckpt = tmp_path / "converted"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt" / "hf_to_megatron.py"), "--hf-dir",
                           str(wide), "--out", str(ckpt), "--no-progress"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rc, err = _train(capsys, tmp_path / "run", *_real_run(inputs), f"model.checkpoint={ckpt}")
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err
    assert f"checkpoint {ckpt} holds another model shape (hidden_size 48 -> 32" in line, line
    assert "tools/convert_ckpt/hf_to_megatron.py" in line and not (tmp_path / "run").exists()


def _with_vocabulary(hf: Path, out: Path, *, extra_rows: int) -> Path:
    """A copy of the HF dir ``hf`` whose vocabulary has ``extra_rows`` more entries (config.json and
    the embedding alike), as a model of another tokenizer would."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, out)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] += extra_rows
    (out / "config.json").write_text(json.dumps(config))
    for file in out.glob("*.safetensors"):
        tensors = load_file(file)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = torch.cat([tensors[name], tensors[name][:extra_rows].clone()])
        save_file(tensors, file, metadata={"format": "pt"})
    return out


def test_resuming_under_a_model_of_another_vocabulary_is_one_line(inputs, tmp_path, capsys):
    """A run's model.hf_path switched to a model of another vocab_size, same run directory: refused in one
    line naming the vocabulary, before megatron is built (not a traceback that blames
    make_vocab_size_divisible_by and TP, which the changed model did not touch). Its own model still resumes."""
    run_dir = tmp_path / "run"
    one_step = [*_real_run(inputs), "checkpoint.save_every=1", "eval.every=0", "eval.n=1", "rollout.n=2",
                "data.prompts_per_step=4", "train.mini_batch_prompts=4", "algorithm.filter_groups.enable=false"]
    rc, err = _train(capsys, run_dir, *one_step, "train.total_steps=1")
    assert rc == 0, err[-3000:]
    wider = _with_vocabulary(inputs["hf"], tmp_path / "wider", extra_rows=128)  # 140 -> 268: 256 -> 384 padded
    rc, err = _train(capsys, run_dir, *one_step, f"model.hf_path={wider}", "train.total_steps=2")
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err[-3000:]
    assert line == (f"megatron-dapo: error: checkpoint {run_dir / 'checkpoints' / 'step_00000001'} holds another "
                    "model shape (vocab_size 140 -> 268; checkpoint -> this run's model): resume with the model it "
                    "was trained with, or start a new logging.dir"), line
    rc, err = _train(capsys, run_dir, *one_step, "train.total_steps=2")
    steps_logged = [r["step"] for r in records(run_dir)]
    assert rc == 0 and steps_logged == [0, 1, 2], (steps_logged, err[-3000:])  # each step once: resumed


def test_a_layout_that_cannot_run_is_refused_before_any_data_is_read(inputs, tmp_path, capsys):
    """A 1-layer model cannot split into 2 pipeline stages: that is the error, although the train file
    is missing too, which only reading the data finds (tokenizing all of it took 26 s on every rank
    of a real launch before the layout failed)."""
    rc, err = _train(capsys, tmp_path / "run", *_real_run(inputs, train="/nonexistent/train.parquet"),
                     "parallel.pipeline_model_parallel_size=2")
    assert rc == 2 and "pipeline" in err.strip().splitlines()[-1], err
    assert "prompt file not found" not in err and "Kept" not in err
