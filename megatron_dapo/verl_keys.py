"""verl's keys for a DAPO run and ours: the one table behind docs/from_verl.md and the config loader's hint.

``VERL_KEYS`` maps a verl key (as verl's DAPO recipe scripts spell it, older ones included, and verl
0.9.1's config) to ours, or to None where this project has no counterpart, with a note on units,
values and why. A key ending in ``.*`` covers everything under it; an exact entry wins over it. Both
count batch sizes in prompts; the micro-batch token budget here counts padded tokens.
``config_loading`` raises the line ``verl_hint`` writes when a verl key is given where ours belong.
"""

import difflib

DOC = "docs/from_verl.md"

_KL = "DAPO drops the KL term (paper section 2.3): there is no reference model and nothing to set"
_NO_GAE = "GAE's: there is no critic, so no GAE"
_BUDGET = ("tokens per micro-batch on each data-parallel rank, counted padded (rows x longest); one budget for the "
           "pi_old pass and the updates")
_SWITCH = "no switch: train.max_tokens_per_micro_batch > 0 is on, 0 is off"
_OFFLOAD_WEIGHTS = "the weights to host memory while the engine generates (with actor.offload_during_rollout)"
_OFFLOAD_OPTIMIZER = "the optimizer state and gradients to host memory while the engine generates"
_SEED = "one seed for data order, sampling and initialisation"
_RECOMPUTE = "full or selective; null is none"
_OVERLONG = "newer verl's spelling of reward_model.overlong_buffer"
_LOGGED = "always logged: reward/overlong_penalty_mean"
_CORRECTION = "verl's name and meaning"

VERL_KEYS: dict[str, tuple[str | None, str]] = {
    # data
    "data.train_files": ("data.train_files", "a list; one file name is read as a list of one"),
    "data.val_files": ("data.val_files", "AIME-2024 ships in data/"),
    "data.train_batch_size": ("data.prompts_per_step", "both count prompts, each with rollout.n responses"),
    "data.gen_batch_size": ("data.gen_prompts_per_batch", "both count prompts; read only with dynamic sampling"),
    "data.max_prompt_length": ("data.max_prompt_length", "a longer prompt is dropped and counted, never cut"),
    "data.max_response_length": ("rollout.max_response_length", "the generation limit L_max, in tokens"),
    "data.truncation": (None, "prompts over data.max_prompt_length are dropped (counted), never truncated"),
    "data.filter_overlong_prompts": (None, "always on: prompts over data.max_prompt_length are dropped (counted)"),
    "data.prompt_key": (None, "the prompt is read from the DAPO data schema (verl's prompt column)"),
    "data.shuffle": ("data.shuffle", "seeded and resumable"),
    "data.seed": ("seed", _SEED),
    # algorithm
    "algorithm.adv_estimator": ("algorithm.adv_estimator", "grpo (DAPO's) or grpo_mean_only; no gae (no critic)"),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std_in_grpo", "false: r - mean only (Dr. GRPO)"),
    "algorithm.gamma": (None, _NO_GAE),
    "algorithm.lam": (None, _NO_GAE),
    "algorithm.use_kl_in_reward": (None, _KL),
    "algorithm.kl_penalty": (None, _KL),
    "algorithm.kl_ctrl.*": (None, _KL),
    "algorithm.filter_groups.enable": ("algorithm.filter_groups.enable", "dynamic sampling"),
    "algorithm.filter_groups.metric": (
        None, "groups are always filtered on correctness (verl's acc), before the overlong penalty"),
    "algorithm.filter_groups.max_num_gen_batches": (
        "algorithm.filter_groups.max_num_gen_batches", "0 = unbounded in both; a step still short then stops verl "
        "with an error, and is filled here unless algorithm.filter_groups.on_exhausted=error"),
    "algorithm.rollout_correction.rollout_is": ("algorithm.rollout_correction.rollout_is", _CORRECTION),
    "algorithm.rollout_correction.rollout_is_threshold": (
        "algorithm.rollout_correction.rollout_is_threshold", _CORRECTION),
    "algorithm.rollout_correction.rollout_rs": ("algorithm.rollout_correction.rollout_rs", _CORRECTION),
    "algorithm.rollout_correction.rollout_rs_threshold": (
        "algorithm.rollout_correction.rollout_rs_threshold", _CORRECTION),
    "algorithm.rollout_correction.bypass_mode": ("train.old_log_probs", "true is train.old_log_probs=rollout"),
    # the model and the actor
    "actor_rollout_ref.model.path": ("model.hf_path", "an HF model directory"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.recompute", "true: full (or selective); false: "
                                                              "none"),
    "actor_rollout_ref.model.use_remove_padding": (
        None, "not translated: micro-batches are filled first-fit decreasing by length under the token budget (0.5% "
              "padding modelled at the 32B recipe's lengths, docs/packing.md); train.pack_sequences (auto: packed "
              "where every micro-batch must have one shape) removes the rest on the local spec (not yet the TE "
              "spec)"),
    "actor_rollout_ref.model.override_config.*": (
        None, "the model is built from model.hf_path's config.json; hidden dropout is always 0"),
    "actor_rollout_ref.hybrid_engine": ("rollout.placement", "true (trainer and engine share the GPUs) is colocated"),
    "actor_rollout_ref.actor.strategy": (None, "always Megatron-Core (verl's megatron); no FSDP"),
    "actor_rollout_ref.actor.clip_ratio": (None, "the symmetric clip: set loss.clip_ratio_low and "
                                           "loss.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_low": ("loss.clip_ratio_low", "auto is DAPO's 0.2"),
    "actor_rollout_ref.actor.clip_ratio_high": ("loss.clip_ratio_high", "auto is DAPO's 0.28"),
    "actor_rollout_ref.actor.clip_ratio_c": (
        "loss.clip_ratio_c", "verl's default is 3.0; auto is the recipe's 10.0 for dapo; null = off"),
    "actor_rollout_ref.actor.loss_agg_mode": ("loss.loss_agg_mode", "auto is the policy loss's (dapo: token-mean)"),
    "actor_rollout_ref.actor.loss_scale_factor": ("loss.loss_scale_factor", "seq-mean-token-sum-norm's divisor"),
    "actor_rollout_ref.actor.use_token_level_loss": (
        "loss.loss_agg_mode", "an early recipe's switch: true is token-mean, false seq-mean-token-mean"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": (
        "loss.policy_loss", "verl's vanilla is ours dapo; gspo and cispo keep their names"),
    "actor_rollout_ref.actor.entropy_coeff": (
        None, "DAPO has no entropy bonus (the recipe sets 0); actor/entropy is logged"),
    "actor_rollout_ref.actor.use_kl_loss": (None, _KL),
    "actor_rollout_ref.actor.kl_loss_coef": (None, _KL),
    "actor_rollout_ref.actor.kl_loss_type": (None, _KL),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        "train.mini_batch_prompts", "both count prompts per optimizer update, each with rollout.n responses"),
    "actor_rollout_ref.actor.ppo_epochs": ("train.ppo_epochs", "passes over each step's batch"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
        "train.micro_batch_size", "sequences per micro-batch on each data-parallel rank; read only with "
        "train.max_tokens_per_micro_batch=0"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": (
        None, "a count over all GPUs; ours is per data-parallel rank: train.micro_batch_size"),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("train.max_tokens_per_micro_batch", _SWITCH),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("train.max_tokens_per_micro_batch", _BUDGET),
    "actor_rollout_ref.actor.grad_clip": ("optim.clip_grad", "global gradient-norm clip; 0 = off"),
    "actor_rollout_ref.actor.optim.lr": ("optim.lr", "AdamW"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": (
        "optim.lr_warmup_steps", "both count training steps; verl's -1 defers to the ratio"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": (
        None, "give optim.lr_warmup_steps (the ratio x train.total_steps)"),
    "actor_rollout_ref.actor.optim.weight_decay": ("optim.weight_decay", "verl's default is 0.01, ours the recipe's "
                                                   "0.1"),
    "actor_rollout_ref.actor.optim.clip_grad": ("optim.clip_grad", "global gradient-norm clip; 0 = off"),
    "actor_rollout_ref.actor.optim.betas": (None, "two keys: optim.adam_beta1 and optim.adam_beta2"),
    "actor_rollout_ref.actor.optim.lr_decay_style": (None, "the rate is constant after warmup, as in the recipe"),
    "actor_rollout_ref.actor.optim.warmup_style": (None, "linear warmup, then constant, as in the recipe"),
    "actor_rollout_ref.actor.optim.min_lr": (None, "no decay, so no floor"),
    "actor_rollout_ref.actor.checkpoint.async_save": ("checkpoint.async_save", "written from a child process"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
        "parallel.context_parallel_size", "both split a long sequence across ranks (Megatron's CP, not Ulysses); "
        "what FSDP shards, parallel.tensor_model_parallel_size and pipeline_model_parallel_size shard here"),
    "actor_rollout_ref.actor.fsdp_config.*": (
        None, "no FSDP: parallel.* (TP, PP, CP) and the distributed optimizer shard the model"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ("actor.offload_weights", _OFFLOAD_WEIGHTS),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("actor.offload_during_rollout", _OFFLOAD_OPTIMIZER),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": ("parallel.tensor_model_parallel_size", "TP"),
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": ("parallel.pipeline_model_parallel_size", "PP"),
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": (
        "parallel.virtual_pipeline_model_parallel_size", "interleaved PP"),
    "actor_rollout_ref.actor.megatron.context_parallel_size": ("parallel.context_parallel_size", "CP"),
    "actor_rollout_ref.actor.megatron.sequence_parallel": (
        "parallel.sequence_parallel", "verl's default is true, ours false (it needs TP > 1)"),
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": (
        "parallel.use_distributed_optimizer", "shards the optimizer state across data-parallel ranks"),
    "actor_rollout_ref.actor.megatron.param_offload": ("actor.offload_weights", _OFFLOAD_WEIGHTS),
    "actor_rollout_ref.actor.megatron.optimizer_offload": ("actor.offload_during_rollout", _OFFLOAD_OPTIMIZER),
    "actor_rollout_ref.actor.megatron.grad_offload": ("actor.offload_during_rollout", _OFFLOAD_OPTIMIZER),
    "actor_rollout_ref.actor.megatron.seed": ("seed", _SEED),
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity": (
        "model.recompute", _RECOMPUTE),
    "actor_rollout_ref.ref.*": (None, "no reference model: DAPO has no KL term"),
    # generation and evaluation
    "actor_rollout_ref.rollout.name": ("rollout.engine", "vllm, or hf (transformers, CPU); no sglang"),
    "actor_rollout_ref.rollout.n": ("rollout.n", "responses per prompt, the group size"),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", "the trainer's log-probs use it too"),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", "nucleus sampling"),
    "actor_rollout_ref.rollout.top_k": (
        "rollout.top_k", "-1 = off for every engine (verl's HF rollout wants 0, which is refused here)"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("rollout.tensor_parallel_size", "ranks per vLLM "
                                                             "replica"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (
        "rollout.gpu_memory_utilization", "a fraction of the GPU's total memory, as vLLM's; megatron-dapo plan "
        "checks it"),
    "actor_rollout_ref.rollout.enforce_eager": ("rollout.enforce_eager", "verl's default is false, ours the "
                                                "recipe's true"),
    "actor_rollout_ref.rollout.free_cache_engine": (
        None, "colocated engines always sleep while the trainer works; rollout.sleep_level says what they keep"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": (None, "left at vLLM's default"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": (None, "left at vLLM's default"),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": ("train.max_tokens_per_micro_batch", _SWITCH),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": ("train.max_tokens_per_micro_batch", _BUDGET),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (
        "train.micro_batch_size", "the pi_old pass uses the updates' micro-batches"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": ("eval.temperature", "DAPO's evaluation: 1.0"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": ("eval.top_p", "DAPO's evaluation: 0.7"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": (None, "evaluation draws without top-k"),
    "actor_rollout_ref.rollout.val_kwargs.n": (
        "eval.n", "verl's 1 over the AIME file's 32 copies is ours 32: the loader merges copies, eval.n draws"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": (
        None, "no switch: evaluation draws at eval.temperature and eval.top_p"),
    # reward
    "reward_model.reward_manager": (
        None, "the DAPO reward (score plus overlong shaping) is the only one; reward.fn picks the scorer"),
    "reward_model.overlong_buffer.enable": ("reward.overlong_buffer.enable", "soft overlong punishment"),
    "reward_model.overlong_buffer.len": ("reward.overlong_buffer.len", "L_cache, in tokens"),
    "reward_model.overlong_buffer.penalty_factor": ("reward.overlong_buffer.penalty_factor", "the penalty at L_max"),
    "reward_model.overlong_buffer.log": (None, _LOGGED),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": ("reward.overlong_buffer.enable", _OVERLONG),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": ("reward.overlong_buffer.len", _OVERLONG),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": (
        "reward.overlong_buffer.penalty_factor", _OVERLONG),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": (None, _LOGGED),
    "reward_model.reward_kwargs.max_resp_len": (
        "rollout.max_response_length", "the penalty's L_max is the generation limit"),
    "custom_reward_function.path": (
        None, "scorers are registered by name in megatron_dapo/reward/, and reward.fn picks one"),
    "custom_reward_function.name": (
        "reward.fn", "a registered scorer's name (dapo_math, math_dapo_paper), not a function in a file"),
    "critic.*": (None, "no critic: the advantages are group-relative"),
    # the run
    "trainer.total_training_steps": (
        "train.total_steps", "both count training steps; unset, verl derives it from total_epochs"),
    "trainer.total_epochs": (None, "a run is train.total_steps steps long; the prompt sampler crosses epochs"),
    "trainer.save_freq": ("checkpoint.save_every", "in steps; verl's -1 never saves, ours 0 saves at the end only"),
    "trainer.test_freq": ("eval.every", "in steps; verl's -1 (never) is ours 0"),
    "trainer.val_before_train": ("eval.before_train", "evaluate once before the first step"),
    "trainer.val_only": (None, "run megatron-dapo eval"),
    "trainer.n_gpus_per_node": (
        None, "the launcher's: torchrun --nproc-per-node or the SLURM allocation; the world is the processes "
        "started"),
    "trainer.nnodes": (None, "the launcher's: torchrun --nnodes or the SLURM allocation"),
    "trainer.default_local_dir": ("checkpoint.dir", "empty: the checkpoints directory under logging.dir"),
    "trainer.resume_mode": ("checkpoint.resume", "auto is auto, disable is never; for a path, set checkpoint.dir"),
    "trainer.resume_from_path": (
        None, "point checkpoint.dir at the checkpoints; checkpoint.resume=auto takes the newest"),
    "trainer.max_actor_ckpt_to_keep": ("checkpoint.keep_last", "verl's null (keep all) has no equivalent"),
    "trainer.project_name": ("logging.wandb_project", "W&B project"),
    "trainer.experiment_name": (None, "a run is named by its directory, logging.dir"),
    "trainer.logger": (None, "the console is always on; logging.tensorboard and logging.wandb switch the others"),
    "trainer.balance_batch": (None, "always: samples are balanced across data-parallel ranks"),
    "trainer.log_val_generations": (None, "logging.samples_every dumps responses, an evaluation's too"),
    "trainer.device": (None, "CUDA when present, else the CPU"),
}

# verl's top-level sections, so that a verl key the table lacks is still named as verl's.
VERL_SECTIONS = frozenset(key.split(".")[0] for key in VERL_KEYS)


def lookup(key: str) -> tuple[str, str | None, str] | None:
    """(the table's entry that covers ``key``, our key or None, note): the exact entry, else the longest
    ``.*`` entry above it; None when the table has neither."""
    if key in VERL_KEYS:
        return (key, *VERL_KEYS[key])
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        covering = ".".join(parts[:n]) + ".*"
        if covering in VERL_KEYS:
            return (covering, *VERL_KEYS[covering])
    return None


def verl_hint(key: str, our_sections: frozenset[str]) -> str | None:
    """The one-line error for ``key``, unknown to our schema, when it is verl's (else None)."""
    entry = lookup(key)
    if entry is not None:
        _, ours, note = entry
        if ours is None:
            return f"{key} is verl's key, with no equivalent here: {note} ({DOC})"
        return f"{key} is verl's key; ours is {ours}{': ' + note if note else ''} ({DOC})"
    top = key.split(".")[0]
    if top in VERL_SECTIONS and top not in our_sections:
        close = difflib.get_close_matches(top, sorted(our_sections), n=1)  # trainer.x may be a typo of train.x
        return (f"unknown config key {key}: {top} is verl's section, not ours, and {DOC} has no entry for it"
                f"{'; did you mean ' + close[0] + '?' if close else ''} (our keys: megatron-dapo config --defaults)")
    return None
