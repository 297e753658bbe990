"""A run directory as a command's input (run_config.py): the run's own config.yaml read where the run
lies now, and a layout fitted to the reading job, the command line's own settings kept as given."""

from pathlib import Path

import pytest

from megatron_dapo.config_loading import dump_yaml, load_config
from megatron_dapo.errors import ConfigError, InputError
from megatron_dapo.run_config import fit_to_job, load_job_config, run_config, split_run_dir

ROOT = Path(__file__).resolve().parents[2]
APART = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
         "parallel.sequence_parallel=true", "rollout.placement=separate", "rollout.num_ranks=2",
         "rollout.max_staleness=1", "rollout.tensor_parallel_size=2", "train.old_log_probs=trainer"]


def _run_dir(tmp_path: Path, *overrides: str) -> Path:
    """A directory holding what a training run writes at its start: its resolved config.yaml."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(ROOT / "conf" / "cpu_tiny.yaml", [f"logging.dir={tmp_path / 'elsewhere'}", *overrides])
    (run / "config.yaml").write_text(dump_yaml(cfg))
    return run


def test_a_run_directory_is_told_from_an_override(tmp_path):
    assert split_run_dir([str(tmp_path), "eval.n=2"]) == (tmp_path, ["eval.n=2"])
    assert split_run_dir(["eval.n=2"]) == (None, ["eval.n=2"])
    assert split_run_dir(["conf/x.yaml"]) == (None, ["conf/x.yaml"])  # load_config: it goes after --config
    assert split_run_dir([]) == (None, [])
    with pytest.raises(InputError, match=r"runs/absent: no such run directory"):
        split_run_dir(["runs/absent", "eval.n=2"])


def test_the_run_is_read_where_it_lies_now(tmp_path):
    run = _run_dir(tmp_path, "eval.n=3")
    cfg = run_config(run, ["eval.n=2"])
    assert cfg.logging.dir == str(run) and cfg.checkpoint_root == run / "checkpoints"
    assert cfg.eval.n == 2  # the command line's override, last
    dated = run.rename(tmp_path / "2024-01-01")  # a name YAML would read as a date
    assert run_config(dated).logging.dir == str(dated)


def test_a_demo_run_finds_its_own_base_and_data_where_it_lies_now(tmp_path):
    """The demo records its base and data under the logging.dir it was made in; read from another
    place they are unset, for the demo's set-up to point at the run directory's own."""
    old = tmp_path / "elsewhere"
    run = _run_dir(tmp_path, f"model.hf_path={old / 'toy_base'}",
                   f"data.train_files=[{old / 'toy_data/train.parquet'}]",
                   f"data.val_files=[{old / 'toy_data/val.parquet'}]")
    cfg = run_config(run)
    assert cfg.toy.enable and cfg.model.hf_path == "" and cfg.data.train_files == ()


def test_not_a_run_directory_is_one_line(tmp_path):
    with pytest.raises(InputError, match=r"no config.yaml in it, so not a run directory"):
        run_config(tmp_path)
    with pytest.raises(ConfigError, match=r"both a run directory .* and --config"):
        load_job_config("conf/cpu_tiny.yaml", [str(_run_dir(tmp_path))], world_size=1)


def test_a_layout_that_does_not_fit_the_job_becomes_one_process_per_model(tmp_path):
    cfg = load_config(ROOT / "conf" / "cpu_tiny.yaml", APART)
    fitted, changes = fit_to_job(cfg, 1)
    p, r = fitted.parallel, fitted.rollout
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.sequence_parallel) == (1, 1, False)
    assert (r.placement, r.num_ranks, r.max_staleness, r.tensor_parallel_size) == ("colocated", 0, 0, 1)
    assert {d.key for d in changes} == {
        "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size", "parallel.sequence_parallel",
        "rollout.placement", "rollout.num_ranks", "rollout.max_staleness", "rollout.tensor_parallel_size"}
    assert [d.line() for d in changes if d.key == "rollout.placement"][0].startswith(
        "rollout.placement: separate -> colocated (")


def test_a_layout_that_fits_and_one_given_by_hand_are_kept(tmp_path):
    cfg = load_config(ROOT / "conf" / "cpu_tiny.yaml", APART)
    fitted, changes = fit_to_job(cfg, 4)  # TP 2 x PP 2 on 4 processes; rollout TP 2 divides 4
    assert fitted.parallel == cfg.parallel and fitted.rollout.tensor_parallel_size == 2
    assert {d.key for d in changes} == {"rollout.placement", "rollout.num_ranks", "rollout.max_staleness"}
    given = load_config(ROOT / "conf" / "cpu_tiny.yaml", ["parallel.tensor_model_parallel_size=2"])
    kept, changes = fit_to_job(given, 1, given={"parallel.tensor_model_parallel_size"})
    assert kept.parallel.tensor_model_parallel_size == 2 and changes == []  # the layout check refuses it later
    run = _run_dir(tmp_path, "parallel.tensor_model_parallel_size=2")
    for spelled in ("parallel.tensor_model_parallel_size=2", "++parallel.tensor_model_parallel_size=2"):
        assert load_job_config(None, [str(run), spelled], world_size=1).parallel.tensor_model_parallel_size == 2
    assert load_job_config(None, [str(run)], world_size=1).parallel.tensor_model_parallel_size == 1


def test_expert_parallelism_that_does_not_fit_the_job_becomes_one_rank_per_model():
    cfg = load_config(ROOT / "conf" / "cpu_tiny_moe.yaml")  # EP 2, for two processes
    fitted, changes = fit_to_job(cfg, 1)
    assert fitted.parallel.expert_model_parallel_size == 1
    assert [d.key for d in changes] == ["parallel.expert_model_parallel_size"]
    assert fit_to_job(cfg, 2)[0].parallel.expert_model_parallel_size == 2  # DP 2: it fits
    at_cp2 = load_config(ROOT / "conf" / "cpu_tiny_moe.yaml", ["parallel.context_parallel_size=2"])
    assert fit_to_job(at_cp2, 2) == (at_cp2, [])  # DP 1 x CP 2: EP 2 takes the CP ranks, it fits
