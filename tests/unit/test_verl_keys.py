"""For users coming from verl: the map of verl's DAPO keys to ours (megatron_dapo/verl_keys.py) against
docs/from_verl.md and the schema, the one-line error a verl key gets, Hydra's override prefixes, and
the doc's worked translation of verl's 32B recipe (it must load, and cover what verl sets)."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from megatron_dapo.config import DAPOConfig
from megatron_dapo.config_loading import ConfigError, load_config
from megatron_dapo.verl_keys import VERL_KEYS, lookup
from tests.helpers.config_fields import leaves

DOC = Path(__file__).resolve().parents[2] / "docs" / "from_verl.md"
ROW = re.compile(r"^\| `([^`]+)` \| (?:`([^`]+)`|none) \| (.*) \|$")
TRANSLATION = "Worked translation: verl's DAPO recipe for Qwen2.5-32B"


def _section(title: str) -> str:
    """The text of the doc's ``## title`` section."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _doc_map() -> dict[str, tuple[str | None, str]]:
    rows = {}
    for line in _section("The map").splitlines():
        if line.startswith("| `"):
            m = ROW.match(line)
            assert m, f"docs/from_verl.md: a map row not of the form | `verl` | `ours` or none | note |: {line}"
            assert m.group(1) not in rows, f"docs/from_verl.md lists {m.group(1)} twice"
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def _dotted(raw: dict, prefix: str = "") -> list[str]:
    return [k for key, v in raw.items()
            for k in (_dotted(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]


def _schema_keys() -> set[str]:
    return {key for key, _, _ in leaves(DAPOConfig)}


def test_the_docs_table_is_the_modules_map():
    doc = _doc_map()
    missing = sorted(set(VERL_KEYS) - set(doc))
    extra = sorted(set(doc) - set(VERL_KEYS))
    differ = [f"{k}: doc {doc[k]} != module {VERL_KEYS[k]}" for k in sorted(set(doc) & set(VERL_KEYS))
              if doc[k] != VERL_KEYS[k]]
    assert not (missing or extra or differ), (
        f"docs/from_verl.md's map and megatron_dapo/verl_keys.py disagree:\n  missing in the doc: {missing}\n"
        f"  not in the module: {extra}\n  " + "\n  ".join(differ))


def test_every_key_of_ours_in_the_map_exists_and_no_verl_key_shadows_one():
    ours = _schema_keys()
    missing = sorted(f"{verl} -> {our}" for verl, (our, _) in VERL_KEYS.items() if our is not None and our not in ours)
    assert not missing, f"keys of ours in the verl map that the schema lacks: {missing}"
    # A verl key spelled like one of ours never reaches the hint, so the map must send it to itself.
    shadowed = sorted(verl for verl, (our, _) in VERL_KEYS.items() if verl in ours and our != verl)
    assert not shadowed, f"verl keys that are also ours but map elsewhere: {shadowed}"
    assert not [verl for verl, (_, note) in VERL_KEYS.items() if not note], "entries without a note"


def test_an_exact_entry_wins_over_the_section_that_covers_it():
    assert lookup("actor_rollout_ref.actor.fsdp_config.param_offload")[:2] == (
        "actor_rollout_ref.actor.fsdp_config.param_offload", "actor.offload_weights")
    assert lookup("actor_rollout_ref.actor.fsdp_config.fsdp_size")[:2] == (
        "actor_rollout_ref.actor.fsdp_config.*", None)
    assert lookup("critic")[0] == "critic.*"
    assert lookup("actor_rollout_ref.actor.use_torch_compile") is None


def _error(overrides: list[str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.actor.clip_ratio_high=0.28",
     "actor_rollout_ref.actor.clip_ratio_high is verl's key; ours is loss.clip_ratio_high"),
    ("data.train_batch_size=512", "data.train_batch_size is verl's key; ours is data.prompts_per_step: both count "
                                  "prompts"),
    ("data.max_response_length=20480", "ours is rollout.max_response_length"),
    ("trainer.total_training_steps=10", "ours is train.total_steps"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=32", "ours is train.mini_batch_prompts: both count prompts"),
    ("reward_model.overlong_buffer.len=4096", "ours is reward.overlong_buffer.len"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8", "ours is parallel.tensor_model_parallel_size"),
    ("algorithm.filter_groups.metric=acc", "algorithm.filter_groups.metric is verl's key, with no equivalent here: "
                                           "groups are always filtered on correctness"),
    ("actor_rollout_ref.actor.kl_loss_coef=0.0", "with no equivalent here: DAPO drops the KL term"),
    ("critic.optim.lr=1e-5", "critic.optim.lr is verl's key, with no equivalent here: no critic"),
    ("actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref is verl's section, not ours"),
    ("trainer.total_steps=3", "trainer is verl's section, not ours, and docs/from_verl.md has no entry for it; "
                              "did you mean train?"),
])
def test_a_verl_key_is_refused_in_one_line_naming_ours(override, expected):
    message = _error([override])
    assert expected in message and "docs/from_verl.md" in message, message


def test_a_verl_key_in_a_yaml_file_gets_the_same_line(tmp_path):
    (tmp_path / "verl.yaml").write_text("data:\n  prompts_per_step: 64\n"
                                        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 32\n")
    assert "actor_rollout_ref.actor.ppo_mini_batch_size is verl's key; ours is train.mini_batch_prompts" in \
        _error([], tmp_path / "verl.yaml")


def test_unknown_keys_that_are_not_verls_keep_the_did_you_mean_line():
    assert "unknown config key loss.clip_ratio_hgih; did you mean loss.clip_ratio_high" in \
        _error(["loss.clip_ratio_hgih=0.3"])
    assert "unknown config key data.foo (valid keys here:" in _error(["data.foo=1"])


def test_the_cli_says_it_in_one_line_with_exit_2(capsys):
    from megatron_dapo.cli import main

    assert main(["config", "actor_rollout_ref.rollout.n=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megatron-dapo: config error: actor_rollout_ref.rollout.n is verl's key; ours is rollout.n: "
                   "responses per prompt, the group size (docs/from_verl.md)"], err


def test_hydras_force_set_sets_and_its_delete_resets_to_the_default(tmp_path):
    assert load_config(None, ["++loss.clip_ratio_high=0.3"]).loss.clip_ratio_high == 0.3
    assert load_config(None, ["loss.clip_ratio_high=0.3", "~loss.clip_ratio_high"]).loss.clip_ratio_high == "auto"
    (tmp_path / "run.yaml").write_text("reward:\n  overlong_buffer:\n    len: 512\n    penalty_factor: 0.5\n")
    cfg = load_config(tmp_path / "run.yaml", ["~reward.overlong_buffer"])  # a whole section
    assert (cfg.reward.overlong_buffer.len, cfg.reward.overlong_buffer.penalty_factor) == (4096, 1.0)
    assert load_config(None, ["~rollout.n"]).rollout.n == 16  # nothing set: the default stays


@pytest.mark.parametrize("override, expected", [
    ("+loss.clip_ratio_high=0.3", "Hydra's + adds a key the config lacks, and every key here exists already "
                                  "(unknown keys are errors); write loss.clip_ratio_high=0.3"),
    ("+trainer.val_before_train=True", "trainer.val_before_train is verl's key; ours is eval.before_train"),
    ("+loss.clip_ratio_hgih=0.3", "unknown config key loss.clip_ratio_hgih; did you mean loss.clip_ratio_high"),
    ("++lossx.a=1", "unknown config key lossx"),
    ("~loss.clip_ratio_high=0.3", "Hydra's ~key=value (delete if equal) is not supported; write "
                                  "~loss.clip_ratio_high, which resets it to its default"),
    ("~loss.clip_ratio_hgih", "unknown config key loss.clip_ratio_hgih; did you mean loss.clip_ratio_high"),
    ("~actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.use_kl_loss is verl's key, with no equivalent"),
    ("~loss.clip_ratio_high.x", "loss.clip_ratio_high is a value, not a section"),
    ("~", "names no key"),
])
def test_hydras_other_prefixes_are_refused_with_the_spelling_to_use(override, expected):
    assert expected in _error([override])


def _verl_overrides() -> list[str]:
    """The keys of verl's 32B recipe as the doc lists them (Hydra's + stripped)."""
    block = _blocks(_section(TRANSLATION), "bash")[0]
    return [line.split("=", 1)[0].lstrip("+") for line in block.splitlines() if line.strip()]


def test_every_override_of_verls_recipe_in_the_doc_is_in_the_map():
    keys = _verl_overrides()
    assert len(keys) > 60 and "actor_rollout_ref.actor.clip_ratio_high" in keys
    unmapped = [k for k in keys if lookup(k) is None]
    assert not unmapped, f"verl keys of the worked translation that the map lacks: {unmapped}"


def test_the_translated_config_loads_and_sets_every_key_verl_sets(tmp_path):
    (block,) = _blocks(_section(TRANSLATION), "yaml")
    (tmp_path / "dapo32b.yaml").write_text(block)
    cfg = load_config(tmp_path / "dapo32b.yaml")
    assert (cfg.data.prompts_per_step, cfg.train.mini_batch_prompts, cfg.loss.clip_ratio_high) == (512, 32, 0.28)
    written = set(_dotted(yaml.safe_load(block)))
    wanted = {lookup(k)[1] for k in _verl_overrides()} - {None}
    left_out = sorted(wanted - written)
    assert not left_out, f"keys of ours the translation leaves out though verl's recipe sets them: {left_out}"


def test_the_docs_command_lines_load():
    lines = [" ".join(b.replace("\\\n", " ").split()) for b in _blocks(DOC.read_text(), "bash")]
    commands = [line for line in lines if line.startswith("megatron-dapo train --config")]
    assert commands
    for command in commands:
        words = shlex.split(command)[2:]
        config, overrides = words[1], words[2:]
        load_config(Path(__file__).resolve().parents[2] / config, overrides)
