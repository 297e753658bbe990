"""The GradHint fast path of the fused output layer at TP=2 with sequence parallelism.

tests/functional/test_train_step_hint.py shows, in one process, that a token-mean update takes the
fast path (the output layer's gradients computed in the forward, no chunk of logits recomputed in
backward) and gives the update of the recompute path. Here the same at TP=2 + SP on 2 gloo ranks,
where the hinted gradient is a vocabulary-parallel partial sum and the hidden-state gradient goes
back through the sequence-parallel reduce-scatter: two actors start from the same weights, one
updates with the hint (no recompute may happen), the other with the hint switched off (it must
recompute), and the metrics, the reduced gradients and the updated weights must agree.
"""

import pytest
import torch

from tests.distributed.harness import assert_close, spawn
from tests.helpers.policy import make_samples, tiny_cfg, tiny_hf_config, with_actor_log_probs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _params(actor) -> dict[str, torch.nn.Parameter]:
    return dict(actor.model[0].named_parameters())


def _worker(rank):
    from megatron.core import parallel_state as ps

    from megatron_dapo.mcore import logprob_chunks, train_step
    from megatron_dapo.mcore.actor import MegatronActor

    # TP=2 + SP over the 2 ranks; a token budget that makes several micro-batches (one hint each);
    # the vocabulary padded (120 -> 128 rows), so the hint must leave the padding rows out; a large
    # adam_eps, so that the update is close to lr * g / eps and a wrong gradient shows in the weights.
    hf, cfg = tiny_hf_config(), tiny_cfg(tp=2, sp=True)
    hinted = MegatronActor(cfg, hf)
    plain = MegatronActor(cfg, hf, initialize=False)
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 1
    assert hinted.model[0].config.sequence_parallel
    with torch.no_grad():  # the same start for both
        for name, p in _params(plain).items():
            p.copy_(_params(hinted)[name])
    plain.optimizer.reload_model_params()  # the distributed optimizer's fp32 copies from the params
    w0 = {n: p.detach().clone() for n, p in _params(hinted).items()}
    # advantages of both signs, one response half masked out of the loss (positions the hint
    # calls inactive), old log-probs = the actor's plus noise so that ratios reach the clips
    xs = with_actor_log_probs(hinted, make_samples(0), seed=1)

    calls, real_backward, real_hint = [], logprob_chunks.chunk_backward, train_step._loss_grad_hint
    logprob_chunks.chunk_backward = lambda *a: calls.append(1) or real_backward(*a)
    try:
        fast = hinted.get_loss_and_metrics(xs)
        assert fast["actor/num_micro_batches"] > 1
        assert not calls, f"rank {rank}: the hinted update recomputed {len(calls)} chunk(s)"
        train_step._loss_grad_hint = lambda *a: None
        slow = plain.get_loss_and_metrics(xs)
        assert calls, f"rank {rank}: without the hint nothing was recomputed: not the reference path"
    finally:
        logprob_chunks.chunk_backward, train_step._loss_grad_hint = real_backward, real_hint

    assert fast.keys() == slow.keys()
    # The shortcut's own counts differ by construction: every hinted micro-batch took the
    # shortcut (each TP rank counts its own), and the reference had no hint to take.
    assert fast["actor/grad_shortcut_used"] == fast["actor/num_micro_batches"]
    assert fast["actor/grad_shortcut_fallbacks"] == 0 == slow["actor/grad_shortcut_used"]
    for key, want in slow.items():
        if not key.startswith("actor/grad_shortcut_"):
            assert_close(torch.tensor(fast[key]), torch.tensor(want), f"rank {rank}: {key}")
    moved = 0.0
    for name, p in _params(hinted).items():
        q = _params(plain)[name]
        # main_grad: the gradient the optimizer used, after megatron's TP / SP reductions
        assert_close(p.main_grad, q.main_grad, f"rank {rank}: grad {name}", atol=1e-6)
        assert_close(p.detach(), q.detach(), f"rank {rank}: updated {name}", atol=1e-6, rtol=1e-5)
        moved = max(moved, (p.detach() - w0[name]).abs().max().item())
    assert moved > 1e-3, "the update is far above the tolerances"


def test_grad_hint_fast_path_equals_recompute_at_tp2_sp():
    spawn(_worker)
