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

from tests.distributed.harness import spawn
from tests.distributed.test_moe_cp import BATCHES, KEYS, _cfg
from tests.helpers.moe import assert_same_update, moe_samples, one_update, save_tiny_moe

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
            got[f"ep{ep} {case}"] = one_update(actor, hf_dir, moe_samples(BATCHES["ragged"], routes=replay))
            destroy_parallel(process_group=False)
    torch.save(got, out_dir / f"rank{rank}.pt")


def test_packed_moe_at_ep2_equals_ep1(tmp_path):
    hf_dir = save_tiny_moe(tmp_path / "hf", seed=3)
    spawn(_worker, hf_dir, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for case, replay in CASES.items():
            want, have, what = got[f"ep1 {case}"], got[f"ep2 {case}"], f"rank {rank}, {case}"
            assert_same_update(have, want, what, KEYS + (("moe/route_agreement",) if replay else ()))
