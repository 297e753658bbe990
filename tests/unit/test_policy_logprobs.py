"""vocab_parallel_logprobs (TP=1) against a full-vocabulary log_softmax reference.

The reference is plain autograd over torch.log_softmax of the whole [tokens, V] logits, so the
chunking, temperature, padding mask and the hand-written backward are all checked against
something that shares none of their code. TP > 1 is in tests/distributed/test_policy_tp.py.
"""

import pytest
import torch

from megatron_dapo.mcore.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_from_hidden
from tests.helpers.policy import hint_case


def reference(logits, target, temperature, valid=None):
    x = logits.float()[..., : valid or logits.shape[-1]] / temperature
    logp_all = torch.log_softmax(x, -1)
    logp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make(shape, vocab, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * scale).requires_grad_()
    target = torch.randint(0, vocab, shape, generator=g)
    return logits, target


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 7, 32, None])  # 35 tokens: uneven last chunk, one chunk
def test_values_and_grads_match_log_softmax(temperature, chunk_tokens):
    logits, target = make((5, 7), 50)
    g = torch.Generator().manual_seed(1)
    w_lp, w_h = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)

    lp, h = vocab_parallel_logprobs(logits, target, temperature=temperature, chunk_tokens=chunk_tokens)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (h * w_h).sum(), logits)
    ref_lp, ref_h = reference(logits, target, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_h * w_h).sum(), logits)

    assert lp.shape == h.shape == (5, 7) and lp.dtype == h.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=2e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=2e-6)


def test_only_logprob_or_only_entropy_gradient():
    logits, target = make((12,), 40)
    for pick in (0, 1):
        out = vocab_parallel_logprobs(logits, target, temperature=0.9, chunk_tokens=5)[pick]
        (grad,) = torch.autograd.grad(out.sum(), logits)
        (ref_grad,) = torch.autograd.grad(reference(logits, target, 0.9)[pick].sum(), logits)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=2e-6)


def test_padded_vocabulary_is_excluded():
    """Columns past valid_vocab_size (Megatron's vocab padding) are not tokens: values equal the
    unpadded softmax, and the padding columns get zero gradient."""
    logits, target = make((3, 4), 64)
    lp, h = vocab_parallel_logprobs(logits, target % 50, temperature=1.0, valid_vocab_size=50, chunk_tokens=5)
    (grad,) = torch.autograd.grad(lp.sum() + h.sum(), logits)
    ref_lp, ref_h = reference(logits, target % 50, 1.0, valid=50)
    (ref_grad,) = torch.autograd.grad(ref_lp.sum() + ref_h.sum(), logits)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=2e-6)
    assert torch.all(grad[..., 50:] == 0)
    torch.testing.assert_close(grad[..., :50], ref_grad[..., :50], rtol=1e-5, atol=2e-6)


def test_no_grad_mode_bf16_and_input_untouched():
    """Old-policy log-probs: no graph, bf16 logits computed in fp32, logits never modified
    (megatron's vocab_parallel_cross_entropy subtracts in place on fp32 input)."""
    logits, target = make((6, 3), 30)
    before = logits.detach().clone()
    with torch.no_grad():
        lp, h = vocab_parallel_logprobs(logits, target, temperature=1.0, chunk_tokens=4)
        lp16, h16 = vocab_parallel_logprobs(logits.bfloat16(), target, temperature=1.0)
    assert not lp.requires_grad and torch.equal(logits.detach(), before)
    ref_lp16, ref_h16 = reference(logits.detach().bfloat16(), target, 1.0)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, ref_lp16, rtol=0, atol=2e-6)
    torch.testing.assert_close(h16, ref_h16, rtol=0, atol=2e-6)
    torch.testing.assert_close(lp, reference(logits.detach(), target, 1.0)[0], rtol=0, atol=2e-6)


def test_ignore_index_targets_are_finite():
    logits, target = make((2, 5), 20)
    target[0, :2] = -100
    lp, h = vocab_parallel_logprobs(logits, target, temperature=1.0)
    assert torch.isfinite(lp).all() and torch.isfinite(h).all()


def test_extreme_logits_are_stable():
    logits = torch.tensor([[1e4, 0.0, -1e4], [-3e4, -3e4, -3e4]], requires_grad=True)
    target = torch.tensor([1, 2])
    lp, h = vocab_parallel_logprobs(logits, target, temperature=1.0)
    torch.testing.assert_close(lp, torch.tensor([-1e4, -torch.log(torch.tensor(3.0)).item()]))
    assert torch.isfinite(h).all()


def test_bad_arguments():
    logits, target = make((2, 3), 10)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, target, temperature=0.0)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprobs(logits, target[:, :2], temperature=1.0)
    with pytest.raises(ValueError, match="valid_vocab_size"):
        vocab_parallel_logprobs(logits, target, temperature=1.0, valid_vocab_size=11)


@pytest.mark.parametrize("chunk_tokens", [1, 4, None])
def test_from_hidden_matches_matmul_then_log_softmax(chunk_tokens):
    """The fused output layer: values and grads w.r.t. hidden states and weight, padding rows
    excluded, against autograd through hidden @ weight.T and log_softmax."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 5, 16, generator=g).requires_grad_()
    weight = (torch.randn(40, 16, generator=g) / 2).requires_grad_()
    target = torch.randint(0, 36, (3, 5), generator=g)
    w_lp, w_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    lp, h = vocab_parallel_logprobs_from_hidden(hidden, weight, target, temperature=0.8,
                                                valid_vocab_size=36, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad((lp * w_lp).sum() + (h * w_h).sum(), (hidden, weight))
    ref_lp, ref_h = reference(hidden @ weight.t(), target, 0.8, valid=36)
    ref_grads = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_h * w_h).sum(), (hidden, weight))

    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=2e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert torch.all(grads[1][36:] == 0)


@pytest.mark.parametrize("chunk_tokens", [1, 4, None])
def test_grad_hint_gives_the_recomputed_grads(monkeypatch, chunk_tokens):
    """With a GradHint (the loss's gradient at the log-probs, known in the forward) the output
    layer's gradients come from the forward, and backward recomputes nothing when the gradient
    that arrives is the hint times a scalar (a loss scale). Both against the plain
    matmul + log_softmax reference; then a gradient the hint did not predict (an entropy term,
    other weights) falls back to the recompute and is still exact."""
    from megatron_dapo.mcore import logprob_chunks, logprobs

    hidden, weight, target, active, w = hint_case()
    flat_w = w.reshape(-1)
    hint = logprobs.GradHint(grad=lambda index, lp: flat_w[index] * 3.0, active=active)
    recomputed = []
    real_backward = logprob_chunks.chunk_backward
    monkeypatch.setattr(logprob_chunks, "chunk_backward",
                        lambda *a: recomputed.append(1) or real_backward(*a))
    ref_lp, ref_h = reference(hidden @ weight.t(), target, 0.8, valid=36)

    def grads(loss_of, with_hint=True):
        lp, h = vocab_parallel_logprobs_from_hidden(hidden, weight, target, temperature=0.8, valid_vocab_size=36,
                                                    chunk_tokens=chunk_tokens, grad_hint=hint if with_hint else None)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
        torch.testing.assert_close(h, ref_h, rtol=0, atol=2e-6)
        return torch.autograd.grad(loss_of(lp, h), (hidden, weight))

    def check(got, loss_of):
        want = torch.autograd.grad(loss_of(ref_lp, ref_h), (hidden, weight), retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
        assert torch.all(got[1][36:] == 0)

    predicted = lambda lp, h: 0.37 * (lp * w).sum()  # the hint up to a scale: no recompute
    check(grads(predicted), predicted)
    assert not recomputed
    for surprise in (lambda lp, h: (lp * w).sum() + 0.1 * (h * w).sum(),  # an entropy gradient
                     lambda lp, h: (lp * w.flip(0)).sum(),  # other per-token weights
                     lambda lp, h: (lp * (w + 0.5 * ~active)).sum()):  # a position the hint called inactive
        recomputed.clear()
        check(grads(surprise), surprise)
        assert recomputed
    # Without a hint the reference path must recompute; cleared so the surprises above do not count.
    recomputed.clear()
    check(grads(predicted, with_hint=False), predicted)
    assert recomputed
