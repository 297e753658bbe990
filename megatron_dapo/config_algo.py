"""The algorithm's sections of the config schema: advantages and dynamic sampling (``algorithm``) and
the policy loss (``loss``), with each policy loss's defaults from its paper."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from megatron_dapo.config_fields import at_least, fail, require, section, setting

# Each policy loss's settings from its paper, for the loss keys left at "auto" (LossConfig.resolved).
POLICY_LOSS_DEFAULTS: dict[str, dict[str, Any]] = {
    # DAPO (arXiv 2503.14476, section 4.1): Clip-Higher 0.2 / 0.28 and the token-level loss; the
    # dual clip c = 10 is verl's DAPO recipe's (not in the paper).
    "dapo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean"),
    # GSPO (arXiv 2507.18071, section 5.1): the sequence ratio clipped to [1 - 3e-4, 1 + 4e-4], the
    # objective a mean over responses of their (length-normalised) ratio terms.
    "gspo": dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean"),
    # CISPO (arXiv 2506.13585, section 3.1): no lower bound on the importance weight ("we did not
    # impose a lower bound"); the paper tunes the upper one without giving it: 1 + 5, SkyRL's CISPO
    # default; normalised by all tokens of the batch.
    "cispo": dict(clip_ratio_low=1.0, clip_ratio_high=5.0, clip_ratio_c=None, loss_agg_mode="token-mean"),
}
AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    enable: bool = setting(True, "dynamic sampling: drop groups whose answers are all right or all wrong "
                                  "(correctness, before length shaping)")
    max_num_gen_batches: int = setting(10, "generation batches per step before giving up; 0 = unbounded")
    surplus: Literal["drop", "carry"] = setting("drop", "kept groups beyond the batch: drop (paper, verl) or carry "
                                                   "over (always with rollout.partial: dropped, they would be the "
                                                   "short ones)")
    adaptive: bool = setting(False, "size each generation batch from the keep rate measured so far (missing groups / "
                               "keep rate + 10%) instead of data.gen_prompts_per_batch, which sizes the first")
    max_gen_prompts: int = setting(0, "with adaptive: the largest generation batch in prompts; 0 = 4 x "
                                 "data.gen_prompts_per_batch")
    on_exhausted: Literal["fill", "error"] = setting("fill", "the step still short after max_num_gen_batches: fill it "
                                                     "with the last batch's groups of one answer (zero advantage; "
                                                     "logged, dynamic_sampling/num_filled), or stop with an error (as "
                                                     "verl)")

    def __post_init__(self):
        if self.max_num_gen_batches < 0:
            fail(f"algorithm.filter_groups.max_num_gen_batches must be >= 0, got {self.max_num_gen_batches}")
        if self.max_gen_prompts < 0:
            fail(f"algorithm.filter_groups.max_gen_prompts must be >= 0 (0 = 4 x data.gen_prompts_per_batch), "
                 f"got {self.max_gen_prompts}")


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    rollout_is: Literal["token", "sequence"] | None = setting(
        None, "importance weights for the rollout's policy against pi_old, detached, on each token's loss: token "
              "(TIS) or sequence (the product over the response); null = none")
    rollout_is_threshold: float | str = setting(
        2.0, "a cap (TIS: weights truncated above it) or 'lower_upper' (IcePop: weights outside the range set "
             "to 0), e.g. '0.5_5.0' (both with a decimal point: YAML reads 1_5 as the number 15)")
    rollout_rs: str | None = setting(
        None, "rejection: tokens or whole responses masked out of the loss where a divergence leaves its bounds; "
              "comma separated: token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (mean k1: the geometric "
              "mean ratio), seq_max_k2/k3; null = none")
    rollout_rs_threshold: float | str | None = setting(
        None, "rollout_rs's bounds, one for all or one per option (comma separated): k1 'lower_upper' ratio "
              "bounds (or an upper, its reciprocal the lower), k2/k3 an upper bound; unread without rollout_rs")

    def __post_init__(self):
        self.spec()  # the thresholds parse, or the one-line error names the key

    @property
    def active(self) -> bool:
        return self.spec().active

    def spec(self):
        """algo.rollout_correction.CorrectionSpec of this section (ConfigError naming a bad value)."""
        from megatron_dapo.algo.rollout_correction import CorrectionSpec, parse_is_threshold, parse_rejections

        where = "algorithm.rollout_correction"
        try:
            upper, lower = parse_is_threshold(self.rollout_is_threshold)
            rules = () if self.rollout_rs is None else parse_rejections(self.rollout_rs, self.rollout_rs_threshold)
            if self.rollout_rs is None and self.rollout_rs_threshold is not None:
                # Unread without rollout_rs, but still a bound: a slip shows now, not once rollout_rs is
                # set. Each part read as the options that take its form: lower_upper (k1), an upper (k2).
                for part in str(self.rollout_rs_threshold).split(","):
                    parse_rejections("token_k1" if "_" in part else "token_k2", part)
        except ValueError as e:  # each message starts with the key's own name
            fail(f"{where}.{e}")
        return CorrectionSpec(is_level=self.rollout_is, is_upper=upper, is_lower=lower, rejections=rules)


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    adv_estimator: str = setting("grpo", "advantage estimator (registry: grpo, grpo_mean_only)")
    adv_eps: float = setting(1e-6, "epsilon in (r - mean) / (std + eps)")
    norm_adv_by_std_in_grpo: bool = setting(True, "grpo: divide by the group's std (GRPO, DAPO Eq. 9); false = "
                                                  "r - mean only (Dr. GRPO, verl's name)")
    filter_groups: FilterGroupsConfig = section(FilterGroupsConfig, "dynamic sampling")
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "importance weights and rejection for rollouts from another policy than pi_old "
                                 "(engine numerics, stale or partial rollouts); verl's names")

    def __post_init__(self):
        require("algorithm", self, adv_eps=at_least(0))
        if not self.norm_adv_by_std_in_grpo and self.adv_estimator != "grpo":
            fail(f"algorithm.norm_adv_by_std_in_grpo=false with algorithm.adv_estimator={self.adv_estimator}: "
                 "it switches grpo's std off, and this estimator has none to switch; set "
                 "algorithm.adv_estimator=grpo or drop norm_adv_by_std_in_grpo")

    @property
    def estimator(self) -> str:
        """The registered estimator that computes the advantages (algo/advantages.py)."""
        return "grpo_mean_only" if self.adv_estimator == "grpo" and not self.norm_adv_by_std_in_grpo \
            else self.adv_estimator


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    policy_loss: str = setting("dapo", "policy-loss function (registry): dapo, gspo (sequence-level ratio), "
                                       "cispo (clipped, detached importance weight)")
    clip_ratio_low: float | Literal["auto"] = setting(
        AUTO, "ratio lower clip 1 - eps_low; auto = the policy loss's paper value: dapo 0.2 (Clip-Higher: "
              "decoupled from eps_high), gspo 3e-4, cispo 1.0 (no lower bound)")
    clip_ratio_high: float | Literal["auto"] = setting(
        AUTO, "ratio upper clip 1 + eps_high; auto = dapo 0.28, gspo 4e-4, cispo 5.0")
    clip_ratio_c: float | Literal["auto"] | None = setting(
        AUTO, "dual clip for negative advantages (dapo's per-token ratio only); auto = 10.0 for dapo (verl recipe; "
              "not in the paper), off for gspo and cispo; null = off")
    loss_agg_mode: str = setting(
        AUTO, "token-mean (DAPO, CISPO), seq-mean-token-mean (GRPO, GSPO), seq-mean-token-sum, "
              "seq-mean-token-sum-norm (Dr. GRPO); auto = the policy loss's")
    loss_scale_factor: float | None = setting(
        None, "seq-mean-token-sum-norm's constant divisor (Dr. GRPO's generation budget); null = "
              "rollout.max_response_length")

    def __post_init__(self):
        low, high, c = self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c
        if low != AUTO and not 0 <= low <= 1:
            fail(f"loss.clip_ratio_low must be in [0, 1] (1: no lower bound), got {low}")
        if high != AUTO and not 0 <= high <= 10:
            fail(f"loss.clip_ratio_high must be in [0, 10], got {high} (DAPO uses 0.28)")
        if c not in (AUTO, None) and high != AUTO:
            from megatron_dapo.algo.losses import dual_clip_error  # the loss's own rule (algo imports torch)

            if (error := dual_clip_error(c, high)) is not None:
                fail(f"loss.{error}")
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            fail(f"loss.loss_scale_factor must be > 0 (tokens), got {self.loss_scale_factor}")

    def resolved(self, max_response_length: int | None) -> "LossConfig":
        """This section with every "auto" replaced by the policy loss's paper value (POLICY_LOSS_DEFAULTS)
        and seq-mean-token-sum-norm's constant set (``max_response_length``, the generation budget,
        unless loss_scale_factor is given); refuses what the chosen loss does not define."""
        auto = [k for k in POLICY_LOSS_DEFAULTS["dapo"] if getattr(self, k) == AUTO]
        paper = POLICY_LOSS_DEFAULTS.get(self.policy_loss)
        if auto and paper is None:
            fail(f"loss.policy_loss={self.policy_loss!r} has no paper defaults here: set loss.{', loss.'.join(auto)}")
        high = paper["clip_ratio_high"] if self.clip_ratio_high == AUTO else self.clip_ratio_high
        if "clip_ratio_c" in auto:
            from megatron_dapo.algo.losses import dual_clip_error

            if (error := dual_clip_error(paper["clip_ratio_c"], high)) is not None:
                fail(f"loss.clip_ratio_c=auto is {self.policy_loss}'s {paper['clip_ratio_c']}: loss.{error}")
        out = dataclasses.replace(self, **{k: paper[k] for k in auto})
        if out.clip_ratio_c is not None and out.policy_loss != "dapo":
            fail(f"loss.clip_ratio_c={out.clip_ratio_c} with loss.policy_loss={out.policy_loss}: the dual clip caps "
                 "dapo's per-token ratio and this loss has none; set loss.clip_ratio_c=auto (or null)")
        if out.loss_agg_mode == "seq-mean-token-sum-norm":
            factor = out.loss_scale_factor or max_response_length
            if factor is None:
                fail("loss.loss_agg_mode=seq-mean-token-sum-norm divides by a constant: set loss.loss_scale_factor "
                     "(Dr. GRPO: the generation budget in tokens)")
            return dataclasses.replace(out, loss_scale_factor=float(factor))
        if out.loss_scale_factor is not None:
            fail(f"loss.loss_scale_factor={out.loss_scale_factor} is read only by "
                 f"loss_agg_mode=seq-mean-token-sum-norm, not {out.loss_agg_mode}; drop it or switch the mode")
        return out

    def loss_kwargs(self) -> dict[str, Any]:
        """The policy loss's keyword arguments (algo/losses.py); "auto" keys resolved without a generation
        budget (a section from ``resolved`` already has one)."""
        loss = self.resolved(None)
        kw = dict(clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high,
                  clip_ratio_c=loss.clip_ratio_c, loss_agg_mode=loss.loss_agg_mode)
        if loss.loss_scale_factor is not None:
            kw["loss_scale_factor"] = loss.loss_scale_factor
        return kw
