"""GSPO, CISPO and Dr. GRPO's normaliser against their papers' formulas written out here, token by token,
and all policy losses and aggregation modes against verl 0.9.1's as shipped (loss and gradient); the
loss-mask and clip-boundary behaviour DAPO's loss promises."""

import math

import pytest
import torch

from megatron_dapo.algo import AGG_MODES, compute_cispo_loss, compute_gspo_loss, compute_policy_loss
from megatron_dapo.config_loading import load_config
from tests.helpers.verl_reference import loss_and_grad, verl_loss

GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4
CISPO_LOW, CISPO_HIGH = 1.0, 5.0


def batch(seed, b=6, t=9, spread=0.5, per_seq_spread=0.0, dtype=torch.float64):
    """Ragged rows (one full, one of length 1), advantages of both signs; ``per_seq_spread`` shifts
    each row's log-ratios by one value so some sequence ratios leave GSPO's narrow clip range."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    shift = torch.randn(b, 1, generator=g, dtype=dtype) * per_seq_spread
    logp = old + torch.randn(b, t, generator=g, dtype=dtype) * spread + shift
    adv = torch.randn(b, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = t, 1
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    return logp, old, adv, mask


# -- the papers' formulas ------------------------------------------------------------------------------

def gspo_reference(logp, old, adv, mask, low, high):
    """GSPO Eq. 5-7 (arXiv 2507.18071): s_i = exp(mean_t log r_i,t); J = mean_i min(s_i A_i, clip(s_i) A_i).
    Its gradient (Eq. 10-11) at token t of response i: -A_i s_i / |y_i| / N where s_i is inside the clip
    range or the min is the unclipped term, 0 where the clip binds. Returns (loss, grad [B, T])."""
    grad = torch.zeros_like(logp)
    rows = [i for i in range(logp.shape[0]) if mask[i].sum() > 0]
    total = 0.0
    for i in rows:
        valid = [t for t in range(logp.shape[1]) if mask[i, t] > 0]
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in valid) / len(valid))
        a = float(adv[i])
        clipped = (a > 0 and s > 1 + high) or (a < 0 and s < 1 - low)
        total += -a * (min(max(s, 1 - low), 1 + high) if clipped else s)
        for t in valid:
            grad[i, t] = 0.0 if clipped else -a * s / len(valid) / len(rows)
    return total / len(rows), grad


def cispo_reference(logp, old, adv, mask, low, high):
    """CISPO Eq. 4-5 (arXiv 2506.13585): J = 1 / sum_i |o_i| x sum_i,t sg(clip(r_i,t)) A_i log pi(o_i,t);
    the loss is -J and its gradient at a token -clip(r) A / N_tokens. Returns (loss, grad [B, T])."""
    n = float(mask.sum())
    grad = torch.zeros_like(logp)
    total = 0.0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            w = min(max(math.exp(float(logp[i, t] - old[i, t])), 1 - low), 1 + high)
            total += -w * float(adv[i]) * float(logp[i, t])
            grad[i, t] = -w * float(adv[i]) / n
    return total / n, grad


@pytest.mark.parametrize("seed", range(6))
def test_gspo_equals_the_paper(seed):
    logp, old, adv, mask = batch(seed, spread=0.002, per_seq_spread=4e-4)
    loss, grad = loss_and_grad(compute_gspo_loss, logp, old, adv, mask, clip_ratio_low=GSPO_LOW,
                               clip_ratio_high=GSPO_HIGH)
    want, want_grad = gspo_reference(logp, old, adv, mask, GSPO_LOW, GSPO_HIGH)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=0)
    assert 0 < (grad[mask > 0] == 0).sum() < mask.sum()  # some responses clipped, some not


def test_gspo_clips_whole_responses_and_counts_them():
    logp, old, adv, mask = batch(1, spread=0.002, per_seq_spread=4e-4)
    _, m = compute_gspo_loss(logp, old, adv, mask, clip_ratio_low=GSPO_LOW, clip_ratio_high=GSPO_HIGH)
    leaf = logp.clone().requires_grad_(True)
    compute_gspo_loss(leaf, old, adv, mask, clip_ratio_low=GSPO_LOW, clip_ratio_high=GSPO_HIGH)[0].backward()
    zero_rows = [(leaf.grad[i][mask[i] > 0] == 0).all().item() for i in range(6)]
    some_rows = [(leaf.grad[i][mask[i] > 0] == 0).any().item() for i in range(6)]
    assert zero_rows == some_rows  # a response is clipped whole or not at all
    clipped_tokens = sum(mask[i].sum().item() for i in range(6) if zero_rows[i])
    frac = (m["actor/pg_clipfrac_high"] + m["actor/pg_clipfrac_low"]).item()
    assert frac == pytest.approx(clipped_tokens / mask.sum().item(), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_cispo_equals_the_paper(seed):
    logp, old, adv, mask = batch(seed, spread=1.5)
    loss, grad = loss_and_grad(compute_cispo_loss, logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.5)
    want, want_grad = cispo_reference(logp, old, adv, mask, 0.2, 0.5)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=0)
    assert (grad[mask > 0] != 0).all()  # no token loses its gradient to the clip


def test_a_changed_clip_bound_or_normaliser_is_seen():
    """The references above tell the bounds and the normaliser apart: each change moves the result."""
    logp, old, adv, mask = batch(0, spread=0.002, per_seq_spread=4e-4)
    want, _ = gspo_reference(logp, old, adv, mask, GSPO_LOW, GSPO_HIGH)
    for low, high in ((GSPO_LOW, GSPO_HIGH * 1.5), (GSPO_LOW * 1.5, GSPO_HIGH)):
        got = compute_gspo_loss(logp, old, adv, mask, clip_ratio_low=low, clip_ratio_high=high)[0].item()
        assert abs(got - want) > 1e-7
    got = compute_gspo_loss(logp, old, adv, mask, clip_ratio_low=GSPO_LOW, clip_ratio_high=GSPO_HIGH,
                            loss_agg_mode="token-mean")[0].item()
    assert abs(got - want) > 1e-3
    logp, old, adv, mask = batch(0, spread=1.5)
    want, _ = cispo_reference(logp, old, adv, mask, 0.2, 0.5)
    got = compute_cispo_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.6)[0].item()
    assert abs(got - want) > 1e-6
    norm = [compute_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=f)[0].item()
            for f in (9.0, 10.0)]
    assert norm[0] == pytest.approx(norm[1] * 10 / 9, rel=1e-12) and norm[0] != norm[1]


def test_dr_grpo_normaliser_is_a_constant_not_a_length():
    """seq-mean-token-sum-norm: sum over tokens / (sequences x the constant), whatever the rows' lengths;
    without a constant it refuses (verl's fallback, the padded width, varies batch to batch here)."""
    logp, old, adv, mask = batch(2)
    per_token = -adv[:, None] * torch.exp(logp - old).clamp(0.8, 1.28)  # dual clip off, clips as DAPO
    loss = compute_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                               loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=100.0)[0]
    unclipped = -adv[:, None] * torch.exp(logp - old)
    want = (torch.maximum(unclipped, per_token) * mask).sum() / (6 * 100.0)
    assert loss.item() == pytest.approx(want.item(), abs=1e-14)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        compute_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                            loss_agg_mode="seq-mean-token-sum-norm")


def test_dr_grpo_advantage_is_r_minus_the_group_mean():
    from megatron_dapo.algo import get_advantage_fn
    cfg = load_config(None, ["algorithm.norm_adv_by_std_in_grpo=false"])
    rewards = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    got = get_advantage_fn(cfg.algorithm.estimator)(rewards)
    assert got.tolist() == [[1.5, -0.5, -0.5, -0.5]]
    std = get_advantage_fn(load_config(None, []).algorithm.estimator)(rewards)
    assert std[0, 0].item() == pytest.approx(1.5 / 1.0, rel=1e-5)  # the group's std is 1


# -- verl 0.9.1 as shipped -----------------------------------------------------------------------------

OURS = {"dapo": compute_policy_loss, "gspo": compute_gspo_loss, "cispo": compute_cispo_loss}
VERL = {"dapo": "vanilla", "gspo": "gspo", "cispo": "cispo"}
BOUNDS = {"dapo": (0.2, 0.28), "gspo": (GSPO_LOW, GSPO_HIGH), "cispo": (0.2, 2.0)}
SPREAD = {"dapo": (0.6, 0.0), "gspo": (0.002, 4e-4), "cispo": (1.5, 0.0)}


@pytest.mark.parametrize("mode", sorted(AGG_MODES.names()))
@pytest.mark.parametrize("loss", sorted(OURS))
@pytest.mark.parametrize("seed", range(3))
def test_equals_verl(loss, mode, seed):
    logp, old, adv, mask = batch(seed, spread=SPREAD[loss][0], per_seq_spread=SPREAD[loss][1])
    low, high = BOUNDS[loss]
    c = 3.0 if loss == "dapo" else None
    norm = 20.0 if mode == "seq-mean-token-sum-norm" else None
    weights = torch.exp(torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed),
                                    dtype=logp.dtype) * 0.3)
    kw = dict(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_agg_mode=mode, loss_scale_factor=norm)
    for rollout_kw, verl_weights in (({}, None), (dict(is_weights=weights), weights)):
        loss_ours, grad_ours = loss_and_grad(OURS[loss], logp, old, adv, mask, **kw, **rollout_kw)
        loss_verl, grad_verl = loss_and_grad(lambda lp: verl_loss(VERL[loss], lp, old, adv, mask, **kw,
                                                                  rollout_is_weights=verl_weights), logp)
        # verl's seq-mean-token-mean divides by (length + 1e-8): a relative 1e-9
        tol = dict(rtol=1e-7, atol=1e-12) if mode == "seq-mean-token-mean" else dict(rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(loss_ours, loss_verl, **tol)
        torch.testing.assert_close(grad_ours, grad_verl, **tol)


# -- the loss mask and the clip boundary -----------------------------------------------------------------

@pytest.mark.parametrize("loss", sorted(OURS))
def test_nan_under_the_mask_changes_nothing(loss):
    """NaN / inf at masked positions (e.g. an engine's log-probs past a response's end) reach neither the
    loss nor the gradient: the loss equals the one with zeros there."""
    logp, old, adv, mask = batch(4, spread=SPREAD[loss][0], per_seq_spread=SPREAD[loss][1])
    low, high = BOUNDS[loss]
    kw = dict(clip_ratio_low=low, clip_ratio_high=high)
    clean, clean_grad = loss_and_grad(OURS[loss], logp, old, adv, mask, **kw)
    dirty = [x.clone() for x in (logp, old)]
    for x, bad in zip(dirty, (float("nan"), float("inf"))):
        x[mask == 0] = bad
    loss_d, grad_d = loss_and_grad(OURS[loss], dirty[0], dirty[1], adv, mask, **kw)
    assert torch.equal(loss_d, clean)
    assert torch.equal(grad_d, clean_grad)


def _one_ulp_past(bound: float, sign: float) -> tuple[torch.Tensor, float]:
    """(a float32 log-prob, an advantage of ``sign``): exp(lp) lies a few ulps past ``bound`` while -A r
    and -A bound round to one float32 (the tie where max(-A r, -A clip(r)) halves the gradient)."""
    b = torch.tensor(bound, dtype=torch.float32)
    away = torch.tensor(math.inf if bound > 1 else -math.inf)
    for k in range(1, 400):
        advantage, lp = sign * k / 7, torch.log(b)
        for _ in range(40):
            lp = torch.nextafter(lp, away)
            r = torch.exp(lp)
            if (r > b if bound > 1 else r < b) and (-advantage * r) == (-advantage * b):
                return lp, advantage
    raise AssertionError(f"no tie found past {bound}")


@pytest.mark.parametrize("side", ["high", "low"])
def test_a_token_counted_as_clipped_gets_exactly_zero_gradient(side):
    """One float32 ulp past the clip bound, where -A r and -A (1 + eps) round to the same float: the
    token is counted as clipped, so its gradient must be exactly zero (not half the unclipped one)."""
    lp, a = _one_ulp_past(1.28, 1.0) if side == "high" else _one_ulp_past(0.8, -1.0)
    leaf = lp.reshape(1, 1).clone().requires_grad_(True)
    loss, m = compute_policy_loss(leaf, torch.zeros(1, 1), torch.tensor([a]), torch.ones(1, 1),
                                  clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss.backward()
    assert m[f"actor/pg_clipfrac_{side}"].item() == 1.0
    assert leaf.grad.item() == 0.0
    # the textbook form on the same input: the tie halves the gradient instead
    tie = leaf.detach().clone().requires_grad_(True)
    r = torch.exp(tie)
    torch.maximum(-a * r, -a * r.clamp(0.8, 1.28)).sum().backward()
    assert tie.grad.item() == pytest.approx(-a * r.item() / 2, rel=1e-6)
