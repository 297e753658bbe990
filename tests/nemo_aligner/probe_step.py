"""One DAPO training step of the real NeMo-Aligner actor, against a direct whole-batch reference.

    .venv-nemo/bin/torchrun --nproc_per_node N tests/nemo_aligner/probe_step.py OUT.json MBS

Runs the step in ReinforceTrainer.run_training's order with NeMo's own pieces: init_using_ptl (the
optimizer and scheduler NeMo builds), get_inference_log_probs for pi_old, prepare_for_training(_step),
the adapter's get_loss_and_metrics (megatron-core 0.10's schedule over the micro-batches),
finish_training_step (NeMo's DP gradient all-reduce), upstream clip_gradients, optimizer.step().

The reference, on every rank, from the same initial weights: one forward of the WHOLE global batch
(all ranks' rows, one micro-batch), the clipped surrogate written out here, summed over valid
tokens and divided by their count (DAPO's token-mean), autograd; then clipping and AdamW by hand.
Upstream PPO's own loss on the same batch is recorded too: a mean of per-micro-batch token means.
Rank 0 writes the comparison to OUT.json.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.nemo_aligner import tiny  # noqa: E402

CLIP_LOW, CLIP_HIGH, LR, CLIP_NORM = 0.2, 0.28, 1e-3, 1.0


def surrogate(curr, prev, adv, low=CLIP_LOW, high=CLIP_HIGH):
    """[B, T] each -> [B, T] per-token clipped surrogate and ratio, written independently of algo/."""
    ratio = torch.exp(curr - prev)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)), ratio


def hand_loss(curr, prev, adv, mask):
    """[B, T] each -> (DAPO's token-mean of the Clip-Higher surrogate, its metrics)."""
    per_token, ratio = surrogate(curr, prev, adv)
    n = mask.sum()
    valid = mask > 0
    return (per_token * mask).sum() / n, {
        "actor/pg_loss": ((per_token * mask).sum() / n).item(),
        "actor/ratio_mean": ((ratio * mask).sum() / n).item(),
        "actor/ratio_max": ratio[valid].max().item(),
        "actor/pg_clipfrac_high": (((adv > 0) & (ratio > 1 + CLIP_HIGH) & valid).sum() / n).item(),
        "actor/pg_clipfrac_low": (((adv < 0) & (ratio < 1 - CLIP_LOW) & valid).sum() / n).item()}


def per_micro_batch_mean(curr, prev, adv, mask, mbs, eps):
    """Upstream PPO's loss, by hand: symmetric clip ``eps``, each micro-batch's own token mean, then
    the mean over micro-batches."""
    per_token, _ = surrogate(curr, prev, adv, eps, eps)
    means = [(per_token[i:i + mbs] * mask[i:i + mbs]).sum() / mask[i:i + mbs].sum()
             for i in range(0, len(mask), mbs)]
    return torch.stack(means).mean().item()


def main(out: str, mbs: int) -> None:
    tiny.setup()
    from nemo_aligner.utils.train_script_utils import (extract_optimizer_scheduler_from_ptl_model,
                                                        init_using_ptl)
    from nemo_aligner.utils.train_utils import clip_gradients
    from megatron.core import parallel_state as ps

    from megatron_dapo.integrations import nemo_aligner as na

    work = Path(out).parent
    rows = 8
    ptl_trainer, actor, cfg = tiny.build(tiny.model_config(tiny.save_tokenizer(work / "tok"), mbs=mbs,
                                                           gbs=rows, lr=LR))
    init_using_ptl(ptl_trainer, actor, None, None)
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(actor)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    batch = tiny.rollout_batch(rows, seed=7)
    prev = actor.get_inference_log_probs(batch["response_tokens"], forward_micro_batch_size=mbs)
    noise = torch.Generator().manual_seed(3)
    batch["logprobs"] = prev + 0.3 * torch.randn(prev.shape, generator=noise)  # clip some tokens
    settings = na.trainer_settings(tiny.dapo_section(prompts=2), max_response_length=16, model_gbs=rows)
    groups = na.group_rows(batch["response_tokens"], batch["prompt_lengths"], settings.group_size)
    data, _ = na.dapo_rollout_data(batch, groups, settings)

    params = [p for p in actor.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    # -- the reference: the whole global batch at once, by hand --
    tokens = data["response_tokens"]
    attn, _, pos = actor.get_ltor_masks_and_position_ids(tokens)
    logits = actor.model(tokens, pos, attn, labels=None)
    curr = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ref_loss, ref_metrics = hand_loss(curr, data["prev_logprobs"], data["advantages"], data["mask"])
    ref_grads = torch.autograd.grad(ref_loss, params)
    # -- upstream PPO's own loss on the same rows (forward only; it masks with is_end too) --
    ppo_mask = data["mask"] * data["is_end"].float().unsqueeze(-1)
    eps = float(cfg.model.ppo.ratio_eps)
    upstream_hand = per_micro_batch_mean(curr.detach(), data["prev_logprobs"], data["advantages"], ppo_mask,
                                         mbs, eps)
    token_mean_sym = (surrogate(curr.detach(), data["prev_logprobs"], data["advantages"], eps, eps)[0]
                      * ppo_mask).sum().item() / ppo_mask.sum().item()
    if dp == 1:  # upstream's own forward and loss_func, bound to this actor for one call
        ppo_cls = type(actor).__mro__[1]
        actor.get_actor_forward_output_and_loss_func = types.MethodType(
            ppo_cls.get_actor_forward_output_and_loss_func, actor)
        upstream = ppo_cls.get_loss_and_metrics(actor, dict(data, mask=ppo_mask), True)[0]
        del actor.get_actor_forward_output_and_loss_func
    else:
        upstream = None  # upstream averages per-rank means over DP as well; compared at 1 rank

    # -- the real step, each DP rank on its share --
    share = na.data_parallel_share(data, rank, dp)
    loss, metrics, micro_batches = tiny.loss_and_gradients(actor, optimizer, share)
    grads = [p.grad.detach().clone() for p in params]
    grad_norm = clip_gradients(actor, CLIP_NORM)
    optimizer.step()
    scheduler.step()
    actor.finish_training()

    # -- the reference update: clip, then AdamW's first step, by hand --
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads))
    scale = min(1.0, CLIP_NORM / (norm.item() + 1e-6))
    expected = [w - LR * torch.sign(g) * (g * scale).abs() / ((g * scale).abs() + 1e-8)
                for w, g in zip(start, ref_grads)]  # m/(sqrt(v)+eps) after bias correction at step 1
    after = [p.detach() for p in params]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()  # noqa: E731
    result = {
        "dp": dp, "micro_batches": micro_batches, "params": sum(p.numel() for p in params),
        "loss": loss, "ref_loss": ref_loss.item(),
        "upstream_loss": upstream, "upstream_hand_loss": upstream_hand,
        "token_mean_symmetric_loss": token_mean_sym,
        "metrics": {k: metrics[k] for k in ref_metrics}, "ref_metrics": ref_metrics,
        "grad_max_rel": max(rel(g, r) for g, r in zip(grads, ref_grads)),
        "grad_norm": float(grad_norm), "ref_grad_norm": norm.item(),
        # where |g| is not far above Adam's eps its first step amplifies the gradients' 4e-7 (measured 4.4e-4
        # on one machine, 2.3e-3 on another, with the same code); elsewhere the step is +-lr to within 1%
        "update_max_rel": max(rel((a - s)[m], (e - s)[m]) for a, s, e, m in
                              zip(after, start, expected, ((g * scale).abs() > 1e-6 for g in ref_grads))),
        "all_changed": all(not torch.equal(a, s) for a, s in zip(after, start)),
        "optimizer": type(optimizer).__name__,
    }
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
