"""The config keys tests/functional/test_config_effects.py classifies without a one-step case: refused
values, GPU-only keys and keys with no effect on this CPU machine, each with its reason."""

REFUSED: dict[str, tuple[str, dict]] = {  # key -> (value, context)
    "model.hf_path": ("/elsewhere/model", {}),
    "model.transformer_impl": ("transformer_engine", {}),
    "model.fp8": ("e4m3", {}),
    "parallel.virtual_pipeline_model_parallel_size": ("2", {}),
    "parallel.sequence_parallel": ("true", {}),
    "data.train_files": ("[/elsewhere/train.parquet]", {}),
    "data.val_files": ("[/elsewhere/val.parquet]", {}),
    "toy.enable": ("false", {}),  # then model.hf_path is empty: "... or set toy.enable=true"
    "toy.max_position_embeddings": ("32", {}),  # shorter than prompt + response; longer values only reach config.json
    # Without the engines' ranks; with them (torchrun, 4 processes) tests/functional/test_separate_placement.py
    # shows the run equal to the colocated one, which is the point of staleness 0.
    "rollout.placement": ("separate", {}),
    "rollout.num_ranks": ("1", {}),  # engines' ranks in a colocated run
    # Stale rollouts need engines of their own; with them tests/functional/test_async_rollouts.py.
    "rollout.max_staleness": ("1", {}),
}

GPU_ONLY: dict[str, str] = {
    "model.fp8_recipe": "only read with model.fp8 set, which needs Transformer Engine on CUDA (refused on CPU); "
                        "tests/gpu/test_policy_gpu.py::test_fp8_switch_builds_and_runs",
    "rollout.gpu_memory_utilization": "vLLM on CUDA only: on CPU vLLM needs rollout.kv_cache_memory_mb, which "
                                      "overrides it; tests/gpu/test_vllm_engine.py (its free-memory check), "
                                      "tests/unit/test_plan.py",
    "rollout.sleep_level": "vLLM's sleep mode exists on CUDA only (its CPU build has none): "
                           "tests/gpu/test_vllm_engine.py (level 2 then a full sync), "
                           "tests/unit/test_rollout_vllm_engine.py (the level reaches LLM.sleep)",
    "rollout.enforce_eager": "CUDA graphs in vLLM on CUDA; vLLM's CPU build turns false into an inductor compile of "
                             "minutes; no GPU test sets it yet (the GPU runs keep the default true)",
}

NO_EFFECT_ON_CPU: dict[str, str] = {
    "moe.token_dispatcher": "the demo's cases run in one process (EP 1), where either dispatcher keeps every token on "
                            "its rank; at EP 2 tests/distributed/test_moe_alltoall.py (alltoall = EP 1) and "
                            "test_moe_packed_ep.py (allgather)",
    "algorithm.rollout_correction.rollout_is_threshold": "the demo's HF engine and trainer agree in fp32 (ratios "
                                                         "within ~1e-6 of 1): no cap or IcePop range binds; "
                                                         "tests/unit/test_rollout_correction.py (vs verl 0.9.1)",
    "algorithm.rollout_correction.rollout_rs_threshold": "as rollout_is_threshold: no divergence bound binds on the "
                                                         "demo; tests/unit/test_rollout_correction.py (vs verl 0.9.1)",
    "model.recompute": "recomputes activations in the backward: memory and time only, the numbers are bitwise "
                       "equal; used by the recipes and conf/cpu_rehearsal_32b.yaml, so not refused; "
                       "tests/gpu/test_policy_gpu.py::test_te_recompute_builds_and_runs",
    "rollout.weight_sync_bucket_mb": "the toy's weights fit one bucket even at the minimum (1 MiB): only peak memory "
                                     "of a sync would change; tests/unit/test_rollout_weight_sync.py counts buckets",
    "train.logprob_chunk_tokens": "how many tokens the output layer's log-prob pass takes at a time: memory and "
                                  "speed, not the values (tests/unit/test_policy_logprobs.py: every chunk size "
                                  "equals log_softmax; tests/unit/test_config.py: the setting reaches the step)",
    "reward.num_workers": "toy responses score in microseconds, so workers vs inline scoring leaves no trace in a "
                          "run (the pool's own timeouts and restarts: tests/unit/test_reward.py)",
    "reward.timeout_s": "as reward.num_workers: nothing on the toy comes near a time limit (tests/unit/test_reward.py)",
    "logging.wandb_project": "where W&B uploads a run; here W&B runs offline (no network), so the project stays in the "
                             "run's own files (tests/unit/test_observe.py writes an offline run)",
    "logging.samples_max_chars": "the toy's prompts and responses are shorter than the smallest cap (200 characters); "
                                 "the cut: tests/unit/test_observe.py::test_clip_keeps_the_head_and_the_answer_line",
    "alarms.shortcut_fallbacks": "no setting makes the gradient shortcut fall back (it holds for every loss the code "
                                 "builds); counting: tests/unit/test_grad_shortcut_count.py, thresholds: "
                                 "test_observe.py",
    "parallel.timeout_minutes": "how long a collective may wait for a late rank: no collective of a healthy one-step "
                                "run waits long; tests/functional/test_async_rollouts.py runs separate placement at "
                                "0.1 (6 s) through a 15-s batch and writes the default run's records",
    "rollout.wait_timeout_minutes": "read by separate placement only (how long a rank waits for the other side); "
                                    "tests/unit/test_separate_waits.py (trainer rank 0 gives up naming it), "
                                    "test_rollout_channel.py (a receiver does), test_plan.py (checked against the "
                                    "plan)",
}
