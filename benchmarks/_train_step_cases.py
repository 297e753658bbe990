"""The measured cases of benchmarks/train_step.py and the update each side runs on them, in a child
process of its own (train_step.py --make / --child): the sizes, the hyperparameters both sides
share, the mini-batch, the weights, and the megatron and HF updates with their memory accounting.
train_step.py's docstring says what one update is on each side."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time

from _rss import reset_peak, rss_mb
from _train_step_profile import profile_megatron, profile_update

LAYERS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2)
QUICK_LAYERS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
VOCABS = {"small": 8192, "qwen": 152064}
QUICK_VOCABS = {"small": 4096, "qwen": 152064}
TEMPERATURE, LR, CLIP, WEIGHT_DECAY = 1.0, 1e-5, 1.0, 0.1


@dataclasses.dataclass(frozen=True)
class Case:
    vocab: int
    layers: dict
    seqs: int
    seq_len: int
    prompt: int
    updates: int  # measured, after one warm-up
    recompute: str = "none"  # megatron's model.recompute; "full" also turns on HF's gradient checkpointing
    profile: bool = False
    threads: int = 2

    @property
    def tokens(self) -> int:
        return self.seqs * self.seq_len


def make_cases(quick: bool, recompute: str, profile: bool, threads: int,
               only: tuple[str, ...] = tuple(VOCABS)) -> dict[str, Case]:
    layers, vocabs = (QUICK_LAYERS, QUICK_VOCABS) if quick else (LAYERS, VOCABS)
    vocabs = {k: v for k, v in vocabs.items() if k in only}
    seqs, seq_len, prompt, updates = (2, 256, 64, 1) if quick else (8, 512, 128, 3)
    return {f"V={v}" + ("" if recompute == "none" else f", recompute {recompute}"): Case(
        vocab=v, layers=layers, seqs=seqs, seq_len=seq_len, prompt=prompt, updates=updates,
        recompute=recompute, profile=profile, threads=threads) for v in vocabs.values()}


# -- inside a child process ------------------------------------------------------------------------

def _hf_config(case: Case) -> dict:
    return dict(model_type="qwen2", vocab_size=case.vocab, **case.layers, rms_norm_eps=1e-6,
                rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
                max_position_embeddings=max(512, case.seq_len), hidden_act="silu", initializer_range=0.02)


def _batch(case: Case):
    """[B, S] ids, [B] advantages, [B, R] old log-probs (R = seq_len - prompt response tokens)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, case.vocab, (case.seqs, case.seq_len), generator=g)
    adv = torch.randn(case.seqs, generator=g)
    old = -math.log(case.vocab) + 0.3 * torch.randn(case.seqs, case.seq_len - case.prompt, generator=g)
    return ids, adv, old


def make_weights(case: Case, path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = _hf_config(case)
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "rope_parameters")}
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**kwargs, rope_theta=1e6)).save_pretrained(path)


def _timed_updates(case: Case, update) -> dict:
    """One warm-up update, then ``case.updates`` measured ones; update() -> (pg_loss, grad_norm)."""
    reset_peak()
    losses, norms, seconds = [], [], []
    for i in range(1 + case.updates):
        start = time.perf_counter()
        loss, norm = update()
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        norms.append(norm)
    measured = seconds[1:]
    return dict(losses=losses, grad_norms=norms, seconds=measured, warmup_s=seconds[0],
                best_s=min(measured), tokens_per_s=case.tokens / min(measured))


def _megatron_side(case: Case, weights: str) -> dict:
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    import megatron.core  # noqa: F401  (in the import baseline, as transformers is on the HF side)

    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, ParallelConfig, RewardConfig,
        RolloutConfig, TrainConfig,
    )
    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.batching import Sample

    base = rss_mb()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    cfg = DAPOConfig(
        seed=0, num_threads=case.threads,
        model=ModelConfig(dtype="fp32", transformer_impl="local", recompute=case.recompute),
        parallel=ParallelConfig(),  # use_distributed_optimizer=True, the default
        data=DataConfig(prompts_per_step=1, gen_prompts_per_batch=1, max_prompt_length=case.prompt),
        rollout=RolloutConfig(temperature=TEMPERATURE, max_response_length=case.seq_len - case.prompt),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(enable=False)),
        train=TrainConfig(mini_batch_prompts=1, max_tokens_per_micro_batch=case.tokens),  # one micro-batch
        optim=OptimConfig(lr=LR, lr_warmup_steps=0, weight_decay=WEIGHT_DECAY, clip_grad=CLIP))
    actor = MegatronActor(cfg, _hf_config(case))
    actor.load_hf_weights(weights)
    ids, adv, old = _batch(case)
    samples = [Sample(prompt_ids=ids[i, :case.prompt], response_ids=ids[i, case.prompt:],
                      advantages=float(adv[i]), old_log_probs=old[i]) for i in range(case.seqs)]
    actor.prepare_for_training()

    def update():
        m = actor.get_loss_and_metrics(samples)
        return m["actor/pg_loss"], m["actor/grad_norm"]

    out = _timed_updates(case, update)
    out["peak_mb"] = rss_mb("VmHWM") - base
    out["static_mb"] = _static_megatron(actor)
    if case.profile:
        out["profile"] = profile_megatron(actor, update)
    destroy_parallel()
    return out


def _static_megatron(actor) -> dict:
    """MB of what lives across updates: parameters, the DDP gradient buffers, Adam states."""
    import torch

    params = sum(p.numel() * p.element_size() for c in actor.model for p in c.parameters())
    grads = sum(buf.grad_data.numel() * buf.grad_data.element_size()
                for c in actor.model for buf in c.buffers + c.expert_parallel_buffers)
    states = 0
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for state in opt.optimizer.state.values():
            states += sum(t.numel() * t.element_size() for t in state.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"params": params / 2**20, "grads": grads / 2**20, "optimizer_states": states / 2**20}


def _hf_side(case: Case, weights: str) -> dict:
    import torch
    import transformers
    from torch.profiler import record_function

    from megatron_dapo.algo import compute_policy_loss

    base = rss_mb()
    model = transformers.Qwen2ForCausalLM.from_pretrained(weights, dtype=torch.float32)
    for p in model.parameters():  # own the memory (no file-backed pages of the safetensors mmap)
        p.data = p.data.clone()
    if case.recompute == "full":  # per-layer checkpoints, as megatron's "full" (uniform, 1 layer)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # megatron's rule: no weight decay on biases and 1-D parameters (the norms)
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8)
    ids, adv, old = _batch(case)
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # position t predicts t + 1
    span = slice(case.prompt - 1, case.seq_len - 1)  # positions whose label is a response token
    mask, old_full, adv_full = (torch.zeros(case.seqs, case.seq_len) for _ in range(3))
    mask[:, span], old_full[:, span] = 1.0, old
    adv_full[:, span] = adv[:, None]
    num_tokens = float(mask.sum())
    params = list(model.parameters())

    def update():  # labelled for the profile (record_function costs nothing without one)
        opt.zero_grad(set_to_none=True)
        with record_function("forward"):
            logits = model(input_ids=ids, use_cache=False).logits  # [B, S, V] fp32
        with record_function("logprobs_fwd"):
            logits.div_(TEMPERATURE)  # in place, as verl's actor does
            logp = torch.log_softmax(logits, dim=-1)
            lp = logp.gather(-1, labels[..., None]).squeeze(-1)
            with torch.no_grad():  # the entropy metric megatron reports too, 256 positions at a time
                flat = logp.detach().view(-1, logp.shape[-1])
                ent = torch.cat([-(c.exp() * c).sum(-1) for c in flat.split(256)]).view_as(mask)
                entropy = (ent * mask).sum() / num_tokens
        loss, metrics = compute_policy_loss(lp, old_full, adv_full, mask, clip_ratio_low=0.2,
                                            clip_ratio_high=0.28, clip_ratio_c=10.0,
                                            global_num_tokens=num_tokens)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
            with record_function("adamw"):
                opt.step()
        entropy.item()  # the host sync megatron's metrics make
        return metrics["actor/pg_loss"].item(), float(norm)

    out = _timed_updates(case, update)
    if case.profile:
        out["profile"] = profile_update(update)
    out["peak_mb"] = rss_mb("VmHWM") - base
    static = sum(p.numel() * p.element_size() for p in params) / 2**20
    out["static_mb"] = {"params": static, "grads": static, "optimizer_states": 2 * static}
    return out


def child(side: str, case: Case, weights: str) -> dict:
    import torch

    torch.set_num_threads(case.threads)
    out = _megatron_side(case, weights) if side == "megatron" else _hf_side(case, weights)
    out.update(side=side, threads=torch.get_num_threads())
    return out

