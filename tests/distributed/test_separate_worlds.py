"""Separate placement's process groups (rollout/worlds.py) and weight stream (rollout/weight_stream.py), in 4 processes:
ranks 0-1 train (megatron at DP=2 in a default world of their own), ranks 2-3 hold HF engines (a
default world of 2), and trainer rank 0 streams the trained weights to both engines.

The reference is independent of the stream: trainer rank 0 also writes the export it sent to a
safetensors file, and each engine must then hold exactly those tensors, in a model built from the
same config.json with other random weights. The stream mixes dtypes (an fp32 model whose norms
are sent in bf16). A bucket's framing and the refused splits: tests/unit/test_rollout_worlds.py."""

import pytest
import torch

from tests.distributed.harness import spawn
from tests.helpers.policy import tiny_cfg, tiny_hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
BUCKET = 24_000  # bytes: several buckets, a tensor (the embedding) over the limit gets its own


def _mixed(weights):
    """The export with its norms in bf16: a stream of mixed dtypes."""
    for name, t in weights:
        yield name, (t.to(torch.bfloat16) if "norm" in name else t.clone())


def _worker(rank, out):
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.rollout.hf_engine import HFEngine
    from megatron_dapo.rollout.weight_stream import receive_weights, send_weights
    from megatron_dapo.rollout.worlds import split_world

    split = split_world(2)
    assert dist.get_world_size() == 2 and split.is_trainer == (rank < 2) and split.side_rank == rank % 2
    assert (split.links is None) == (rank == 1) and (split.trainers is None) == (rank >= 2)
    if split.is_trainer:
        from megatron.core import parallel_state as ps

        from megatron_dapo.mcore.actor import MegatronActor

        actor = MegatronActor(tiny_cfg(), tiny_hf_config())
        assert ps.get_data_parallel_world_size() == 2  # megatron sees the trainers only
        sent = []
        stats = send_weights(split.links, (pair for pair in _mixed(actor.export_hf_weights()) if not sent.append(pair)),
                             BUCKET)
        if rank == 0:
            save_file({n: t.contiguous() for n, t in sent}, f"{out}/sent.safetensors")
            torch.save(stats, f"{out}/sent_stats.pt")
    else:
        torch.manual_seed(100 + rank)  # other random weights than the trainer's
        model = Qwen2ForCausalLM(Qwen2Config(**tiny_hf_config()))
        engine = HFEngine(model, eos_token_ids=())
        stats = receive_weights(split.links, engine)
        torch.save((stats, {k: v.clone() for k, v in model.state_dict().items()}), f"{out}/engine{rank}.pt")
    dist.barrier()  # each side's own world: the files of this side are written
    split.close()


def test_trainers_stream_weights_to_engines_in_worlds_of_their_own(tmp_path):
    from safetensors.torch import load_file

    spawn(_worker, str(tmp_path), world_size=4, init=False)
    sent = load_file(tmp_path / "sent.safetensors")
    sent_stats = torch.load(tmp_path / "sent_stats.pt")
    assert sent_stats["num_buckets"] > 2 and {t.dtype for t in sent.values()} == {torch.float32, torch.bfloat16}
    for rank in (2, 3):
        stats, state = torch.load(tmp_path / f"engine{rank}.pt")
        assert stats == sent_stats
        assert set(sent) <= set(state)
        for name, tensor in sent.items():
            assert torch.equal(state[name], tensor.to(state[name].dtype)), (rank, name)
