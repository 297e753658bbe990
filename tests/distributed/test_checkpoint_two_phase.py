"""Two-phase checkpoint saves (mcore/checkpoint.py: write_checkpoint, then publish_checkpoint) and
the memory-efficient gather of the distributed optimizer (checkpoint.memory_efficient_save), in 2
processes at TP=1 x DP=2, where the distributed optimizer shards its state over DP.

* A write then a publish saves what save_checkpoint saves: loaded into fresh models, the weights,
  every AdamW tensor, the lr schedule, the trainer state and every rank's RNG file are bitwise equal.
* The RNG states are the ones at publish time, not at write time: randomness drawn between the
  phases (the weight sync, the evaluation) is not replayed after a resume.
* A crash between the phases (every process ends after the write) publishes nothing: fresh
  processes resume from the previous checkpoint; their next save removes the stray ``.tmp``.
* Saved with the memory-efficient gather and without (megatron's
  ``distrib_optim_fully_reshardable_mem_efficient``), the two checkpoints load at TP=2 and at PP=2
  to the same weights and optimizer state, bitwise, and the next update from either equals the
  update the DP=2 run takes. (tests/distributed/test_policy_ckpt.py reshards the default.)
"""

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.harness import assert_close, spawn
from tests.helpers.policy import hf_weights, make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STATE = {"step": 1, "sampler": {"epoch": 0, "cursor": 8}}


def _save_kwargs(actor) -> dict:
    return dict(model=actor.model, optimizer=actor.optimizer, scheduler=actor.scheduler)


def _optimizer_state(actor) -> dict:
    """{(sub-optimizer, group, param, key): value} of the torch AdamW under megatron's optimizer."""
    out = {}
    for i, part in enumerate(actor.optimizer.chained_optimizers):
        for j, group in enumerate(part.optimizer.param_groups):
            for k, param in enumerate(group["params"]):
                for key, value in part.optimizer.state[param].items():
                    out[i, j, k, key] = value.detach().clone() if torch.is_tensor(value) else value
    return out


def _state(actor) -> dict:
    """What a load restores into the actor (this rank's shards)."""
    return dict(params=[p.detach().clone() for c in actor.model for p in c.parameters()],
                optimizer=_optimizer_state(actor), scheduler=actor.scheduler.state_dict())


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _assert_equal(x, y, f"{what}.{key}")
        elif isinstance(x, list):
            assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)), f"{what}.{key}"
        else:
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y, f"{what}.{key}"


def _same(a, b) -> bool:
    """Equal RNG states: nested dicts / tuples of tensors, numpy arrays and plain values."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _trained_actor():
    from megatron_dapo.mcore.actor import MegatronActor

    actor = MegatronActor(tiny_cfg(tp=1, dist_opt=True), tiny_hf_config())  # 2 processes: DP=2
    actor.get_loss_and_metrics(with_actor_log_probs(actor, make_samples(0), seed=1))
    return actor


def _loaded(path: Path) -> dict:
    """What a fresh actor holds after loading ``path`` (whose trainer state is STATE)."""
    from megatron_dapo.mcore.actor import MegatronActor

    fresh = MegatronActor(tiny_cfg(tp=1, dist_opt=True), tiny_hf_config(), initialize=False)
    assert fresh.load_checkpoint(str(path)) == STATE
    return _state(fresh)


def _two_phase_worker(rank, root):
    from megatron_dapo.mcore import checkpoint

    root = Path(root)
    actor = _trained_actor()
    rng = checkpoint.rng_state()
    one = checkpoint.save_checkpoint(root / "one", 1, **_save_kwargs(actor), trainer_state=STATE, keep_last=2)
    checkpoint._set_rng_state(rng)  # the same RNG for the second save
    pending = checkpoint.write_checkpoint(root / "two", 1, **_save_kwargs(actor))
    assert isinstance(pending, checkpoint.PendingCheckpoint) and pending.memory_efficient
    assert checkpoint.latest_checkpoint(root / "two") is None and not pending.final.exists()  # not published
    two = checkpoint.publish_checkpoint(pending, trainer_state=STATE, keep_last=2)
    assert two == pending.final == root / "two" / checkpoint.checkpoint_name(1)
    assert sorted(p.name for p in two.parent.iterdir()) == ["latest", two.name]
    for r in range(2):  # the RNG files as saved
        name = f"rng/rank_{r:05d}.pt"
        a, b = (torch.load(p / name, weights_only=False) for p in (one, two))
        assert _same(a, b), name
    loaded = {path: _loaded(path) for path in (one, two)}
    _assert_equal(loaded[one], loaded[two], "one phase vs two phases")
    _assert_equal(loaded[two], _state(actor), "loaded vs saved")

    # RNG at publish time: what is drawn between the phases is not drawn again after a resume.
    pending = checkpoint.write_checkpoint(root / "two", 2, **_save_kwargs(actor))
    at_write = (torch.rand(4), random.random())  # e.g. the evaluation between the phases
    checkpoint.publish_checkpoint(pending, trainer_state={"step": 2}, keep_last=2)
    after_publish = (torch.rand(4), random.random())
    assert actor.load_checkpoint(str(root / "two")) == {"step": 2}
    again = (torch.rand(4), random.random())
    assert torch.equal(again[0], after_publish[0]) and again[1] == after_publish[1]
    assert not torch.equal(again[0], at_write[0])
    with pytest.raises(ValueError, match="holds no written checkpoint"):  # published already
        checkpoint.publish_checkpoint(pending, trainer_state={"step": 2}, keep_last=2)


def test_two_phases_save_what_one_phase_saves(tmp_path):
    spawn(_two_phase_worker, str(tmp_path))


class _Crash(Exception):
    pass


def _crash_worker(rank, root, weights_file):
    from megatron_dapo.mcore import checkpoint

    actor = _trained_actor()
    checkpoint.save_checkpoint(root, 1, **_save_kwargs(actor), trainer_state=STATE, keep_last=2)
    weights = hf_weights(actor)
    if rank == 0:
        torch.save(weights, weights_file)
    actor.get_loss_and_metrics(with_actor_log_probs(actor, make_samples(1), seed=2))
    checkpoint.write_checkpoint(root, 2, **_save_kwargs(actor))
    raise _Crash("between write and publish")


def _resume_worker(rank, root, weights1):
    from megatron_dapo.mcore import checkpoint
    from megatron_dapo.mcore.actor import MegatronActor

    root = Path(root)
    actor = MegatronActor(tiny_cfg(tp=1, dist_opt=True), tiny_hf_config())
    assert actor.load_checkpoint(str(root)) == STATE  # step 1: step 2 was never published
    got = hf_weights(actor)
    assert all(torch.equal(got[n], weights1[n]) for n in weights1)
    pending = checkpoint.write_checkpoint(root, 3, **_save_kwargs(actor))
    if rank == 0:  # the write removed the crashed save's directory before writing its own
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000003.tmp"]
    torch.distributed.barrier()
    checkpoint.publish_checkpoint(pending, trainer_state={"step": 3}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000003"]


def test_crash_between_write_and_publish_publishes_nothing(tmp_path):
    from megatron_dapo.mcore.checkpoint import latest_checkpoint, list_checkpoints, why_none_usable

    root = tmp_path / "ckpt"
    with pytest.raises(Exception, match="_Crash"):  # mp.spawn: ProcessRaisedException naming it
        spawn(_crash_worker, str(root), str(tmp_path / "w1.pt"))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002.tmp"]
    assert latest_checkpoint(root) == root / "step_00000001" and why_none_usable(root) is None
    assert [step for step, _ in list_checkpoints(root)] == [1]
    spawn(_resume_worker, str(root), torch.load(tmp_path / "w1.pt"))


def _layouts_worker(rank, root):
    from megatron_dapo.mcore import checkpoint, destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    root, hf = Path(root), tiny_hf_config()
    actor = _trained_actor()
    paths = {me: checkpoint.save_checkpoint(root / str(me), 1, **_save_kwargs(actor), trainer_state=STATE,
                                            keep_last=1, memory_efficient=me) for me in (True, False)}
    assert all(checkpoint.read_meta(p)["memory_efficient_save"] is me for me, p in paths.items())
    xs2 = with_actor_log_probs(actor, make_samples(1), seed=2)
    want = dict(metrics=actor.get_loss_and_metrics(xs2), weights=hf_weights(actor))
    destroy_parallel(process_group=False)
    for parallel in (dict(tp=2), dict(pp=2)):
        loaded = {}
        for me, path in paths.items():
            # initialize: once per layout, by the first of the two actors
            resumed = MegatronActor(tiny_cfg(dist_opt=True, **parallel), hf, initialize=me)
            assert resumed.load_checkpoint(str(path)) == STATE
            loaded[me] = _state(resumed)
            if me:  # the same state (checked next): one update stands for both
                m = resumed.get_loss_and_metrics(xs2)
                for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
                    want_m = torch.tensor(want["metrics"][key])
                    assert_close(torch.tensor(m[key]), want_m, f"{parallel}: {key}")
                got = hf_weights(resumed)
                for name, tensor in want["weights"].items():
                    assert_close(got[name], tensor, f"{parallel}: {name}", atol=1e-6, rtol=1e-5)
        _assert_equal(loaded[True], loaded[False], f"memory-efficient vs plain at {parallel}")
        destroy_parallel(process_group=False)


def test_memory_efficient_and_plain_saves_load_at_new_layouts(tmp_path):
    spawn(_layouts_worker, str(tmp_path))
