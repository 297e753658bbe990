"""``megatron-dapo example``: one prompt followed through a DAPO step, printed number by number.

One training prompt -> its G sampled responses (the run's engine settings and seed rule) -> the
reward of each by both scorers (``reward.fn``, which trains, and ``eval.reward_fn``, the paper's
rule) -> the overlong penalty and the shaped reward -> the group's advantages -> each response's
share of the token-mean loss of a mini-batch made of this group. The share is computed by the
loss function the trainer uses (algo.losses) at the step's first update, where pi_theta = pi_old
(ratio 1, nothing clipped), so a response's share is -A_i x (its tokens) / (the group's tokens);
the shares add up to the group's loss. Uses the run's starting weights (model.hf_path, or with
toy.enable the demo's base, made in logging.dir on first use); builds no Megatron model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.algo import get_advantage_fn, get_policy_loss_fn
from megatron_dapo.config import DAPOConfig
from megatron_dapo.errors import InputError
from megatron_dapo.groups import score_rollouts, shape_groups
from megatron_dapo.rollout.engine import EngineSpec, Rollout, rollout_sampling_params


@dataclass(frozen=True)
class Row:
    """One response of the group, with every number the step computes for it."""

    text: str
    num_tokens: int
    finish_reason: str
    pred: str  # the answer the training scorer read
    score: float  # reward.fn's +1 / -1
    paper_score: float  # eval.reward_fn's +1 / -1
    overlong: float  # the overlong penalty (<= 0)
    reward: float  # score + overlong: what the advantages see
    advantage: float
    loss_share: float


@dataclass(frozen=True)
class Example:
    prompt_index: int
    prompt_text: str
    ground_truth: str
    rows: list[Row]
    loss: float  # the group's token-mean loss, in one call of the loss function
    num_tokens: int


def run_example(cfg: DAPOConfig, prompt_index: int = 0) -> Example:
    from megatron_dapo.rollout.hf_engine import HFEngine
    from megatron_dapo.rollout.placement import RolloutPlacement
    from megatron_dapo.run import make_reward_pool, prepare_run

    loss = cfg.loss_settings()
    if (loss.policy_loss, loss.loss_agg_mode, cfg.algorithm.estimator) != ("dapo", "token-mean", "grpo"):
        # The text's formulas (each share -A x tokens / N, the gradient -A / N, (r - mean) / (std + eps)) are DAPO's.
        raise InputError(f"megatron-dapo example walks through DAPO's loss (loss.policy_loss=dapo, token-mean, the "
                         f"grpo advantage); this config has {loss.policy_loss}, {loss.loss_agg_mode}, "
                         f"{cfg.algorithm.estimator}: run it with those at their defaults")
    prep = prepare_run(cfg, lock=False)
    cfg, inputs = prep.cfg, prep.inputs
    if not 0 <= prompt_index < len(inputs.train_ids):
        raise InputError(f"--prompt {prompt_index}: data.train_files has {len(inputs.train_ids)} usable prompts; "
                         f"pick one in 0..{len(inputs.train_ids) - 1}")
    placement = RolloutPlacement(HFEngine.from_spec(EngineSpec.of(cfg)), alone=True)
    params = rollout_sampling_params(cfg.rollout, seed=cfg.seed, stop_token_ids=inputs.stops)
    _, outputs = placement.generate([inputs.train_ids[prompt_index]], cfg.rollout.n, params)
    truth = inputs.train_truths[prompt_index]
    pool = make_reward_pool(cfg.reward, cfg.eval)
    try:
        train_scores, paper_scores = score_rollouts(outputs, [truth], tokenizer=inputs.tokenizer, pool=pool,
                                                    fns=(cfg.reward.fn, cfg.eval.reward_fn))
    finally:
        pool.close()
    group, = shape_groups([prompt_index], outputs, train_scores, cfg.reward, cfg.rollout)
    advantages = get_advantage_fn(cfg.algorithm.estimator)(torch.tensor([group.rewards]),
                                                               eps=cfg.algorithm.adv_eps)[0]
    shares, loss, total = _loss_shares(outputs[0], advantages, cfg)
    tok = inputs.tokenizer
    rows = [Row(text=tok.decode(r.response_ids, skip_special_tokens=True), num_tokens=len(r.response_ids),
                finish_reason=r.finish_reason, pred=str(s.get("pred", "")), score=group.scores[k],
                paper_score=float(p["score"]), overlong=group.rewards[k] - group.scores[k], reward=group.rewards[k],
                advantage=float(advantages[k]), loss_share=shares[k])
            for k, (r, s, p) in enumerate(zip(outputs[0], train_scores, paper_scores))]
    return Example(prompt_index, tok.decode(inputs.train_ids[prompt_index], skip_special_tokens=False), truth,
                   rows, loss, total)


def _loss_shares(rollouts: list[Rollout], advantages: torch.Tensor, cfg: DAPOConfig) -> tuple[list[float], float, int]:
    """(each response's share, the group's loss, its valid tokens); ratio 1: log pi = log pi_old."""
    loss_fn = get_policy_loss_fn(cfg.loss.policy_loss)
    pad = torch.nn.utils.rnn.pad_sequence
    logp = pad([torch.tensor(r.logprobs) for r in rollouts], batch_first=True)  # [G, R_max]
    mask = pad([torch.ones(len(r.response_ids)) for r in rollouts], batch_first=True)
    if cfg.reward.overlong_filter:
        mask[[r.finish_reason == "length" for r in rollouts]] = 0.0
    kw = cfg.loss_settings().loss_kwargs()
    total = int(mask.sum())
    loss, _ = loss_fn(logp, logp, advantages, mask, global_num_tokens=total, **kw)
    shares = [float(loss_fn(logp[k:k + 1], logp[k:k + 1], advantages[k:k + 1], mask[k:k + 1],
                            global_num_tokens=total, **kw)[0]) for k in range(len(rollouts))]
    return shares, float(loss), total


def format_example(ex: Example, cfg: DAPOConfig) -> str:
    lines = [f"prompt {ex.prompt_index} of data.train_files, as the model sees it:", f"  {ex.prompt_text!r}",
             f"ground truth: {ex.ground_truth}",
             f"{len(ex.rows)} responses (rollout.n), temperature {cfg.rollout.temperature}, up to "
             f"{cfg.rollout.max_response_length} tokens:",
             f"  {'k':>2} {'response':<34} {'tok':>4} {'end':<6} {'pred':<6} {cfg.reward.fn:>10} "
             f"{cfg.eval.reward_fn:>16} {'overlong':>8} {'reward':>7} {'adv':>7} {'loss share':>11}"]
    for k, r in enumerate(ex.rows):
        text = r.text if len(r.text) <= 32 else "..." + r.text[-29:]
        lines.append(f"  {k:>2} {text!r:<34} {r.num_tokens:>4} {r.finish_reason:<6} {r.pred[:6]:<6} {r.score:>+10.0f} "
                     f"{r.paper_score:>+16.0f} {r.overlong:>8.3f} {r.reward:>7.3f} {r.advantage:>+7.3f} "
                     f"{r.loss_share:>+11.5f}")
    lines += [f"reward = {cfg.reward.fn} score + overlong penalty (buffer {cfg.reward.overlong_buffer.len} tokens "
              f"before the limit); advantage = (reward - group mean) / (group std + {cfg.algorithm.adv_eps:g}); a "
              "group whose answers are all right or all wrong has no advantage and dynamic sampling drops it",
              f"loss ({cfg.loss_settings().loss_agg_mode} over the group's {ex.num_tokens} tokens, first update of "
              f"the step: ratio 1): {ex.loss:+.5f} = the sum of the shares "
              f"({sum(r.loss_share for r in ex.rows):+.5f}); "
              "each share = -advantage x its tokens / the group's tokens",
              f"the loss's gradient with respect to each token's log-prob is -advantage / {ex.num_tokens}: the "
              "update raises the log-probs of responses with positive advantage and lowers the others, "
              "whatever the loss's value"]
    return "\n".join(lines)
