"""compute_policy_loss against a slow per-token reference, plus the invariants DAPO relies on
(rollout correction's importance weights included)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo import AGG_MODES, compute_policy_loss, get_policy_loss_fn

LOW, HIGH, C = 0.2, 0.28, 3.0
NORM = 13.0  # seq-mean-token-sum-norm's constant (the generation budget)


def reference_loss(logp, old, adv, mask, low, high, c, mode, weights=None):
    """Token-by-token Python loop written from the paper / verl formulas, independent of the code.
    With ``weights`` ([B, T]), each token's loss is multiplied by its weight."""
    per_seq_sum, per_seq_len, total, ntok = [], [], 0.0, 0
    for i in range(logp.shape[0]):
        s, n = 0.0, 0
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            a = float(adv[i, t]) if adv.dim() == 2 else float(adv[i])
            r = math.exp(max(-20.0, min(20.0, float(logp[i, t] - old[i, t]))))
            clipped = min(max(r, 1 - low), 1 + high)
            loss = max(-a * r, -a * clipped)
            if c is not None and a < 0:
                loss = min(loss, -a * c)
            if weights is not None:
                loss *= float(weights[i, t])
            s += loss
            n += 1
        per_seq_sum.append(s)
        per_seq_len.append(n)
        total += s
        ntok += n
    seqs = [(s, n) for s, n in zip(per_seq_sum, per_seq_len) if n > 0]
    if mode == "token-mean":
        return total / max(ntok, 1)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in seqs) / max(len(seqs), 1)
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: one constant, not a length
        return sum(s for s, _ in seqs) / max(len(seqs), 1) / NORM
    return sum(s for s, _ in seqs) / max(len(seqs), 1)


def make_batch(seed, b=6, t=9, scale=0.5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=dtype) * scale
    adv = torch.randn(b, generator=g, dtype=dtype)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0] = t  # at least one full row
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    return logp, old, adv, mask


@pytest.mark.parametrize("mode", AGG_MODES.names())
@pytest.mark.parametrize("c", [None, C])
@pytest.mark.parametrize("seed", range(4))
def test_matches_per_token_reference(mode, c, seed):
    logp, old, adv, mask = make_batch(seed, scale=0.6)
    loss, _ = compute_policy_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                  clip_ratio_c=c, loss_agg_mode=mode, loss_scale_factor=NORM)
    assert loss.item() == pytest.approx(reference_loss(logp, old, adv, mask, LOW, HIGH, c, mode), abs=1e-12)


def test_hand_computed_case():
    # Two tokens, one sequence. Token 0: A=+1, ratio e^0.5=1.6487 > 1.28 -> clipped loss -1.28.
    # Token 1: A=+1, ratio e^-0.1=0.9048 -> loss -0.9048. token-mean = (-1.28 - 0.904837) / 2.
    logp = torch.tensor([[0.5, -0.1]])
    old = torch.zeros(1, 2)
    loss, m = compute_policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2),
                                  clip_ratio_low=LOW, clip_ratio_high=HIGH)
    assert loss.item() == pytest.approx((-1.28 - math.exp(-0.1)) / 2, abs=1e-6)
    assert m["actor/pg_clipfrac_high"].item() == pytest.approx(0.5)
    assert m["actor/pg_clipfrac_low"].item() == 0.0
    assert m["actor/ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    kl = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.1) - 1 + 0.1)) / 2
    assert m["actor/ppo_kl"].item() == pytest.approx(kl, rel=1e-5)


def _split_losses_and_grads(logp, old, adv, mask, cuts, mode, c):
    """Run the loss over micro-batches [cuts[i]:cuts[i+1]] with the global denominators."""
    n_tok = mask.sum()
    n_seq = (mask.sum(-1) > 0).sum()
    leaf = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=logp.dtype)
    metric_sum = torch.zeros((), dtype=logp.dtype)
    for a, b in zip(cuts[:-1], cuts[1:]):
        loss, m = compute_policy_loss(leaf[a:b], old[a:b], adv[a:b], mask[a:b], clip_ratio_low=LOW,
                                      clip_ratio_high=HIGH, clip_ratio_c=c, loss_agg_mode=mode,
                                      loss_scale_factor=NORM,
                                      global_num_tokens=n_tok, global_num_seqs=n_seq)
        loss.backward()
        total = total + loss.detach()
        metric_sum = metric_sum + m["actor/pg_clipfrac_high"]
    return total, leaf.grad, metric_sum


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_cuts=st.integers(1, 5), mode=st.sampled_from(AGG_MODES.names()),
       dual=st.booleans())
def test_microbatch_identity(seed, num_cuts, mode, dual):
    """k micro-batches with the global token count sum to the full-batch loss and gradients."""
    logp, old, adv, mask = make_batch(seed, b=8, t=7, scale=0.6, dtype=torch.float32)
    c = C if dual else None
    g = torch.Generator().manual_seed(seed)
    inner = sorted(torch.randperm(7, generator=g)[: num_cuts - 1].add(1).tolist())
    cuts = [0, *inner, 8]
    full_leaf = logp.clone().requires_grad_(True)
    full, m_full = compute_policy_loss(full_leaf, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                       clip_ratio_c=c, loss_agg_mode=mode, loss_scale_factor=NORM)
    full.backward()
    split, split_grad, clipfrac_sum = _split_losses_and_grads(logp, old, adv, mask, cuts, mode, c)
    assert split.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(split_grad, full_leaf.grad, atol=1e-6, rtol=0)
    assert clipfrac_sum.item() == pytest.approx(m_full["actor/pg_clipfrac_high"].item(), abs=1e-6)


def test_local_token_mean_is_not_the_global_mean():
    """Guards the reason global_num_tokens exists: per-micro-batch means differ with unequal lengths."""
    logp, old, adv, mask = make_batch(3, b=8, t=7, scale=0.6)
    full, _ = compute_policy_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    halves = [compute_policy_loss(logp[s], old[s], adv[s], mask[s], clip_ratio_low=LOW,
                                  clip_ratio_high=HIGH)[0] for s in (slice(0, 4), slice(4, 8))]
    assert abs(sum(halves).item() / 2 - full.item()) > 1e-4


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), dual=st.booleans())
def test_gradient_zero_exactly_where_clipped(seed, dual):
    logp, old, adv, _ = make_batch(seed, b=6, t=8, scale=1.0)
    adv_tok = adv[:, None].expand(-1, 8).clone()
    adv_tok[0, 0] = 0.0  # zero advantage: zero gradient but not "clipped"
    mask = torch.ones_like(logp)
    c = 1.5 if dual else None
    leaf = logp.clone().requires_grad_(True)
    loss, m = compute_policy_loss(leaf, old, adv_tok, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                  clip_ratio_c=c)
    loss.backward()
    ratio = torch.exp(logp - old)
    clipped = ((adv_tok > 0) & (ratio > 1 + HIGH)) | ((adv_tok < 0) & (ratio < 1 - LOW))
    if dual:
        clipped |= (adv_tok < 0) & (ratio > c)
    expect_zero = clipped | (adv_tok == 0)
    assert torch.all(leaf.grad[expect_zero] == 0)
    assert torch.all(leaf.grad[~expect_zero] != 0)
    fracs = m["actor/pg_clipfrac_high"] + m["actor/pg_clipfrac_low"] + m["actor/pg_clipfrac_dual"]
    assert fracs.item() == pytest.approx(clipped.double().mean().item(), abs=1e-9)


def test_dual_clip_bounds_the_loss():
    """Negative advantages with exploding ratios: dual clip caps each token at -A * c."""
    adv = -torch.ones(4) * 2.0
    logp = torch.full((4, 5), 3.0)  # ratio e^3 ~ 20 >> c
    old = torch.zeros(4, 5)
    mask = torch.ones(4, 5)
    capped, m = compute_policy_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C)
    uncapped, _ = compute_policy_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    assert capped.item() == pytest.approx(2.0 * C)
    assert uncapped.item() == pytest.approx(2.0 * math.exp(3.0), rel=1e-6)
    assert m["actor/pg_clipfrac_dual"].item() == 1.0


def test_huge_mismatch_stays_finite():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-500.0, 400.0]])
    loss, m = compute_policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2),
                                  clip_ratio_low=LOW, clip_ratio_high=HIGH)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_empty_mask_gives_zero_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    for mode in AGG_MODES.names():
        loss, m = compute_policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3),
                                      clip_ratio_low=LOW, clip_ratio_high=HIGH, loss_agg_mode=mode,
                                      loss_scale_factor=NORM)
        assert loss.item() == 0.0 and all(torch.isfinite(v) for v in m.values())


def test_metrics_are_detached_tensors():
    logp, old, adv, mask = make_batch(0)
    leaf = logp.clone().requires_grad_(True)
    _, m = compute_policy_loss(leaf, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values())


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_ratio_low=1.5, clip_ratio_high=0.28), "clip_ratio_low"),
    (dict(clip_ratio_low=0.2, clip_ratio_high=-0.1), "clip_ratio_high"),
    (dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.0), "clip_ratio_c"),
    # the config's rule too (one function, algo.losses.dual_clip_error): above 1 but inside the clip range
    (dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.2), r"must exceed 1 \+ clip_ratio_high = 1.28"),
    (dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-sum"), "seq-mean-token-mean"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    logp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(logp, old, adv, mask, **kwargs)


def test_registry_lookup():
    assert get_policy_loss_fn("dapo") is compute_policy_loss
    with pytest.raises(ValueError, match=r"valid names: \['cispo', 'dapo', 'gspo'\]"):
        get_policy_loss_fn("ppo-kl")


# -- importance weights (rollout correction) ----------------------------------------------------------

def with_weights(seed, b=6, t=9, dtype=torch.float64):
    """make_batch plus positive per-token weights on both sides of 1 (exp of N(0, 0.8^2))."""
    logp, old, adv, mask = make_batch(seed, b=b, t=t, scale=0.6, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1000)
    return logp, old, adv, mask, torch.exp(0.8 * torch.randn(b, t, generator=g, dtype=dtype))


def reference_weighted_grad(logp, old, adv, mask, weights, low, high, c):
    """d(token-mean weighted loss) / d logp, token by token: w * (-A * ratio) where the unclipped branch
    is active, 0 where a clip (or the dual clip) holds the loss constant; w is a constant weight."""
    grad = torch.zeros_like(logp)
    n = int(mask.sum())
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            a = float(adv[i])
            r = math.exp(float(logp[i, t] - old[i, t]))
            clipped = min(max(r, 1 - low), 1 + high)
            if -a * r < -a * clipped:  # the clipped (constant) branch is the max
                continue
            if c is not None and a < 0 and -a * r > -a * c:  # dual clip: capped at -A c
                continue
            grad[i, t] = float(weights[i, t]) * -a * r / n
    return grad


@pytest.mark.parametrize("mode", AGG_MODES.names())
@pytest.mark.parametrize("c", [None, C])
@pytest.mark.parametrize("seed", range(4))
def test_weights_match_per_token_reference(mode, c, seed):
    logp, old, adv, mask, w = with_weights(seed)
    leaf = logp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(leaf, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                  clip_ratio_c=c, loss_agg_mode=mode, loss_scale_factor=NORM, is_weights=w)
    want = reference_loss(logp, old, adv, mask, LOW, HIGH, c, mode, weights=w)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    plain = reference_loss(logp, old, adv, mask, LOW, HIGH, c, mode)
    assert abs(want - plain) > 1e-3  # the weights matter in this batch
    if mode == "token-mean":
        loss.backward()
        want_grad = reference_weighted_grad(logp, old, adv, mask, w, LOW, HIGH, c)
        torch.testing.assert_close(leaf.grad, want_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_weights_equal_advantages_times_the_weight(seed):
    """w > 0 commutes with the clips, so the weighted loss = the plain loss with advantages w * A,
    gradients included, also those reaching old_log_probs; none reaches the weights."""
    logp, old, adv, mask, w = with_weights(seed)
    grads = []
    for weighted in (True, False):
        lp, o, ww = (x.clone().requires_grad_(True) for x in (logp, old, w))
        kw = dict(is_weights=ww) if weighted else {}
        a = adv[:, None] if weighted else adv[:, None] * w
        loss, _ = compute_policy_loss(lp, o, a, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                      clip_ratio_c=C, **kw)
        loss.backward()
        grads.append((loss.detach(), lp.grad, o.grad))
        if weighted:
            assert ww.grad is None  # the weights are detached
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_weights_of_one_or_none_are_bit_identical():
    logp, old, adv, mask, _ = with_weights(0, dtype=torch.float32)
    runs = []
    for kw in ({}, dict(is_weights=None), dict(is_weights=torch.ones_like(logp))):
        leaf = logp.clone().requires_grad_(True)
        loss, m = compute_policy_loss(leaf, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                      clip_ratio_c=C, **kw)
        loss.backward()
        runs.append((loss, leaf.grad, m))
    for loss, grad, m in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][1])
        assert sorted(m) == sorted(runs[0][2]) and all(torch.equal(m[k], runs[0][2][k]) for k in m)


@pytest.mark.parametrize("seed", range(3))
def test_weighted_micro_batches_sum_to_the_full_batch(seed):
    logp, old, adv, mask, w = with_weights(seed, b=8, t=7, dtype=torch.float32)
    kw = dict(clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C)
    full_leaf = logp.clone().requires_grad_(True)
    full, _ = compute_policy_loss(full_leaf, old, adv, mask, is_weights=w, **kw)
    full.backward()
    leaf = logp.clone().requires_grad_(True)
    total = 0.0
    for s in (slice(0, 3), slice(3, 4), slice(4, 8)):
        loss, _ = compute_policy_loss(leaf[s], old[s], adv[s], mask[s], is_weights=w[s],
                                      global_num_tokens=mask.sum(), **kw)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(leaf.grad, full_leaf.grad, atol=1e-6, rtol=0)


def test_weights_of_the_wrong_shape_name_the_problem():
    logp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match=r"is_weights must have the shape"):
        compute_policy_loss(logp, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                            is_weights=torch.ones(6, 8, dtype=logp.dtype))
