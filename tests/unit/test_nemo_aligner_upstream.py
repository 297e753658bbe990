"""The NeMo-Aligner adapter's interface against the real nemo-aligner 0.7.0 source, parsed with ast
and never imported (install.sh test puts the PyPI wheel's files, --no-deps, in .venv/upstream/; an
installed nemo-aligner is used instead when there is one); these skip, saying why, when neither
exists. The adapter's pure parts and import guard: test_nemo_aligner_adapter.py; its classes on
stand-ins: test_nemo_aligner_classes.py."""

import ast
import importlib.metadata
import re
import types
from pathlib import Path

import pytest
import torch
import yaml

from megatron_dapo.integrations import nemo_aligner as na
from megatron_dapo.integrations import nemo_aligner_classes as nac
from tests.helpers.nemo_aligner_batches import MIXED, groups_and_data, rollout_batch, settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "megatron_dapo/integrations/nemo_aligner_dapo.yaml"
VENDORED = ROOT / ".venv/upstream" / f"nemo-aligner-{na.NEMO_ALIGNER_VERSION}"


# -- the interface, against the real nemo-aligner source (parsed, never imported) ---------------------

def _find_upstream():
    """(root holding nemo_aligner/, version): an installed nemo-aligner first, else install.sh's copy."""
    for where in ({}, {"path": [str(VENDORED)]}):
        for dist in importlib.metadata.distributions(name="nemo-aligner", **where):
            root = Path(dist.locate_file(""))
            if (root / "nemo_aligner/package_info.py").is_file():
                return root, dist.version
    return None, None


UPSTREAM, UPSTREAM_VERSION = _find_upstream()
needs_upstream = pytest.mark.skipif(
    UPSTREAM is None, reason=f"nemo-aligner source not found: ./install.sh test puts the {na.NEMO_ALIGNER_VERSION} "
    f"wheel's files (--no-deps, off sys.path) in {VENDORED.relative_to(ROOT)}; or install nemo-aligner")


def _source(path):
    text = (UPSTREAM / path).read_text()
    return text, ast.parse(text)


def _defs(tree):
    """{(class or None, name): FunctionDef} of a module's top-level functions and class methods."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[None, node.name] = node
        elif isinstance(node, ast.ClassDef):
            out.update({(node.name, f.name): f for f in node.body if isinstance(f, ast.FunctionDef)})
    return out


def _params(fn):
    a = fn.args
    defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
    return tuple(p.arg + ("" if d is None else "=" + ast.unparse(d)) for p, d in zip(a.args, defaults))


def _function(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


@needs_upstream
def test_upstream_signatures_and_lines_match_the_recorded_interface():
    bad = []
    for d in nac.UPSTREAM_INTERFACE:
        fn = _defs(_source(d.path)[1]).get((d.owner, d.name))
        if fn is None:
            bad.append(f"{d.path}: {d.owner}.{d.name} is gone")
            continue
        if _params(fn) != d.params:
            bad.append(f"{d.path}:{fn.lineno} {d.owner}.{d.name}{_params(fn)} != recorded {d.params}")
        if UPSTREAM_VERSION == na.NEMO_ALIGNER_VERSION and fn.lineno != d.line:
            bad.append(f"{d.path}: {d.owner}.{d.name} at line {fn.lineno}, recorded {d.line}")
    assert not bad, f"nemo-aligner {UPSTREAM_VERSION} at {UPSTREAM}:\n" + "\n".join(bad)


@needs_upstream
def test_upstream_modules_bind_the_names_the_classes_take_from_them():
    for path, names in ((nac._ACTOR, nac.UPSTREAM_ACTOR_NAMES),
                        (nac._REINFORCE, ("ReinforceTrainer", "parallel_state"))):
        tree = _source(path)[1]
        bound = {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names} | {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert set(names) <= bound, f"{path} no longer binds {sorted(set(names) - bound)}"


def _stage_keys(tree, stage):
    fwd = _function(tree, "fwd_output_and_loss_func")
    branch = next(n for n in ast.walk(fwd) if isinstance(n, ast.If)
                  and ast.unparse(n.test) == f"parallel_state.is_pipeline_{stage}_stage()")
    call = next(n for n in ast.walk(branch)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == "required_keys.update")
    return {e.value for e in call.args[0].elts}


@needs_upstream
def test_the_loss_reads_what_the_last_pipeline_stage_receives():
    tree = _source(nac._ACTOR)[1]
    last, first = _stage_keys(tree, "last"), _stage_keys(tree, "first")
    assert set(na.LOSS_BATCH_KEYS) == last - {"is_end"}  # is_end: folded into mask by the trainer hook
    assert na.batch_keys_for_stage(2, True, False) == first | {"attention_mask"}
    assert na.batch_keys_for_stage(2, False, True) == last - {"is_end"} | {"attention_mask"}
    assert na.batch_keys_for_stage(1, True, True) is None


@needs_upstream
def test_the_rollout_keys_the_hook_reads_are_produced_upstream():
    actor, reinforce = _source(nac._ACTOR)[1], _source(nac._REINFORCE)[1]
    infer = _function(actor, "infer")
    made = {k.value for n in ast.walk(infer) if isinstance(n, ast.Dict) for k in n.keys}
    run = _function(reinforce, "_run_inference")
    made |= {n.slice.value for n in ast.walk(run) if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)}
    made |= {k.value for n in ast.walk(run) if isinstance(n, ast.Dict) for k in n.keys}
    assert set(na.ROLLOUT_KEYS) <= made, sorted(set(na.ROLLOUT_KEYS) - made)
    # ReinforceRolloutBatch.chunk ignores rank and split_size: every rank holds the whole global
    # batch, which is why the hook sees complete groups and takes its own DP share afterwards.
    chunk = _defs(reinforce)["ReinforceRolloutBatch", "chunk"]
    used = {n.id for n in ast.walk(chunk) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not used & {"rank", "split_size"}, "chunk now splits the batch over DP: groups may be cut"


@needs_upstream
def test_response_mask_equals_upstream_create_mask():
    text, tree = _source("nemo_aligner/utils/ppo_utils.py")
    namespace = {"torch": torch}
    exec(ast.get_source_segment(text, _defs(tree)[None, "create_mask"]), namespace)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 6, (16,), generator=g)
    end = prompt + torch.randint(0, 9, (16,), generator=g)
    values = torch.zeros(16, int(end.max()) + 2)
    assert torch.equal(namespace["create_mask"](values, prompt, end), na.response_mask(prompt, end, values.shape[1]))


@needs_upstream
def test_upstream_normalisation_is_per_micro_batch_and_ours_is_not():
    """The PPO actor's loss is masked_mean(max(loss1, loss2), is_end_mask) per micro-batch (its own
    token count); run with the real masked_mean, its value moves with the micro-batch split while
    the global token-mean does not."""
    actor_tree = _source(nac._ACTOR)[1]
    calls = {ast.unparse(n) for n in ast.walk(_function(actor_tree, "loss_func")) if isinstance(n, ast.Call)}
    assert "masked_mean(torch.max(loss1, loss2), is_end_mask)" in calls
    text, tree = _source("nemo_aligner/utils/utils.py")
    namespace = {"torch": torch}
    exec(ast.get_source_segment(text, _defs(tree)[None, "masked_mean"]), namespace)
    data = groups_and_data(rollout_batch(**MIXED), settings())[1]
    per_token = -data["advantages"]  # ratio 1: the clipped surrogate is -A

    def upstream(m):  # mean over micro-batches of each one's token mean (the schedule's 1 / m)
        return sum(namespace["masked_mean"](p, k) for p, k in zip(per_token.tensor_split(m),
                                                                  data["mask"].tensor_split(m))) / m

    ours = (per_token * data["mask"]).sum() / data["mask"].sum()
    assert abs(upstream(1) - ours) < 1e-12
    assert abs(upstream(8) - ours) > 1e-3 and abs(upstream(2) - upstream(8)) > 1e-3


def _cfg_reads(tree, prefix, scope):
    node = scope(tree)
    reads = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == prefix}
    return reads - {"get"}


@needs_upstream
def test_the_example_config_has_every_key_upstream_reads():
    cfg = yaml.safe_load(EXAMPLE.read_text())
    trainer_reads = _cfg_reads(_source(nac._REINFORCE)[1], "self.cfg",
                               lambda t: next(n for n in t.body
                                              if isinstance(n, ast.ClassDef) and n.name == "ReinforceTrainer"))
    actor_tree = _source(nac._ACTOR)[1]
    ppo_reads = _cfg_reads(actor_tree, "self.cfg.ppo", lambda t: t)
    model_reads = _cfg_reads(actor_tree, "self.cfg", lambda t: t)
    assert trainer_reads <= set(cfg["trainer"]["dapo"]), sorted(trainer_reads - set(cfg["trainer"]["dapo"]))
    assert ppo_reads <= set(cfg["model"]["ppo"]), sorted(ppo_reads - set(cfg["model"]["ppo"]))
    assert model_reads <= set(cfg["model"]), sorted(model_reads - set(cfg["model"]))
    assert {"num_rollouts_per_prompt", "initial_policy_kl_penalty", "model_gbs"} <= trainer_reads


@needs_upstream
def test_the_example_checkpoint_name_carries_every_counter_resume_reads():
    """Resume reads the loop's counters back from the checkpoint's file name (train_script_utils'
    retrieve_custom_trainer_state_dict -> utils' extract_value_from_ckpt, 0 when absent): each one the
    REINFORCE loop keeps must be in the example's filename and come back as Lightning wrote it
    (``{k}`` -> ``k=value``). The first such resume found reinforce_optimization_step missing."""
    _, tree = _source("nemo_aligner/utils/train_script_utils.py")
    fn = next(n for n in ast.walk(tree)
              if isinstance(n, ast.FunctionDef) and n.name == "retrieve_custom_trainer_state_dict")
    keys = {kw.value.value for n in ast.walk(fn)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "extract_value_from_ckpt"
            for kw in n.keywords if kw.arg == "key"}
    keys -= {"ppo_optimization_step"}  # PPOTrainer's counter; ReinforceTrainer has none of that name
    assert keys == {"step", "consumed_samples", "epoch", "reinforce_optimization_step"}
    text, utils = _source("nemo_aligner/utils/utils.py")
    namespace = {"re": re, "logging": types.SimpleNamespace(warning=lambda *args: None)}
    exec(ast.get_source_segment(text, _defs(utils)[None, "extract_value_from_ckpt"]), namespace)
    pattern = yaml.safe_load(EXAMPLE.read_text())["exp_manager"]["checkpoint_callback_params"]["filename"]
    values = {"step": 7, "consumed_samples": 3584, "reinforce_optimization_step": 112, "epoch": 1,
              "val_rewards": 0.25}
    name = re.sub(r"\{(\w+)(?::([^}]*))?\}", lambda m: f"{m[1]}={format(values[m[1]], m[2] or '')}", pattern)
    got = {k: namespace["extract_value_from_ckpt"](key=k, ckpt_path=name + "-last") for k in keys}
    assert got == {k: values[k] for k in keys}, name
