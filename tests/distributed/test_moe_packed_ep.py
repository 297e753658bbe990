"""Packed micro-batches under expert parallelism: a tiny Qwen3-MoE (tests/helpers/moe.py) updates packed at
EP 2 (2 gloo processes, DP 2: megatron's allgather dispatcher gathers the EP ranks' tokens in every MoE
layer, so every pack has one shape on every rank, [1, the agreed length], and the ranks run as many) and
must give what the same packed update gives at EP 1 (each rank's packs as long as their samples), itself
held to the padded update by tests/unit/test_packing_train_step.py.

Compared on every rank: every sample's log-probs, the loss, grad norm, entropy and token count, the
router's load-balancing loss (each pack's padding kept out by the padding mask), rollout routing replay's
agreement (routes at each sample's offset in its pack), and every weight after the update. Ragged rows,
the DP ranks' shares of unequal lengths, so the EP 2 packs carry padding the EP 1 ones do not.

What fails here (tried): packs of each rank's own length under EP 2 (the dispatcher's gather of unequal
token counts breaks gloo), the padding mask ignored on packs (the router then balances the padding too:
the grad norm differs).
"""

import json

import pytest
import torch

from tests.distributed.harness import assert_close, spawn
from tests.distributed.test_moe_cp import BATCHES, _cfg
from tests.helpers.moe import moe_samples, save_tiny_moe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
CASES = {"ragged": False, "ragged_r3": True}  # name: R3


def _worker(rank, hf_dir, out_dir):
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    hf = json.loads((hf_dir / "config.json").read_text())
    got = {}
    for ep in (1, 2):
        for case, replay in CASES.items():
            cfg = _cfg(1, ep, 0.0, replay, packed=True)
            actor = MegatronActor(cfg, hf)
            assert ps.get_expert_model_parallel_world_size() == ep and ps.get_data_parallel_world_size() == 2
            assert actor.settings.pack_sequences
            assert actor.load_hf_weights(str(hf_dir)) > 0
            xs = moe_samples(BATCHES["ragged"], routes=replay)  # the actor gives each DP rank its share
            log_probs = actor.get_inference_log_probs(xs)
            m = actor.get_loss_and_metrics(xs)
            weights = {name: tensor.clone() for name, tensor in actor.export_hf_weights()}
            got[f"ep{ep} {case}"] = {"log_probs": log_probs, "metrics": m, "weights": weights}
            destroy_parallel(process_group=False)
    torch.save(got, out_dir / f"rank{rank}.pt")


def test_packed_moe_at_ep2_equals_ep1(tmp_path):
    hf_dir = save_tiny_moe(tmp_path / "hf", seed=3)
    spawn(_worker, hf_dir, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for case, replay in CASES.items():
            want, have, what = got[f"ep1 {case}"], got[f"ep2 {case}"], f"rank {rank}, {case}"
            for i, (a, b) in enumerate(zip(have["log_probs"], want["log_probs"], strict=True)):
                assert_close(a, b, f"{what}: log-probs of sample {i}")
            keys = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/num_tokens",
                    "moe/load_balancing_loss") + (("moe/route_agreement",) if replay else ())
            for key in keys:
                assert have["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5), (what, key)
            for name, tensor in want["weights"].items():
                assert_close(have["weights"][name], tensor, f"{what}: {name} after the update", atol=1e-5, rtol=1e-4)
