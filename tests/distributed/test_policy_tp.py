"""Tensor parallelism (TP=2, with and without sequence parallelism) equals one process (TP=1).

Each of the 2 gloo ranks first builds the TP=1 model (DP=2, both ranks redundant), records its
weights, log-probs, entropy, DAPO loss and gradients, then rebuilds the parallel state at TP=2,
loads the same weights sharded by hand (tests/distributed/harness.py) and compares everything to
fp32 round-off, once from the vocab-parallel logits and once through the fused output-layer path
(GPTModel's output_processor hook, no logits tensor). The vocabulary (120) is padded
to 128 rows at TP=1 and TP=2, so the padding mask of the log-probs is exercised too.
"""

import pytest
import torch

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.mcore import build_model, destroy_parallel, initialize_parallel, vocab_parallel_logprobs
from megatron_dapo.mcore.logprobs import logprobs_output_processor
from tests.distributed.harness import assert_close, full_params, load_full, make_batch, shard, spawn
from tests.helpers.policy import VOCAB, tiny_hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
MODEL = ModelConfig(make_vocab_size_divisible_by=16)  # 120 -> 128 rows at TP=1 and TP=2
TEMPERATURE = 0.8


def step(model, batch, tp_group, old_log_probs=None, backward=True, fused=False):
    """Forward, log-probs, entropy, DAPO loss (global token count) - 0.01 entropy, backward.
    fused: log-probs from the hidden states through GPTModel's output_processor hook."""
    model.zero_grad(set_to_none=True)
    if fused:
        lp, ent = model(batch["ids"], batch["pos"], None, output_processor=logprobs_output_processor(
            batch["targets"], temperature=TEMPERATURE, valid_vocab_size=VOCAB, chunk_tokens=7))
        logits = torch.empty(0)
    else:
        logits = model(batch["ids"], batch["pos"], None)  # [b, s, V/TP], vocab-parallel
        lp, ent = vocab_parallel_logprobs(logits, batch["targets"], temperature=TEMPERATURE,
                                          tp_group=tp_group, valid_vocab_size=VOCAB, chunk_tokens=7)
    if old_log_probs is None:  # a stale policy: ratios spread over the clip range
        old_log_probs = lp.detach() + batch["noise"]
    mask = batch["mask"]
    loss, _ = compute_policy_loss(lp, old_log_probs, batch["adv"], mask, clip_ratio_low=0.2,
                                  clip_ratio_high=0.28, clip_ratio_c=10.0, global_num_tokens=mask.sum())
    total = loss - 0.01 * (ent * mask).sum() / mask.sum()  # an entropy bonus: checks its gradient
    if backward:
        total.backward()
    return dict(lp=lp.detach(), ent=ent.detach(), loss=loss.detach(), old=old_log_probs,
                logits_shape=tuple(logits.shape))


def _worker(rank, sequence_parallel):
    from megatron.core import parallel_state as ps

    hf = tiny_hf_config()
    batch = make_batch(seed=0, batch=3, seq=12)

    tp1 = ParallelConfig()
    initialize_parallel(hf, parallel=tp1, model=MODEL, seed=1)
    (ref_model,) = build_model(hf, model=MODEL, parallel=tp1)
    weights = full_params([ref_model])
    ref = step(ref_model, batch, ps.get_tensor_model_parallel_group())
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    destroy_parallel(process_group=False)

    tp2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    # Another seed: with the same seed megatron's CPU init would already produce the TP=1 weights.
    sizes = initialize_parallel(hf, parallel=tp2, model=MODEL, seed=2)
    assert sizes["padded_vocab_size"] == 128
    (model,) = build_model(hf, model=MODEL, parallel=tp2)
    group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():  # the test can fail: unloaded weights give other log-probs
        fresh = step(model, batch, group, ref["old"], backward=False)
    assert (fresh["lp"] - ref["lp"]).abs().max() > 1e-2
    load_full([model], weights, tp_rank, 2)
    for fused in (False, True):
        out = step(model, batch, group, ref["old"], fused=fused)
        what = "fused output layer: " if fused else ""
        assert fused or out["logits_shape"] == (3, 12, 64)  # half of the padded vocabulary per rank
        assert_close(out["lp"], ref["lp"], what + "log-probs")
        assert_close(out["ent"], ref["ent"], what + "entropy")
        assert_close(out["loss"], ref["loss"], what + "DAPO loss")
        for name, param in model.named_parameters():
            grad = param.grad
            if getattr(param, "sequence_parallel", False):  # norms under SP: partial sums over tokens
                grad = grad.clone()
                torch.distributed.all_reduce(grad, group=group)
            want = shard(ref_grads[name], param, name, tp_rank, 2)
            assert_close(grad, want, f"{what}grad {name}", atol=1e-6)
    if sequence_parallel:
        norms = [p for n, p in model.named_parameters() if "layernorm" in n]
        assert norms and all(p.sequence_parallel for p in norms)  # all() alone passes on no norms


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tp2_equals_tp1(sequence_parallel):
    spawn(_worker, sequence_parallel)
