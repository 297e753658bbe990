"""Checkpoints written in the background (checkpoint.async_save; mcore/checkpoint_background.py), in
2 processes at TP=1 x DP=2 with the distributed optimizer.

* What a background write saves is the state at the write, although the trainer updates its
  weights and optimizer in place before the files are written: loaded into fresh models, weights,
  every AdamW tensor and the schedule equal those of a one-phase save of the same state, bitwise,
  and every ``.distcp`` file is byte-identical to that save's. The state after the next update is
  not what was saved.
* ``write_finished`` answers on every rank alike, and becomes true once the children are done.
* A writer that dies (rank 0's, the one rank with files to write here, as the OOM killer would
  kill it) fails the publish on every rank,
  publishes nothing and leaves the previous checkpoint as ``latest``; the next save works.
"""

import time
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import spawn
from tests.distributed.test_checkpoint_two_phase import (
    STATE, _assert_equal, _loaded, _save_kwargs, _state, _trained_actor)
from tests.helpers.policy import make_samples, with_actor_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _update(actor, seed: int) -> None:
    actor.get_loss_and_metrics(with_actor_log_probs(actor, make_samples(seed), seed=seed + 1))


def _snapshot_worker(rank, root):
    from megatron_dapo.mcore import checkpoint

    root = Path(root)
    actor = _trained_actor()
    saved_state = _state(actor)
    one = checkpoint.save_checkpoint(root / "one", 1, **_save_kwargs(actor), trainer_state=STATE, keep_last=2)
    pending = checkpoint.write_checkpoint(root / "bg", 1, **_save_kwargs(actor), background=True)
    # DP rank 0 holds every main replica (the memory-efficient gather): only it has a writer
    assert pending.background is not None and (pending.background.process is not None) == (rank == 0)
    rng = checkpoint.rng_state()
    _update(actor, 5)  # in place, while the child may still be writing
    after_update = _state(actor)
    deadline = time.monotonic() + 120
    while not checkpoint.write_finished(pending):  # collective: both ranks loop the same number of times
        assert time.monotonic() < deadline, "the background write did not end"
        time.sleep(0.01)
    bg = checkpoint.publish_checkpoint(pending, trainer_state=STATE, keep_last=2, rng=rng)
    assert sorted(p.name for p in bg.parent.iterdir()) == ["latest", bg.name]
    assert not list(bg.glob(".write_results*")), "the child's results file is removed before the publish"
    if rank == 0:
        distcp = sorted(p.name for p in one.glob("*.distcp"))
        assert distcp and distcp == sorted(p.name for p in bg.glob("*.distcp"))
        for name in distcp:
            assert (one / name).read_bytes() == (bg / name).read_bytes(), name
    loaded = {path: _loaded(path) for path in (one, bg)}
    _assert_equal(loaded[one], loaded[bg], "one phase vs background")
    _assert_equal(loaded[bg], saved_state, "background vs the state at the write")
    assert not all(torch.equal(a, b) for a, b in zip(after_update["params"], saved_state["params"])), \
        "the update changed the weights (else the snapshot proves nothing)"
    assert torch.equal(torch.load(bg / "rng" / f"rank_{rank:05d}.pt", weights_only=False)["torch"], rng["torch"])


def test_a_background_write_saves_the_state_at_the_write(tmp_path):
    spawn(_snapshot_worker, str(tmp_path))


def _killed_writer_worker(rank, root):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_dapo.mcore import checkpoint

    root = Path(root)
    actor = _trained_actor()
    checkpoint.save_checkpoint(root, 1, **_save_kwargs(actor), trainer_state=STATE, keep_last=2)
    _update(actor, 5)
    original = FileSystemWriterAsync.__dict__["write_preloaded_data_multithread"]  # the staticmethod
    if rank == 0:  # a writer that is still writing when it is killed
        FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(lambda *a, **k: time.sleep(600))
    try:
        pending = checkpoint.write_checkpoint(root, 2, **_save_kwargs(actor), background=True)
    finally:
        FileSystemWriterAsync.write_preloaded_data_multithread = original
    if rank == 0:
        pending.background.process.kill()
    with pytest.raises(RuntimeError, match="writing it in the background failed") as failed:
        checkpoint.publish_checkpoint(pending, trainer_state={"step": 2}, keep_last=2)
    if rank == 0:  # megatron names the failure on its coordinator
        assert "exited with -9 and left no results" in str(failed.value)
    with pytest.raises(ValueError, match="holds no written checkpoint"):  # never published after all
        checkpoint.publish_checkpoint(pending, trainer_state={"step": 2}, keep_last=2)
    torch.distributed.barrier()
    assert checkpoint.latest_checkpoint(root) == root / "step_00000001"
    assert (root / "step_00000002.tmp").is_dir() and not (root / "step_00000002").exists()
    again = checkpoint.write_checkpoint(root, 2, **_save_kwargs(actor), background=True)
    assert checkpoint.publish_checkpoint(again, trainer_state={"step": 2}, keep_last=2) == root / "step_00000002"
    assert checkpoint.latest_checkpoint(root) == root / "step_00000002"


def test_a_killed_writer_fails_the_publish_on_every_rank_and_publishes_nothing(tmp_path):
    spawn(_killed_writer_worker, str(tmp_path))
