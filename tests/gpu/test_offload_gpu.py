"""actor.offload_during_rollout on a GPU (skipped without CUDA): device memory really drops by the bytes
the offload reports, the host copies are pinned, and the onload brings the same bytes back into the same
tensors with the allocation back where it was. One process, NCCL world of one, bf16 (TE spec where
Transformer Engine is installed, else the local spec), with and without the distributed optimizer.

A ~60M-parameter Qwen2 shape (hidden 1024, 4 layers), so that the state is ~1 GB of large blocks:
the tiny test model's 1.5 MB would sit in the caching allocator's shared 2 MB segments, where neither
the drop nor its release to the driver can be told apart from the rest.

Bounds: memory_allocated counts allocator blocks, which round each request up (to 512 bytes, and a
large-pool block may keep an unsplit remainder under 1 MiB), so the drop is the reported bytes plus at
most 1 MiB per storage moved. The CPU side of the same checks, bitwise training equality included, is
tests/unit/test_offload.py.
"""

import dataclasses
import importlib.util

import pytest
import torch

from megatron_dapo.config import ActorConfig, ModelConfig
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = pytest.mark.gpu
MIB = 1 << 20
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4)


def _actor(dist_opt: bool, weights: bool):
    from megatron_dapo.mcore.actor import MegatronActor

    impl = "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"
    cfg = tiny_cfg(dist_opt=dist_opt, budget=64, micro_batch_size=8)
    cfg = dataclasses.replace(cfg, model=ModelConfig(make_vocab_size_divisible_by=64, dtype="bf16",
                                                     transformer_impl=impl),
                              actor=ActorConfig(offload_during_rollout=True, offload_weights=weights))
    return MegatronActor(cfg, tiny_hf_config(**SHAPE))


def _state(actor) -> list[torch.Tensor]:
    """Host copies of the weights, the fp32 main params and the Adam moments, in a fixed order."""
    out = [p.detach().cpu() for p in actor.model[0].parameters()]
    for o in actor.optimizer.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().cpu())
                out += [v.detach().cpu() for v in o.optimizer.state.get(p, {}).values()]
    return out


@pytest.mark.parametrize("weights", [False, True], ids=["state", "state+weights"])
@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp", "dist-opt"])
def test_device_memory_drops_by_the_bytes_moved_and_comes_back(world_of_one, dist_opt, weights):
    actor = _actor(dist_opt, weights)
    xs = with_actor_log_probs(actor, make_samples(0), seed=1)
    actor.get_loss_and_metrics(xs[:4])  # Adam's state exists from here on
    torch.cuda.synchronize()
    before = _state(actor)
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    off = actor.offloader
    stats = off.offload()
    dropped = allocated - torch.cuda.memory_allocated()
    slack = stats.num_storages * MIB
    n = sum(p.numel() for p in actor.model[0].parameters())
    # Per parameter (DP = 1): bf16 weights 2 B, fp32 grads 4 B, fp32 main params + Adam m, v 12 B; DDP pads
    # its buffers (the distributed optimizer's param buffer too) by a little.
    assert 4 * n <= stats.grad_bytes < 4 * n + MIB and stats.optimizer_bytes == 12 * n, (n, stats)
    assert (2 * n <= stats.weight_bytes < 2 * n + MIB) if weights else stats.weight_bytes == 0, (n, stats)
    assert stats.device_bytes <= dropped <= stats.device_bytes + slack, (dropped, stats)
    # empty_cache gave the memory back to the driver (what vLLM allocates from): most of it, as 1-10 MB
    # blocks share 20 MB segments with tensors that stay (the weights, when they stay).
    assert reserved - torch.cuda.memory_reserved() >= 0.75 * stats.device_bytes, (reserved, stats)
    assert off.host_pinned and stats.copied_bytes == stats.optimizer_bytes + stats.weight_bytes
    print(f"\noffload {stats.device_bytes / 1e9:.3f} GB in {stats.seconds * 1e3:.1f} ms "
          f"({stats.copied_bytes / stats.seconds / 1e9:.1f} GB/s copied), dropped {dropped / 1e9:.3f} GB")

    back = off.onload()
    assert abs(torch.cuda.memory_allocated() - allocated) <= slack
    print(f"onload {back.seconds * 1e3:.1f} ms ({back.copied_bytes / back.seconds / 1e9:.1f} GB/s)")
    after = _state(actor)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.count_nonzero(b.grad_data) == 0 for b in actor.model[0].buffers)  # released: zeros
    m = actor.get_loss_and_metrics(xs[4:])  # training goes on on the re-allocated buffers
    assert torch.isfinite(torch.tensor(m["actor/grad_norm"]))


def test_metric_and_idempotence(world_of_one):
    actor = _actor(dist_opt=True, weights=False)
    gb = actor.offload_for_rollout()["actor/offloaded_gb"]
    assert gb > 0.2  # before the first update: fp32 grads and main params (~60M x 8 B)
    low = torch.cuda.memory_allocated()
    # a second offload moves nothing and reports what is held off (actor.offload_for_rollout)
    assert actor.offload_for_rollout()["actor/offloaded_gb"] == gb and torch.cuda.memory_allocated() == low
    actor.onload_after_rollout()
    actor.onload_after_rollout()
    assert torch.cuda.memory_allocated() >= low + gb * 1e9
