"""Settings rules that involve more than one section of the config (config.py keeps each
section's own rules beside its fields); each message names the values and the fix."""

from pathlib import Path
from typing import Any

from megatron_dapo.errors import ConfigError


def _fail(msg: str) -> None:
    raise ConfigError(msg)


def validate_cross_section(cfg: Any) -> None:
    """Rules that involve more than one section of ``cfg`` (a config.DAPOConfig, which calls this
    from its __post_init__: no import back); each message names the values and the fix."""
    from megatron_dapo.algo import ADVANTAGE_ESTIMATORS, AGG_MODES, POLICY_LOSSES
    from megatron_dapo.reward import REWARD_FNS
    from megatron_dapo.rollout.engine import ENGINES

    d, t, r = cfg.data, cfg.train, cfg.rollout
    if d.prompts_per_step % t.mini_batch_prompts:
        _fail(f"data.prompts_per_step={d.prompts_per_step} is not divisible by train.mini_batch_prompts="
              f"{t.mini_batch_prompts}; pick a divisor (e.g. "
              f"{_divisor_near(d.prompts_per_step, t.mini_batch_prompts)})")
    ob = cfg.reward.overlong_buffer
    if ob.enable and not 0 < ob.len <= r.max_response_length:
        _fail(f"reward.overlong_buffer.len={ob.len} must be in (0, rollout.max_response_length="
              f"{r.max_response_length}]; shorten the buffer or disable it (reward.overlong_buffer.enable=false)")
    if ob.enable and ob.penalty_factor < 0:
        _fail(f"reward.overlong_buffer.penalty_factor must be >= 0, got {ob.penalty_factor}")
    if (cfg.eval.max_response_length or 0) > r.max_response_length:
        # One engine serves both, sized for prompt + rollout.max_response_length tokens: longer
        # evaluation responses would be cut there silently.
        _fail(f"eval.max_response_length={cfg.eval.max_response_length} exceeds rollout.max_response_length="
              f"{r.max_response_length}, which sizes the engine (data.max_prompt_length + rollout.max_response_length "
              "tokens); lower eval.max_response_length or raise rollout.max_response_length")
    if cfg.toy.enable:
        # The demo points these at what it makes in the run directory (toy/bootstrap.py): any other
        # value would be replaced without a word, and the run would train the toy, not that model or data.
        run = Path(cfg.logging.dir)
        for name, value, allowed in (
                ("model.hf_path", cfg.model.hf_path, ("", str(run / "toy_base"))),
                ("data.train_files", d.train_files, ((), (str(run / "toy_data" / "train.parquet"),))),
                ("data.val_files", d.val_files, (type(d)().val_files, (str(run / "toy_data" / "val.parquet"),)))):
            if value not in allowed:
                shown = f"[{', '.join(value)}]" if isinstance(value, tuple) else value
                _fail(f"{name}={shown} is ignored with toy.enable=true (the demo trains on the task and base it "
                      f"makes in logging.dir={run}); set toy.enable=false to use it, or leave {name} unset")
        # RoPE runs past it without a word in the trainer and the HF engine; vLLM refuses it only
        # once the trainer is built.
        if cfg.toy.max_position_embeddings < d.max_prompt_length + r.max_response_length:
            _fail(f"toy.max_position_embeddings={cfg.toy.max_position_embeddings} is shorter than the sequences "
                  f"of the run: data.max_prompt_length + rollout.max_response_length = "
                  f"{d.max_prompt_length + r.max_response_length}; raise it to at least that, or shorten them")
    if t.old_log_probs == "rollout" and cfg.algorithm.rollout_correction.active:
        # verl's bypass mode: pi_old is the rollout's, so pi_old / pi_rollout is 1 and the correction does nothing.
        _fail("algorithm.rollout_correction corrects pi_old against the engine's log-probs, which "
              "train.old_log_probs=rollout makes pi_old itself (verl's bypass mode); set "
              "algorithm.rollout_correction.rollout_is=null and rollout_rs=null, or train.old_log_probs=trainer")
    if r.max_staleness and t.old_log_probs == "rollout":
        # Stale rollouts come from older weights: pi_old must be the trainer's weights of this step,
        # with TIS correcting the drift (docs/DESIGN.md "Separate placement and asynchronous rollouts").
        _fail(f"rollout.max_staleness={r.max_staleness} with train.old_log_probs=rollout: a stale rollout's "
              "log-probs are an older policy's, not this step's pi_old; set train.old_log_probs=trainer")
    if r.partial_tokens < 0 or (r.partial_tokens and not r.partial):
        _fail(f"rollout.partial_tokens={r.partial_tokens} with rollout.partial={r.partial}: set rollout.partial=true "
              "to cut responses into pieces of that many tokens (> 0), or rollout.partial_tokens=0")
    if r.partial and (r.piece_tokens < 1 or r.max_response_length % r.piece_tokens):
        # every piece but the last is then exactly that long, and a response's pieces end at its limit
        _fail(f"rollout.partial_tokens={r.partial_tokens or 'max_response_length / 4'} does not divide "
              f"rollout.max_response_length={r.max_response_length}; choose a divisor")
    if r.partial_unfinished != "carry" and not r.partial:
        _fail(f"rollout.partial_unfinished={r.partial_unfinished} needs rollout.partial=true (without it no group is "
              "still growing when a step is full); set rollout.partial=true or drop the setting")
    if r.partial and t.old_log_probs == "rollout":
        _fail("rollout.partial=true with train.old_log_probs=rollout: a continued response's first pieces come from "
              "older weights, not this step's pi_old; set train.old_log_probs=trainer")
    seq_len = d.max_prompt_length + r.max_response_length
    if 0 < t.max_tokens_per_micro_batch < seq_len:
        _fail(f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} cannot hold one sequence of "
              f"data.max_prompt_length + rollout.max_response_length = {seq_len} tokens; raise it to >= {seq_len}")
    _check_router_replay(cfg)
    if cfg.loss.policy_loss not in POLICY_LOSSES:
        _fail(f"loss.policy_loss={cfg.loss.policy_loss!r} is not one of {POLICY_LOSSES.names()}")
    loss = cfg.loss_settings()  # the policy loss's paper values for "auto"; refuses what it does not define
    for name, registry, value in (("loss.loss_agg_mode", AGG_MODES, loss.loss_agg_mode),
                                  ("loss.policy_loss", POLICY_LOSSES, cfg.loss.policy_loss),
                                  ("algorithm.adv_estimator", ADVANTAGE_ESTIMATORS, cfg.algorithm.adv_estimator),
                                  ("rollout.engine", ENGINES, cfg.rollout.engine),
                                  ("reward.fn", REWARD_FNS, cfg.reward.fn),
                                  ("eval.reward_fn", REWARD_FNS, cfg.eval.reward_fn),
                                  *((("alarms.audit_fn", REWARD_FNS, cfg.alarms.audit_fn),)
                                    if cfg.alarms.audit_fn not in ("auto", "none") else ())):
        if value not in registry:
            _fail(f"{name}={value!r} is not one of {registry.names()}")


def _check_router_replay(cfg: Any) -> None:
    """R3 needs routes from the engine, and a replay megatron-core 0.19.2 can run."""
    from megatron_dapo.rollout.engine import ENGINES, get_engine_cls

    if cfg.moe.router_replay != "R3" or cfg.rollout.engine not in ENGINES:
        return
    if not getattr(get_engine_cls(cfg.rollout.engine), "returns_routed_experts", False):
        _fail(f"moe.router_replay=R3 needs an engine that returns the experts it routed each token to; "
              f"rollout.engine={cfg.rollout.engine} does not; set rollout.engine=hf or vllm, or "
              "moe.router_replay=disabled")
    if cfg.model.recompute != "none":
        # a recomputed router would replay from megatron's backward list, which the interleaved 1F1B
        # order of forwards and backwards does not keep in step with the micro-batches
        _fail(f"moe.router_replay=R3 with model.recompute={cfg.model.recompute} is not supported; "
              "set model.recompute=none")


def _divisor_near(n: int, k: int) -> int:
    return min((m for m in range(1, n + 1) if n % m == 0), key=lambda m: (abs(m - k), m))
