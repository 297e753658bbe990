"""megatron's alltoall token dispatcher, the GPU's default for a mixture-of-experts model, on CPU: a tiny
Qwen3-MoE (tests/helpers/moe.py) updates at EP 2 with ``moe.token_dispatcher=alltoall`` (2 gloo processes,
DP 2; cpu_compat.py's ``stream_class`` and ``dtoh_numpy`` patches) and must give what the same update gives
at EP 1, where every rank holds every expert and no token leaves its rank.

Unlike the allgather dispatcher (tests/distributed/test_moe_packed_ep.py), alltoall sends each token to its
experts' rank alone, so the DP ranks' micro-batches keep shapes of their own: here the two ranks' shares
differ in length and in count (4 samples and 3: 2 micro-batches and 1), so one rank also runs a
micro-batch of padding only, through every MoE layer's exchange, in the update and in the log-prob pass.

Compared on every rank: every sample's log-probs, the loss, grad norm, entropy and token count, the
router's load-balancing loss, rollout routing replay's agreement, and every weight after the update;
padded rows, R3, and rows packed (each rank's packs as long as its own samples).

What fails here (tried): the log-prob pass without the DP ranks' agreement on the count of micro-batches
under EP (one rank's extra micro-batch meets no partner in the exchange: "Timed out waiting 60000ms for
send operation", after the minute this test gives a collective). Without cpu_compat's two patches the
dispatcher is not built ("torch.cuda.Stream requires CUDA support") or its exchange refuses the split
sizes (cpu_compat_check shows both).
"""

import dataclasses
import json

import pytest
import torch

from tests.distributed.harness import spawn
from tests.distributed.test_moe_cp import BATCHES, KEYS, _cfg
from tests.helpers.moe import assert_same_update, moe_samples, one_update, save_tiny_moe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SHAPES = BATCHES["ragged"] + [(3, 4)]  # 7 samples: 4 on one DP rank, 3 on the other
CASES = {"ragged": (False, False), "ragged_r3": (True, False), "ragged_packed": (False, True)}  # (R3, packed)
LAYOUTS = {"ep1": (1, "allgather"), "ep2_alltoall": (2, "alltoall")}  # (EP, dispatcher)


def _worker(rank, hf_dir, out_dir):
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor

    hf = json.loads((hf_dir / "config.json").read_text())
    got = {}
    for layout, (ep, dispatcher) in LAYOUTS.items():
        for case, (replay, packed) in CASES.items():
            cfg = _cfg(1, ep, 0.0, replay, packed)
            # a collective that waits a minute has lost its partner: fail then, not at pytest's timeout
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, token_dispatcher=dispatcher),
                                      parallel=dataclasses.replace(cfg.parallel, timeout_minutes=1.0))
            actor = MegatronActor(cfg, hf)
            config = actor.model[0].config
            assert ps.get_expert_model_parallel_world_size() == ep and ps.get_data_parallel_world_size() == 2
            assert config.moe_token_dispatcher_type == dispatcher and actor.settings.pack_sequences is packed
            got[f"{layout} {case}"] = one_update(actor, hf_dir, moe_samples(SHAPES, routes=replay))
            destroy_parallel(process_group=False)
    torch.save(got, out_dir / f"rank{rank}.pt")


def test_the_ranks_shares_differ_in_length_and_count():
    """The premise: the actor's DP split (batching.split_for_data_parallel) gives the ranks 4 and 3 samples
    (2 micro-batches of at most 3 against 1) of other total lengths."""
    from megatron_dapo.batching import split_for_data_parallel

    shares = [[SHAPES[i] for i in share] for share in split_for_data_parallel(moe_samples(SHAPES), 2)]
    assert sorted(map(len, shares)) == [3, 4]
    assert sum(p + r for p, r in shares[0]) != sum(p + r for p, r in shares[1])


def test_the_alltoall_dispatcher_at_ep2_equals_ep1(tmp_path):
    hf_dir = save_tiny_moe(tmp_path / "hf", seed=3)
    spawn(_worker, hf_dir, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for case, (replay, packed) in CASES.items():
            want, have, what = got[f"ep1 {case}"], got[f"ep2_alltoall {case}"], f"rank {rank}, {case}"
            assert len(have["log_probs"]) == len(SHAPES), what
            if not packed:  # both ranks ran 2 micro-batches (rank 0's 4 samples): rank 1 one of padding only
                assert have["metrics"]["actor/num_micro_batches"] == 2, what
            assert_same_update(have, want, what, KEYS + (("moe/route_agreement",) if replay else ()))
