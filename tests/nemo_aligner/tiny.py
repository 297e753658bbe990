"""A tiny Qwen2-shaped DAPO actor built the way a NeMo-Aligner script builds one, on CPU and gloo.

Runs inside ``.venv-nemo`` under torchrun (one or two processes). The config has the keys of NeMo's
megatron_gpt_config.yaml and NeMo-Aligner's gpt_ppo_actor.yaml that this model needs; the block
is Qwen2's (RMSNorm, SwiGLU, rope, bias on q/k/v only, untied output layer); the tokenizer is the
project's toy tokenizer (a Qwen2-pipeline byte-level BPE), saved to disk and read through NeMo's
HF tokenizer wrapper.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tests.nemo_aligner import standins
from tests.nemo_aligner.shape import EOS, GROUP, SHAPE


def model_config(tokenizer_dir: str, *, mbs: int, gbs: int, lr: float = 1e-3, **ppo) -> dict:
    """model: section (NeMo GPT keys + ppo:) for the tiny actor."""
    return {
        "mcore_gpt": True, "micro_batch_size": mbs, "global_batch_size": gbs,
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None, "sequence_parallel": False,
        "encoder_seq_length": SHAPE["seq_length"], "max_position_embeddings": SHAPE["seq_length"],
        "num_layers": SHAPE["num_layers"], "hidden_size": SHAPE["hidden_size"],
        "ffn_hidden_size": SHAPE["ffn_hidden_size"], "num_attention_heads": SHAPE["num_attention_heads"],
        "num_query_groups": SHAPE["num_query_groups"], "kv_channels": None,
        "init_method_std": 0.02, "use_scaled_init_method": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "ffn_dropout": 0.0,
        "apply_query_key_layer_scaling": False, "normalization": "rmsnorm", "layernorm_epsilon": 1e-6,
        "do_layer_norm_weight_decay": False, "make_vocab_size_divisible_by": 1,
        "pre_process": True, "post_process": True, "persist_layer_norm": False,
        "bias": False, "qkv_bias": True, "activation": "fast-swiglu", "headscale": False,
        "transformer_block_type": "pre_ln", "openai_gelu": False, "normalize_attention_scores": True,
        "position_embedding_type": "rope", "rotary_percentage": 1.0, "rotary_base": 10000.0,
        "share_embeddings_and_output_weights": False, "bias_activation_fusion": False,
        "bias_dropout_add_fusion": False, "masked_softmax_fusion": False, "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False, "cross_entropy_loss_fusion": False,
        "tokenizer": {"library": "huggingface", "type": tokenizer_dir, "use_fast": True},
        "native_amp_init_scale": 4294967296, "native_amp_growth_interval": 1000,
        "fp32_residual_connection": False, "fp16_lm_cross_entropy": False, "megatron_amp_O2": False,
        "seed": 1234, "use_cpu_initialization": True, "transformer_engine": False, "fp8": False,
        "precision": 32, "gradient_as_bucket_view": False, "activations_checkpoint_granularity": None,
        "activations_checkpoint_method": None, "activations_checkpoint_num_layers": None,
        "activations_checkpoint_layers_per_pipeline": None, "sync_batch_comm": False,
        "optim": {"name": "adamw", "lr": lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8,
                  "sched": {"name": "CosineAnnealing", "warmup_steps": 0, "constant_steps": 0,
                            "min_lr": lr, "max_steps": 1000}},
        "data": {"data_impl": "mock", "splits_string": None, "seq_length": SHAPE["seq_length"],
                 "skip_warmup": True, "num_workers": 0, "dataloader_type": "single",
                 "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
                 "index_mapping_dir": None, "data_prefix": None},
        "ppo": {"entropy_bonus": 0.0, "ratio_eps": 0.2, "forward_micro_batch_size": mbs,
                "offload_adam_states": False, "rollout_micro_batch_size": mbs,
                "length_params": {"max_length": 16, "min_length": 1},
                "sampling_params": {"use_greedy": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                    "repetition_penalty": 1.0, "add_BOS": False, "all_probs": False,
                                    "compute_logprob": False, "end_strings": ["<|endoftext|>"]},
                "trt_llm": {"enable": False},
                "loss": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
                **ppo},
    }


def trainer_config(devices: int) -> dict:
    return {"num_nodes": 1, "devices": devices, "accelerator": "cpu", "precision": 32,
            "logger": False, "enable_checkpointing": False, "use_distributed_sampler": False,
            "max_epochs": 1, "max_steps": -1, "gradient_clip_val": 1.0, "log_every_n_steps": 1,
            "enable_progress_bar": False, "enable_model_summary": False}


def build(model: dict, *, actor_cls=None, extra_trainer: dict | None = None, exp_manager: dict | None = None):
    """-> (ptl_trainer, actor, cfg): the trainer from NeMo-Aligner's resolve_and_create_trainer (and
    NeMo's exp_manager when ``exp_manager`` is given), the process group from its init_distributed,
    the actor class (default: DAPOActor) on that trainer."""
    from nemo_aligner.utils.train_script_utils import init_distributed, resolve_and_create_trainer

    from megatron_dapo.integrations.nemo_aligner_classes import dapo_actor_class

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = trainer_config(world) | {"dapo": extra_trainer or {}}
    cfg = OmegaConf.create({"trainer": trainer, "model": model, "exp_manager": exp_manager})
    ptl_trainer = resolve_and_create_trainer(cfg, "dapo")
    if exp_manager is not None:  # NeMo's own checkpoint callback and resume (train script order)
        from nemo.utils.exp_manager import exp_manager as nemo_exp_manager

        nemo_exp_manager(ptl_trainer, cfg.exp_manager)
    actor = (actor_cls or dapo_actor_class())(cfg.model, ptl_trainer)
    init_distributed(ptl_trainer, actor, use_te=False)
    return ptl_trainer, actor, cfg


def save_tokenizer(directory: Path) -> str:
    from megatron_dapo.toy.tokenizer import save_toy_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    save_toy_tokenizer(directory)
    return str(directory)


def setup() -> None:
    """Stand-ins (drop some with DAPO_NEMO_DROP=a,b), one thread, a fixed seed."""
    drop = tuple(x for x in os.environ.get("DAPO_NEMO_DROP", "").split(",") if x)
    standins.install(drop=drop)
    torch.set_num_threads(1)


def dapo_section(prompts: int, **over) -> dict:
    """trainer.dapo: ReinforceTrainer's keys and the adapter's, for ``prompts`` mixed groups a step."""
    return {"initial_policy_kl_penalty": 0, "num_rollouts_per_prompt": GROUP, "prompts_per_step": prompts,
            "algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": 4}},
            "reward": {"overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0}}} | over


def rollout_batch(rows: int, *, seed: int, vocab: int = 130, eos: int = EOS) -> dict:
    """A NeMo-Aligner rollout batch of rows // GROUP prompt groups: prompts of different lengths,
    responses of different lengths (so a token's weight in a per-micro-batch mean differs from
    the token-mean's), eos padding, +1/-1 rewards mixed in every group."""
    g = torch.Generator().manual_seed(seed)
    width = SHAPE["seq_length"] // 2
    tokens = torch.full((rows, width), eos, dtype=torch.long)
    prompt_len = torch.empty(rows, dtype=torch.long)
    resp_len = torch.empty(rows, dtype=torch.long)
    for p in range(rows // GROUP):
        n = 3 + 2 * p
        prompt = torch.randint(0, vocab, (n,), generator=g)
        for r in range(GROUP):
            i = p * GROUP + r
            m = int(torch.randint(2, width - n, (1,), generator=g))
            tokens[i, :n] = prompt
            tokens[i, n:n + m] = torch.randint(0, vocab, (m,), generator=g)
            prompt_len[i], resp_len[i] = n, n + m
    rewards = torch.tensor([1.0 if (i % GROUP) in (0, 2 + (i // GROUP) % 2) else -1.0 for i in range(rows)])
    return {"response_tokens": tokens, "prompt_lengths": prompt_len, "response_lengths": resp_len,
            "is_end": resp_len < width, "rewards": rewards}


def loss_and_gradients(actor, optimizer, batch: dict) -> tuple[float, dict, int]:
    """ReinforceTrainer.run_training's step up to clipping: prepare_for_training(_step), zero_grad,
    the actor's get_loss_and_metrics through megatron's schedule, finish_training_step (NeMo's DP
    gradient all-reduce). -> (loss, metrics, micro-batches the schedule ran, counted as they ran);
    the gradients are then in the parameters' .grad."""
    count, make = [0], actor.get_actor_forward_output_and_loss_func

    def counting():
        forward = make()

        def step(data_iterator, model):
            count[0] += 1
            return forward(data_iterator, model)

        return step

    actor.get_actor_forward_output_and_loss_func = counting
    actor.prepare_for_training()
    optimizer.zero_grad()
    actor.prepare_for_training_step()
    loss, metrics = actor.get_loss_and_metrics(batch=batch, forward_only=False)
    actor.finish_training_step()
    del actor.get_actor_forward_output_and_loss_func  # the class's own again
    return loss, metrics, count[0]
