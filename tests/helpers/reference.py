"""The DAPO update by hand in plain torch, the reference the Megatron train step is checked against
(tests/distributed/test_policy_train_step.py, test_policy_dp.py).

A TP=1 GPTModel, the whole batch right-padded by hand, log-probs from a full-vocabulary
log_softmax at the rollout temperature, the DAPO loss as one token-mean over the batch
(algo.compute_policy_loss without global counts), torch's clip_grad_norm_ and torch.optim.AdamW
with megatron's no-decay rule (biases and 1-D params)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.batching import Sample
from tests.helpers.policy import CLIP, TEMPERATURE, VOCAB, tiny_cfg


def reference_forward(model, xs: list[Sample]) -> dict:
    """The whole batch by hand: [B, L] right-padded ids, next-token targets, response mask, and
    full-vocabulary log-probs / entropy at the rollout temperature."""
    b, length = len(xs), max(x.num_tokens for x in xs)
    ids, targets = torch.zeros(b, length, dtype=torch.long), torch.zeros(b, length, dtype=torch.long)
    mask, adv, old = torch.zeros(b, length), torch.zeros(b, length), torch.zeros(b, length)
    spans = []
    for i, x in enumerate(xs):
        full = torch.cat([x.prompt_ids, x.response_ids])
        ids[i, : len(full)], targets[i, : len(full) - 1] = full, full[1:]
        span = slice(x.num_prompt_tokens - 1, x.num_prompt_tokens - 1 + x.num_response_tokens)
        spans.append(span)
        mask[i, span] = 1.0 if x.loss_mask is None else x.loss_mask
        adv[i, span] = x.advantages
        if x.old_log_probs is not None:
            old[i, span] = x.old_log_probs
    logits = model(ids, torch.arange(length).expand(b, length), None)[..., :VOCAB].float() / TEMPERATURE
    logp = F.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return dict(lp=lp, ent=ent, mask=mask, adv=adv, old=old, spans=spans)


def with_old_log_probs(model, xs: list[Sample], seed: int) -> list[Sample]:
    """A stale old policy: the current log-probs plus noise, so ratios spread over the clip range."""
    with torch.no_grad():
        fw = reference_forward(model, xs)
    g = torch.Generator().manual_seed(seed)
    noise = [0.3 * torch.randn(x.num_response_tokens, generator=g) for x in xs]
    return [dataclasses.replace(x, old_log_probs=fw["lp"][i, s] + noise[i])
            for i, (x, s) in enumerate(zip(xs, fw["spans"]))]


def dapo_loss(fw, rows=None, **kw):
    cfg = tiny_cfg().loss_settings()
    take = (lambda t: t) if rows is None else (lambda t: t[rows])
    return compute_policy_loss(take(fw["lp"]), take(fw["old"]), take(fw["adv"]), take(fw["mask"]),
                               clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                               clip_ratio_c=cfg.clip_ratio_c, **kw)


def reference_update(model, xs: list[Sample], *, lr: float, loss_fn=None) -> dict:
    """One AdamW update by hand. ``loss_fn(fw) -> loss`` replaces the whole-batch token-mean."""
    opt_cfg = tiny_cfg().optim
    model.zero_grad(set_to_none=True)
    fw = reference_forward(model, xs)
    loss, metrics = dapo_loss(fw)
    if loss_fn is not None:
        loss = loss_fn(fw)
    loss.backward()
    params = [p for p in model.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    decay = [p for p in params if all(p is not q for q in no_decay)]
    groups = [{"params": decay, "weight_decay": opt_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    betas = (opt_cfg.adam_beta1, opt_cfg.adam_beta2)
    torch.optim.AdamW(groups, lr=lr, betas=betas, eps=opt_cfg.adam_eps).step()
    mask = fw["mask"]
    return dict(loss=loss.detach(), grad_norm=norm, entropy=(fw["ent"] * mask).sum() / mask.sum(),
                num_tokens=mask.sum(), metrics=metrics)
