"""checkpoint.async_save on a GPU (skipped without CUDA): the background write's preload copies the
device tensors to host memory before the fork, so what is written is the state at the write although
the next update changes the device tensors while the child writes. One process, NCCL world of one,
bf16 (TE spec where Transformer Engine is installed, else the local spec), distributed optimizer.

Not run on the CPU CI; its CPU counterpart (2 processes, bitwise against a one-phase save and its
files) is tests/distributed/test_checkpoint_background.py.
"""

import dataclasses
import importlib.util
import time

import pytest
import torch

from megatron_dapo.config import ModelConfig
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = pytest.mark.gpu
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4)


def _actor(initialize: bool = True):
    from megatron_dapo.mcore.actor import MegatronActor

    impl = "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"
    cfg = tiny_cfg(dist_opt=True, budget=64, micro_batch_size=8)
    cfg = dataclasses.replace(cfg, model=ModelConfig(make_vocab_size_divisible_by=64, dtype="bf16",
                                                     transformer_impl=impl))
    return MegatronActor(cfg, tiny_hf_config(**SHAPE), initialize=initialize)


def _weights(actor) -> list[torch.Tensor]:
    return [p.detach().cpu() for c in actor.model for p in c.parameters()]


def test_a_background_write_on_a_gpu_saves_the_state_at_the_write(world_of_one, tmp_path):
    from megatron_dapo.mcore import checkpoint

    actor = _actor()
    actor.get_loss_and_metrics(with_actor_log_probs(actor, make_samples(0), seed=1))
    at_write = _weights(actor)
    pending = actor.write_checkpoint(str(tmp_path), 1, background=True)
    assert pending.background.process is not None and pending.background.staged_s > 0
    actor.get_loss_and_metrics(with_actor_log_probs(actor, make_samples(1), seed=2))  # on the device, meanwhile
    after = _weights(actor)
    assert not all(torch.equal(a, b) for a, b in zip(at_write, after)), "the update changed nothing"
    deadline = time.monotonic() + 300
    while not checkpoint.write_finished(pending):
        assert time.monotonic() < deadline, "the background write did not end"
        time.sleep(0.05)
    actor.publish_checkpoint(pending, {"step": 1})
    fresh = _actor(initialize=False)
    assert fresh.load_checkpoint(str(tmp_path)) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), at_write))
