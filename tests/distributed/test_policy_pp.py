"""Pipeline parallelism (PP=2, also interleaved with VPP=2) equals one stage, through megatron's schedules.

4 micro-batches go through ``get_forward_backward_func`` at PP=1 and at PP=2 with the same weights;
each micro-batch's DAPO loss divides by the token count of all four (global_num_tokens), and
``calculate_per_token_loss=True`` keeps the schedule from dividing by the number of micro-batches,
so the accumulated gradients are those of the whole-batch loss. PP=1 is also checked against one
forward/backward of the concatenated batch. Interleaving at PP=2 is the case that silently goes
wrong with batch_p2p_comm=True (docs/reference/megatron_on_cpu.md 3b); build_model turns it off. The tied-
embedding case exercises the embedding copy on the last stage (synchronised at construction).
"""

import functools

import pytest
import torch

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.mcore import build_model, destroy_parallel, initialize_parallel, vocab_parallel_logprobs
from tests.distributed.harness import assert_close, full_params, global_name, load_full, make_batch, spawn
from tests.helpers.policy import VOCAB, tiny_hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
MODEL = ModelConfig(make_vocab_size_divisible_by=16)  # 120 -> 128 rows at TP=1 and TP=2
NUM_MICRO, EMBED = 4, "embedding.word_embeddings.weight"


def forward_step(data_iterator, model, num_tokens):
    mb = next(data_iterator)
    output = model(mb["ids"], mb["pos"], None)  # logits on the last stage, hidden states elsewhere
    return output, functools.partial(loss_func, mb, num_tokens)


def loss_func(mb, num_tokens, logits):
    from megatron.core import parallel_state as ps
    lp, _ = vocab_parallel_logprobs(logits, mb["targets"], temperature=1.0, valid_vocab_size=VOCAB,
                                    tp_group=ps.get_tensor_model_parallel_group())
    loss, _ = compute_policy_loss(lp, mb["old"], mb["adv"], mb["mask"], clip_ratio_low=0.2,
                                  clip_ratio_high=0.28, global_num_tokens=num_tokens)
    return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach().clone()}


def run_schedule(chunks, mbs, num_tokens):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    for c in chunks:
        c.zero_grad(set_to_none=True)
    iters = [iter(mbs) for _ in chunks]
    reduced = get_forward_backward_func()(
        forward_step_func=functools.partial(forward_step, num_tokens=num_tokens),
        data_iterator=iters if len(chunks) > 1 else iters[0], model=chunks, num_microbatches=NUM_MICRO,
        seq_length=mbs[0]["ids"].shape[1], micro_batch_size=mbs[0]["ids"].shape[0], forward_only=False)
    return [r["loss"] for r in reduced]  # empty except on the last stage


def _worker(rank, vpp, tied):
    hf = tiny_hf_config(num_hidden_layers=4, tie_word_embeddings=tied)
    mbs = [make_batch(seed=i, batch=2, seq=10) for i in range(NUM_MICRO)]
    num_tokens = sum(mb["mask"].sum() for mb in mbs)

    one = ParallelConfig()
    initialize_parallel(hf, parallel=one, model=MODEL, seed=1)
    (ref,) = build_model(hf, model=MODEL, parallel=one, calculate_per_token_loss=True)
    weights = full_params([ref])
    with torch.no_grad():  # a stale old policy, so that ratios spread over the clip range
        for mb in mbs:
            logits = ref(mb["ids"], mb["pos"], None)
            mb["old"] = vocab_parallel_logprobs(logits, mb["targets"], temperature=1.0)[0] + mb["noise"]
    ref_losses = run_schedule([ref], mbs, num_tokens)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    whole = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}  # one batch of 8 sequences
    ref.zero_grad(set_to_none=True)
    loss = loss_func(whole, num_tokens, ref(whole["ids"], whole["pos"], None))[0]
    loss.backward()
    assert_close(sum(ref_losses), loss.detach(), "PP=1, 4 micro-batches vs one batch: loss")
    for n, p in ref.named_parameters():
        assert_close(ref_grads[n], p.grad, f"PP=1, 4 micro-batches vs one batch: grad {n}", atol=1e-6)
    destroy_parallel(process_group=False)

    pp = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp)
    initialize_parallel(hf, parallel=pp, model=MODEL, seed=1)
    chunks = build_model(hf, model=MODEL, parallel=pp, calculate_per_token_loss=True)
    assert len(chunks) == (vpp or 1) and sum(len(c.decoder.layers) for c in chunks) == 4 // 2
    load_full(chunks, weights, 0, 1, vocab_key_for_output=EMBED)
    losses = run_schedule(chunks, mbs, num_tokens)

    if rank == 1:  # the last stage holds the losses
        assert_close(torch.stack(losses), torch.stack(ref_losses), "per-micro-batch DAPO loss")
    else:
        assert losses == []
    embed_grad = torch.zeros_like(weights[EMBED])
    for c in chunks:
        for n, p in c.named_parameters():
            if tied and n in (EMBED, "output_layer.weight"):
                embed_grad += p.grad  # the two copies' grads add up to the tied weight's
                continue
            assert_close(p.grad, ref_grads[global_name(c, n)], f"grad {global_name(c, n)}", atol=1e-6)
    if tied:
        torch.distributed.all_reduce(embed_grad)
        assert_close(embed_grad, ref_grads[EMBED], "tied embedding grad (first + last stage)", atol=1e-6)


@pytest.mark.parametrize("vpp,tied", [(None, True), (2, False)], ids=["pp2_tied", "pp2_vpp2"])
def test_pp2_equals_pp1(vpp, tied):
    spawn(_worker, vpp, tied)
