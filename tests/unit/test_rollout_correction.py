"""algo/rollout_correction.py against the definitions written out here and against verl 0.9.1's
rollout_corr_helper as shipped: the weights, the rejection mask and the mismatch metrics."""

import math

import pytest
import torch

from megatron_dapo.algo.rollout_correction import (
    REJECTION_OPTIONS, CorrectionSpec, Rejection, correct, parse_is_threshold, parse_rejections,
)
from tests.helpers.verl_reference import verl


def batch(seed, b=8, t=10, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    rollout = old - torch.randn(b, t, generator=g, dtype=torch.float64) * spread
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    return old, rollout, mask


def test_token_tis_by_hand():
    old, rollout, mask = batch(0)
    got = correct(old, rollout, mask, CorrectionSpec(is_level="token", is_upper=2.0))
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            want = min(math.exp(float(old[i, t] - rollout[i, t])), 2.0) if mask[i, t] else 0.0
            assert got.weights[i, t].item() == pytest.approx(want, rel=1e-12, abs=0)
    assert torch.equal(got.mask, mask)


def test_sequence_is_and_icepop_by_hand():
    old, rollout, mask = batch(1, spread=0.15)
    seq = correct(old, rollout, mask, CorrectionSpec(is_level="sequence", is_upper=3.0))
    ice = correct(old, rollout, mask, CorrectionSpec(is_level="token", is_upper=1.5, is_lower=0.7))
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        w = min(math.exp(sum(float(old[i, t] - rollout[i, t]) for t in valid)), 3.0)
        assert all(seq.weights[i, t].item() == pytest.approx(w, rel=1e-12) for t in valid)
        for t in valid:
            r = math.exp(float(old[i, t] - rollout[i, t]))
            assert ice.weights[i, t].item() == pytest.approx(r if 0.7 <= r <= 1.5 else 0.0, rel=1e-12, abs=0)
    assert 0 < (ice.weights[mask > 0] == 0).sum() < mask.sum()  # IcePop zeroes some tokens, not all


def test_rejection_by_hand():
    old, rollout, mask = batch(2, spread=0.5)
    rules = parse_rejections("token_k3,seq_mean_k1", "0.3,0.8_1.25")
    got = correct(old, rollout, mask, CorrectionSpec(rejections=rules))
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        logs = [float(old[i, t] - rollout[i, t]) for t in valid]
        geo_ok = math.log(0.8) <= -sum(logs) / len(logs) <= math.log(1.25)
        for t, lr in zip(valid, logs):
            keep = geo_ok and (math.exp(lr) - 1 - lr) <= 0.3
            assert got.mask[i, t].item() == (1.0 if keep else 0.0)
    assert got.weights is None
    rejected = (mask > 0) & (got.mask == 0)
    assert got.metrics["rollout_corr/token_masked_frac"].item() == pytest.approx(
        rejected.sum().item() / mask.sum().item())


def test_metrics_by_hand():
    old, rollout, mask = batch(3)
    m = correct(old, rollout, mask, CorrectionSpec()).metrics
    lr = (old - rollout)[mask > 0]
    assert m["rollout_corr/kl"].item() == pytest.approx((-lr).mean().item(), rel=1e-12)
    assert m["rollout_corr/k3_kl"].item() == pytest.approx((lr.exp() - lr - 1).mean().item(), rel=1e-12)
    assert m["rollout_corr/chi2_token"].item() == pytest.approx((2 * lr).exp().mean().item() - 1, rel=1e-12)


# Bounds that bind on part of batch(seed, spread=0.3) for each option (log-ratios ~ N(0, 0.3^2), 1-10 tokens)
RS_THRESHOLDS = {"token_k1": "0.7_1.4", "seq_sum_k1": "0.6_1.6", "seq_mean_k1": "0.92_1.08",
                 "token_k2": 0.1, "seq_sum_k2": 0.3, "seq_mean_k2": 0.04, "seq_max_k2": 0.1,
                 "token_k3": 0.1, "seq_sum_k3": 0.3, "seq_mean_k3": 0.04, "seq_max_k3": 0.1}
assert sorted(RS_THRESHOLDS) == sorted(REJECTION_OPTIONS)


@pytest.mark.parametrize("spec", [
    dict(rollout_is="token", rollout_is_threshold=2.0),
    dict(rollout_is="sequence", rollout_is_threshold=4.0),
    dict(rollout_is="token", rollout_is_threshold="0.7_1.4"),
    dict(rollout_is="sequence", rollout_is_threshold="0.3_3.0"),
    *[dict(rollout_rs=o, rollout_rs_threshold=t) for o, t in RS_THRESHOLDS.items()],
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,token_k2",
         rollout_rs_threshold="0.9_1.1,0.2"),
])
@pytest.mark.parametrize("seed", range(2))
def test_equals_verl(spec, seed):
    core_algos, _, _ = verl()
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    old, rollout, mask = batch(seed, spread=0.3)
    weights_proto, verl_mask, verl_metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=spec.get("rollout_is"),
        rollout_is_threshold=spec.get("rollout_is_threshold", 2.0), rollout_rs=spec.get("rollout_rs"),
        rollout_rs_threshold=spec.get("rollout_rs_threshold"))
    upper, lower = parse_is_threshold(spec.get("rollout_is_threshold", 2.0))
    rules = parse_rejections(spec["rollout_rs"], spec["rollout_rs_threshold"]) if "rollout_rs" in spec else ()
    ours = correct(old, rollout, mask, CorrectionSpec(is_level=spec.get("rollout_is"), is_upper=upper,
                                                      is_lower=lower, rejections=rules))
    assert torch.equal(ours.mask, verl_mask.to(ours.mask.dtype))
    if weights_proto is None:
        assert ours.weights is None
    else:
        torch.testing.assert_close(ours.weights, weights_proto.batch["rollout_is_weights"], rtol=1e-12, atol=0)
    for key in ("kl", "k3_kl", "chi2_token", "chi2_seq"):
        assert ours.metrics[f"rollout_corr/{key}"].item() == pytest.approx(verl_metrics[f"rollout_corr/{key}"],
                                                                           rel=1e-6, abs=1e-9)
    if "rollout_rs" in spec:
        assert 0 < ours.metrics["rollout_corr/token_masked_frac"].item() < 1  # the criterion binds somewhere
        assert ours.metrics["rollout_corr/token_masked_frac"].item() == pytest.approx(
            verl_metrics["rollout_corr/rollout_rs_masked_fraction"], rel=1e-6)


@pytest.mark.parametrize("spec, match", [
    ("0.5", None), ("0.5_5.0", None), (0, "upper bound > 0"), ("5_0.5", "lower <= upper"), ("a_b", "not a number"),
])
def test_is_threshold_parsing(spec, match):
    if match is None:
        parse_is_threshold(spec)
    else:
        with pytest.raises(ValueError, match=match):
            parse_is_threshold(spec)


def test_rejection_parsing():
    assert parse_rejections("token_k1", 2.0) == (Rejection("token_k1", 2.0, 0.5),)
    assert parse_rejections("token_k2, token_k2,seq_max_k3", "0.1,0.2") == (
        Rejection("token_k2", 0.1), Rejection("seq_max_k3", 0.2))
    with pytest.raises(ValueError, match="options are"):
        parse_rejections("token_k4", 1.0)
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        parse_rejections("token_k2", None)
    with pytest.raises(ValueError, match="one upper bound"):
        parse_rejections("token_k2", "0.1_0.2")


def test_token_tis_metrics_hand_computed():
    # pi_old / pi_rollout = 3, 1.5, 0.5, 2.5 on valid tokens, 10 on a masked one; cap 2: weights 2, 1.5,
    # 0.5, 2 -> mean 1.5; 2 of 4 valid tokens above the cap, none below its reciprocal (0.5 is not < 0.5).
    ratios = torch.tensor([[3.0, 1.5, 0.5, 2.5, 10.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 1, 0]], dtype=torch.float64)
    got = correct(torch.zeros(1, 5, dtype=torch.float64), -ratios.log(), mask,
                  CorrectionSpec(is_level="token", is_upper=2.0))
    assert got.weights.tolist() == [[2.0, 1.5, 0.5, 2.0, 0.0]]
    assert got.metrics["rollout_corr/is_frac_high"].item() == pytest.approx(0.5, abs=1e-12)
    assert got.metrics["rollout_corr/is_frac_low"].item() == 0.0
    assert got.metrics["rollout_corr/is_mean"].item() == pytest.approx(1.5, abs=1e-12)
    assert got.metrics["rollout_corr/is_max"].item() == 2.0 and got.metrics["rollout_corr/is_min"].item() == 0.5


def test_huge_mismatch_and_nan_under_the_mask_stay_finite():
    old = torch.tensor([[0.0, -1.0, -2.0, float("nan")]], dtype=torch.float64)
    rollout = torch.tensor([[-500.0, 400.0, -1e30, float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    for spec in (CorrectionSpec(is_level="token"), CorrectionSpec(is_level="sequence", is_lower=0.1),
                 CorrectionSpec(rejections=parse_rejections("seq_max_k3,token_k1", "5,0.5_2.0"))):
        got = correct(old, rollout, mask, spec)
        assert all(torch.isfinite(v) for v in got.metrics.values())
        assert got.weights is None or torch.isfinite(got.weights).all()
        assert got.mask[0, 3] == 0


def test_a_rejection_bound_is_checked_also_while_no_rejection_reads_it():
    """rollout_rs_threshold is unread without rollout_rs, but a value that is no bound ('abc', -1: the
    bad-input campaign's, which trained on) is named at once, not once rollout_rs is set."""
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.errors import ConfigError

    for value, why in (("abc", "'abc' is not a number"), ("-1", "need a bound > 0"),
                       ("0.5_2.0,x", "'x' is not a number")):
        with pytest.raises(ConfigError, match=r"^algorithm.rollout_correction.rollout_rs_threshold=.*" + why):
            load_config(None, [f"algorithm.rollout_correction.rollout_rs_threshold={value}"])
    for value in ("0.5_2.0", "2.0", "0.5_2.0,0.3"):
        load_config(None, [f"algorithm.rollout_correction.rollout_rs_threshold={value}"])
