"""The train step (policy/train_step.py) at TP=2 + SP, PP=2 and PP=2 x VPP=2 equals one process (TP=1)
doing the update by hand in plain torch.

Reference (each rank, redundantly): a TP=1 GPTModel, the whole batch right-padded by hand,
log-probs from a full-vocabulary log_softmax at the rollout temperature, the DAPO loss as one
token-mean over the batch (algo.compute_policy_loss without global counts), torch's
clip_grad_norm_ and torch.optim.AdamW with megatron's no-decay rule (biases and 1-D params).
Then each layout loads the same weights (sharded by hand, harness.py) and runs
``compute_log_probs`` (forward only) and ``train_step``; the updated weights come back as full
HF tensors through ``MegatronActor.export_hf_weights`` and must equal the reference's.

Adam's first step is lr * g / (|g| + eps): with the default eps it is ~ lr * sign(g) and would
hide a wrong gradient scale, so these tests use adam_eps = 1e-2, above most |g| of this tiny
model (after clipping): the update is then close to lr * g / eps.
clip_grad is set below the gradient norm so that the global norm (over TP / PP / DP) matters.
The TP=2 layout also runs the mini-batch as 1 micro-batch and as 4 (token budget).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.config import (
    DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, ParallelConfig, RewardConfig,
    RolloutConfig, TrainConfig,
)
from megatron_dapo.policy.batching import Sample
from tests.distributed.harness import VOCAB, assert_close, full_params, load_full, spawn, tiny_hf_config

pytestmark = pytest.mark.distributed
TEMPERATURE, LR, CLIP, ADAM_EPS = 0.8, 0.1, 0.5, 1e-2
SHAPES = [(3, 9), (5, 14), (2, 6), (7, 20), (4, 11), (6, 3), (3, 17), (8, 8)]  # (prompt, response)


def tiny_cfg(*, tp=1, pp=1, vpp=None, sp=False, dist_opt=True, budget=40, micro_batch_size=1, warmup=1):
    """Sizes for a 2-process CPU run. make_vocab_size_divisible_by=64 pads the vocabulary (120)
    to 128 (at TP=1 and 2 alike), so the reference needs the padding mask. 4 prompts per step in
    mini-batches of 2: 2 updates per rollout step, so warmup=1 step means lr / 2 on update 1."""
    return DAPOConfig(
        seed=1,
        model=ModelConfig(make_vocab_size_divisible_by=64),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp,
                                use_distributed_optimizer=dist_opt),
        data=DataConfig(prompts_per_step=4, gen_prompts_per_batch=4, max_prompt_length=8),
        rollout=RolloutConfig(temperature=TEMPERATURE, max_response_length=24),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)),
        train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=budget,
                          micro_batch_size=micro_batch_size),
        optim=OptimConfig(lr=LR, lr_warmup_steps=warmup, adam_eps=ADAM_EPS, clip_grad=CLIP, weight_decay=0.1))


def make_samples(seed: int, shapes=SHAPES) -> list[Sample]:
    """Random ids, per-sequence advantages of both signs, one response with a partial loss mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(shapes):
        mask = (torch.arange(r) < r // 2).float() if i == 1 else None  # e.g. a filtered tail
        out.append(Sample(prompt_ids=torch.randint(0, VOCAB, (p,), generator=g),
                          response_ids=torch.randint(0, VOCAB, (r,), generator=g),
                          advantages=float(torch.randn((), generator=g)), loss_mask=mask))
    return out


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
    cfg = tiny_cfg().loss
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


def to_hf(weights: dict, hf: dict, padded_vocab: int = 128) -> dict:
    from megatron_dapo.convert import conversion_table, megatron_to_hf_state_dict
    return megatron_to_hf_state_dict(conversion_table(hf, padded_vocab_size=padded_vocab), weights)


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def load_weights(actor, weights: dict) -> None:
    from megatron.core import parallel_state as ps
    load_full([unwrap(c) for c in actor.model], weights, ps.get_tensor_model_parallel_rank(),
              ps.get_tensor_model_parallel_world_size())


def assert_hf_equal(actor, want: dict, what: str, atol=1e-6):
    got = dict(actor.export_hf_weights())
    assert sorted(got) == sorted(want)
    for name in want:
        assert_close(got[name], want[name], f"{what}: {name}", atol=atol, rtol=1e-5)


def _worker(rank):
    from megatron_dapo.policy import build_model, destroy_parallel, initialize_parallel
    from megatron_dapo.policy.actor import MegatronActor
    from megatron_dapo.policy.train_step import compute_log_probs, train_step

    hf = tiny_hf_config(num_hidden_layers=4)
    base = tiny_cfg()
    initialize_parallel(hf, parallel=base.parallel, model=base.model, seed=3)
    ref, fresh = build_model(hf, model=base.model, parallel=base.parallel)[0], None
    w0 = full_params([ref])
    xs = with_old_log_probs(ref, make_samples(0), seed=1)
    with torch.no_grad():
        fw0 = reference_forward(ref, xs)
    want = reference_update(ref, xs, lr=LR / 2)
    assert want["grad_norm"] > 2 * CLIP  # clipping is active
    w1 = full_params([ref])
    assert max((w1[k] - w0[k]).abs().max() for k in w0) > 1e-3  # the update is far above the tolerances
    hf_w1 = to_hf(w1, hf)
    destroy_parallel(process_group=False)

    layouts = [("tp2_sp", dict(tp=2, sp=True)), ("pp2", dict(pp=2)),
               # interleaved at PP=2: uniform [2, 28] micro-batches (optimizer.py), 4 of them at 56 tokens
               ("pp2_vpp2", dict(pp=2, vpp=2, dist_opt=False, budget=56))]
    for name, kw in layouts:
        actor = MegatronActor(tiny_cfg(**kw), hf)
        load_weights(actor, w0)
        lps, ents = compute_log_probs(actor.model, xs, actor.settings)
        for i, s in enumerate(fw0["spans"]):
            assert_close(lps[i], fw0["lp"][i, s], f"{name}: log-probs of sample {i}")
            assert_close(ents[i], fw0["ent"][i, s], f"{name}: entropy of sample {i}")
        variants = [("4 micro-batches", actor.settings)]
        if name == "tp2_sp":
            fresh = MegatronActor(tiny_cfg(**kw), hf, initialize=False)  # same start, one micro-batch
            load_weights(fresh, w0)
            one = dataclasses.replace(actor.settings, max_tokens_per_micro_batch=0, micro_batch_size=len(xs))
            variants.append(("1 micro-batch", one))
        for (what, settings), a in zip(variants, [actor, fresh]):
            m = train_step(a.model, a.optimizer, a.scheduler, xs, settings)
            assert m["actor/num_micro_batches"] == (4 if what.startswith("4") else 1), m
            assert_close(torch.tensor(m["actor/pg_loss"]), want["loss"], f"{name}, {what}: loss")
            assert_close(torch.tensor(m["actor/grad_norm"]), want["grad_norm"], f"{name}, {what}: grad norm")
            assert_close(torch.tensor(m["actor/entropy"]), want["entropy"], f"{name}, {what}: entropy")
            for key in ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low", "actor/ratio_mean",
                        "actor/ratio_max"):
                assert_close(torch.tensor(m[key]), want["metrics"][key], f"{name}, {what}: {key}")
            assert m["actor/num_tokens"] == want["num_tokens"] and m["actor/lr"] == pytest.approx(LR / 2)
            assert_hf_equal(a, hf_w1, f"{name}, {what}: weights after the update")
        destroy_parallel(process_group=False)


def test_train_step_layouts_equal_one_process():
    spawn(_worker)
