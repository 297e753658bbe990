"""Megatron DDP, AdamW through ``get_megatron_optimizer`` and the learning-rate schedule.

What is wrapped and why (megatron-core 0.19.2):
* ``Float16Module`` (bf16 only): casts first-stage inputs and last-stage outputs, as
  megatron-training does; fp32 models are not wrapped.
* ``DistributedDataParallel`` with ``grad_reduce_in_fp32`` (bf16 grads accumulate and reduce in
  fp32 ``main_grad`` buffers). Overlapping the gradient reduce with backward is a GPU
  optimisation; it stays off on CPU, where the gloo collectives would only add threads.
  DDP pre-scales gradients by 1 / (DP x CP) before summing them over DP x CP
  (distributed_data_parallel.py:212, param_and_grad_buffer.py:661): train_step.py undoes this.
* ``finalize_model_grads`` as the config's hook: the schedules call it once per mini-batch to run
  the DP reduce, the sequence-parallel norm all-reduce and the tied-embedding all-reduce over PP.
* ``get_megatron_optimizer``: torch AdamW (decoupled weight decay) without TE / apex, the
  distributed optimizer (state sharded over DP) when ``parallel.use_distributed_optimizer``;
  biases and 1-D parameters (norms) get no weight decay (megatron's standard overrides), and the
  global gradient norm is clipped to ``optim.clip_grad`` (0 = off).
* ``OptimizerParamScheduler``: linear warmup over ``optim.lr_warmup_steps`` rollout steps, i.e.
  ``lr_warmup_steps x updates_per_step`` optimizer updates, then constant. The scheduler is
  advanced *before* each update, so update k (1-based) uses lr x min(1, k / warmup_updates) and
  no update is spent at lr = 0 (megatron-training steps it after, so its first update has lr 0).
"""

from __future__ import annotations

import torch

from megatron_dapo.config import OptimConfig


def wrap_model(chunks: list, *, use_distributed_optimizer: bool,
               overlap_grad_reduce: bool | None = None) -> list:
    """Wrap each model chunk in (Float16Module and) megatron DDP, register the schedule hooks on
    their shared TransformerConfig, and broadcast DP rank 0's weights so all replicas start equal."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    if config.calculate_per_token_loss:
        raise ValueError("train_step.py's loss scaling assumes calculate_per_token_loss=False")
    overlap = torch.cuda.is_available() if overlap_grad_reduce is None else overlap_grad_reduce
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        if config.bf16 or config.fp16:
            chunk = Float16Module(config, chunk)
        # Buckets exist to overlap the reduce with backward: none without overlap, and (as in
        # megatron-training) none after the first chunk, whose reduce overlaps other chunks' compute.
        wrapped.append(DistributedDataParallel(config, ddp_config, chunk,
                                               disable_bucketing=i > 0 or not overlap))
    for chunk in wrapped:
        chunk.broadcast_params()
    config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
        config.grad_sync_func = ([c.start_grad_sync for c in wrapped] if len(wrapped) > 1
                                 else wrapped[0].start_grad_sync)
    return wrapped


def build_optimizer(wrapped: list, optim: OptimConfig, *, use_distributed_optimizer: bool):
    """Megatron's optimizer (a ChainedOptimizer over torch AdamW) for DDP-wrapped chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = wrapped[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=0.0,
        weight_decay=optim.weight_decay,
        decoupled_weight_decay=True,  # AdamW
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        fp16=False,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return get_megatron_optimizer(opt_config, wrapped)


def build_scheduler(optimizer, optim: OptimConfig, *, updates_per_step: int):
    """Linear warmup over ``optim.lr_warmup_steps`` rollout steps (x ``updates_per_step``
    optimizer updates) from 0 to ``optim.lr``, then constant. Advance it by one before each
    update (train_step.py does). Resuming keeps the configured lr and takes the step count
    from the checkpoint."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if updates_per_step < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {updates_per_step}")
    warmup = optim.lr_warmup_steps * updates_per_step
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=0.0,
        lr_warmup_steps=warmup,
        lr_decay_steps=warmup + 1,  # unused by the constant style; megatron asserts it > warmup
        lr_decay_style="constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,  # config wins over a checkpoint, except num_steps
    )


def current_lr(optimizer) -> float:
    """The learning rate of the groups on the default schedule (what the scheduler set last)."""
    for group in optimizer.param_groups:
        if group.get("default_config", True):
            lr = group["lr"]
            return float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    return float(optimizer.param_groups[0]["lr"])
