"""Context parallelism with a mixture-of-experts model: a tiny Qwen3-MoE (tests/helpers/moe.py; 4 experts,
top-2) updates at CP 2 and at CP 2 x EP 2 (2 gloo processes; megatron takes the expert-parallel ranks from
the data- and context-parallel ones, so there the EP group is the CP group), from the same HF weights, and
must give what the same update gives at CP 1 in one process.

Reference: the CP 1 run of the same micro-batches (micro-batches of 3 samples at every layout, so the
router's per-micro-batch statistics see the same tokens), itself held to transformers' router logits by
tests/distributed/test_moe_metrics_parallel.py. Compared: every sample's log-probs, the loss, grad norm,
entropy and token count, the router's load-balancing loss and z-loss, rollout routing replay's agreement,
and every weight after the update.

Cases: ragged rows with the load-balancing loss (padding in every micro-batch: the padding mask must be
cut like the tokens), rows of one length (a multiple of 2 x CP: no padding) with a z-loss too (megatron's
z-loss under CP is a mean of each rank's mean over its positions, like sequence parallelism's, which
equals the batch's mean only when every rank holds as many real tokens: test_moe_metrics_parallel.py says
why), replayed routes (R3: each rank must replay the routes of its own positions), and ragged rows packed.

What fails here when CP is wrong for experts (each tried): the router metrics reduced over TP only, not
TP x CP (moe/load_balancing_loss is one rank's share); the filler experts R3 gives positions without an
engine route (a response's last token) numbered by the rank's own positions instead of the micro-batch's
(the load-balancing loss counts other experts: grad norm 0.037440 against 0.037424). A padding mask or
routes not cut per rank fail as shape errors.
"""

import json

import pytest
import torch

from tests.distributed.harness import spawn
from tests.helpers.moe import assert_same_update, moe_samples, one_update, save_tiny_moe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
BATCHES = {"ragged": [(3, 9), (5, 14), (2, 6), (7, 12), (4, 11), (6, 3)],  # (prompt, response)
           "even": [(4, 8)] * 6}  # 12 tokens each: no padding at CP 1 or 2
CASES = {  # name: (batch, z-loss, R3, packed)
    "ragged": ("ragged", 0.0, False, False),
    "even_z": ("even", 1e-3, False, False),
    "ragged_r3": ("ragged", 0.0, True, False),
    "ragged_packed": ("ragged", 0.0, False, True),
}
LAYOUTS = {"cp1": (1, 1, 1), "cp2": (2, 1, 2), "cp2_ep2": (2, 2, 2)}  # (CP, EP, processes)


def _cfg(cp: int, ep: int, z_loss: float, replay: bool, packed: bool):
    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, MoEConfig, OptimConfig, OverlongBufferConfig, ParallelConfig,
        RewardConfig, RolloutConfig, TrainConfig,
    )

    return DAPOConfig(
        seed=1, model=ModelConfig(make_vocab_size_divisible_by=64),
        parallel=ParallelConfig(context_parallel_size=cp, expert_model_parallel_size=ep),
        moe=MoEConfig(load_balancing="aux_loss", z_loss_coeff=z_loss, router_replay="R3" if replay else "disabled"),
        data=DataConfig(prompts_per_step=2, gen_prompts_per_batch=2, max_prompt_length=8),
        rollout=RolloutConfig(engine="hf", temperature=0.8, max_response_length=16, n=3),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=4)),
        # micro-batches of 3 samples at every layout (the router losses are per-micro-batch statistics);
        # packed: first-fit decreasing under a budget of 40 tokens, which groups the samples alike whether
        # their slots are rounded to 2 x CP or not (and every pack has one shape under EP: [1, 40])
        train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=40 if packed else 0, micro_batch_size=3,
                          pack_sequences=packed),
        optim=OptimConfig(lr=1e-3, lr_warmup_steps=0))


def _worker(rank, hf_dir, out_dir, layout):
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    cp, ep, _ = LAYOUTS[layout]
    hf = json.loads((hf_dir / "config.json").read_text())
    got = {}
    for case, (batch, z_loss, replay, packed) in CASES.items():
        actor = MegatronActor(_cfg(cp, ep, z_loss, replay, packed), hf)
        assert ps.get_context_parallel_world_size() == cp and ps.get_expert_model_parallel_world_size() == ep
        got[case] = one_update(actor, hf_dir, moe_samples(BATCHES[batch], routes=replay))
        destroy_parallel(process_group=False)
    torch.save(got, out_dir / f"{layout}_rank{rank}.pt")


KEYS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/num_tokens", "moe/load_balancing_loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cp")
    hf_dir = save_tiny_moe(root / "hf", seed=3)
    for layout, (_, _, processes) in LAYOUTS.items():
        spawn(_worker, hf_dir, root, layout, world_size=processes)
    return {layout: [torch.load(root / f"{layout}_rank{r}.pt") for r in range(processes)]
            for layout, (_, _, processes) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", ["cp2", "cp2_ep2"])
def test_moe_at_cp2_equals_cp1(runs, layout):
    ref = runs["cp1"][0]
    for rank, got in enumerate(runs[layout]):
        for case, (_, z_loss, replay, _) in CASES.items():
            what = f"{layout} rank {rank}, {case}"
            keys = KEYS + (("moe/z_loss",) if z_loss else ()) + (("moe/route_agreement",) if replay else ())
            assert_same_update(got[case], ref[case], what, keys)
