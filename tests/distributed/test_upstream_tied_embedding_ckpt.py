"""A megatron-core 0.19.2 bug the trainer refuses to run into (mcore/parallel.check_training_layout).

With tied embeddings at TP > 1 x PP > 1, the distributed optimizer's checkpoint holds the embedding's
optimizer state (fp32 param, Adam moments) one row off within each TP shard, with zeros in the last
row (megatron logs "param range exceeds unpadded buffer by <hidden> elements ... data corruption"),
and a resume copies that into the weights. Found by tests/functional/test_scale_rehearsal.py: the
resumed toy generated garbage (engine/trainer log-prob mismatch 1.4e4) at every layout.

This test shows the bug as it is at the pinned version, bypassing the refusal: when it stops
reproducing (megatron fixed, or the checkpoint format changed), it fails, and the refusal can go.
The same save at TP=2 x PP=1, at TP=1 x PP=2, or untied loads back exactly (checked here too).
"""

import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import spawn
from tests.helpers.policy import hf_weights, make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _worker(rank, root, tied, tp, pp, out):
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.checkpoint import load_checkpoint

    hf = tiny_hf_config(tie_word_embeddings=tied)
    cfg = tiny_cfg(tp=tp, pp=pp, dist_opt=True)
    actor = MegatronActor(cfg, hf)
    actor.get_loss_and_metrics(with_actor_log_probs(actor, make_samples(0), seed=0))
    actor.save_checkpoint(root, {"step": 1})
    saved = hf_weights(actor)
    destroy_parallel(process_group=False)
    resumed = MegatronActor(cfg, hf)
    load_checkpoint(Path(root) / "step_00000001", model=resumed.model, load_rng=False)
    weights_only = hf_weights(resumed)
    resumed.load_checkpoint(root)
    with_optimizer = hf_weights(resumed)
    if rank == 0:
        name = "model.embed_tokens.weight"
        shifted = torch.equal(with_optimizer[name][:63], saved[name][1:64])  # row i holds row i + 1
        torch.save({"weights_only_equal": all(torch.equal(weights_only[n], saved[n]) for n in saved),
                    "equal": [n for n in saved if torch.equal(with_optimizer[n], saved[n])],
                    "names": list(saved), "shifted": shifted}, out)
    destroy_parallel(process_group=False)


def _run(tied, tp, pp, world):
    with tempfile.TemporaryDirectory() as root:
        out = Path(root) / "result.pt"
        spawn(_worker, str(Path(root) / "ckpt"), tied, tp, pp, str(out), world_size=world)
        return torch.load(out)


@pytest.mark.extended  # a check of the pinned megatron-core's bug
def test_tied_embedding_at_tp_x_pp_resumes_shifted_in_megatron_0_19_2():
    got = _run(True, 2, 2, 4)
    assert got["weights_only_equal"], "the model part of the checkpoint is right"
    assert set(got["names"]) - set(got["equal"]) == {"model.embed_tokens.weight"} and got["shifted"], (
        "megatron-core no longer shifts the tied embedding's optimizer state at TP x PP: lift the refusal in "
        "mcore/parallel.check_training_layout (and its line in docs/DESIGN.md)")


@pytest.mark.parametrize("tied,tp,pp", [(True, 2, 1), (True, 1, 2), (False, 2, 2)])
def test_the_layouts_around_it_resume_exactly(tied, tp, pp):
    got = _run(tied, tp, pp, tp * pp)
    assert got["equal"] == got["names"]
