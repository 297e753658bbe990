"""Settings a run derives: every "auto", 0 or null that stands for another value, and the values a
combination of settings implies, resolved in this one place at launch (run.prepare_run), each said
in one log line on rank 0.

Two kinds:
* decided by the config itself (the policy loss's paper values, the rollout's limit for evaluation,
  partial rollouts' piece and surplus, the adaptive batch cap, the async correction, the audit
  scorer): the resolved config holds the value, so the run's config.yaml records what ran;
* decided by the machine (model.dtype and model.transformer_impl: bf16 and Transformer Engine on a
  GPU, fp32 and the local spec on a CPU; train.old_log_probs where the dtype decides it;
  train.pack_sequences, by the spec and the model's layout, ``derive_for_model``): the config
  keeps "auto", so that one config.yaml runs on either (an export on a CPU node of a GPU run), and
  config.yaml records what this launch chose as comments (``comments``); the code that uses one
  resolves it with the same function (``resolve_dtype``, ``pi_old_source``).

Sentinels that are values, not defaults, stay: null dual clip (off), 0 = never / unbounded / off,
and train.logprob_chunk_tokens=0 (sized against memory when the pass runs, mcore/logprobs.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_dapo.config import DAPOConfig
from megatron_dapo.config_algo import AUTO
from megatron_dapo.precision import resolve_dtype, resolve_transformer_impl

ASYNC_TIS_CAP = 2.0  # verl's tis_imp_ratio_cap (decoupled_token_is): the correction stale rollouts get


@dataclass(frozen=True)
class Derived:
    """One derived setting: ``key`` (dotted) went from ``given`` to ``value``, ``why``; ``kept``: the
    config keeps ``given`` (decided by the machine, recorded as a comment)."""

    key: str
    given: Any
    value: Any
    why: str
    kept: bool = False

    def line(self) -> str:
        return f"{self.key}: {_show(self.given)} -> {_show(self.value)} ({self.why})"


def derive(cfg: DAPOConfig, *, on_gpu: bool) -> tuple[DAPOConfig, list[Derived]]:
    """``cfg`` with every config-decided derived setting resolved, and every derived setting (both
    kinds, module doc) in the order resolved. Resolving a resolved config changes nothing."""
    out: list[Derived] = []
    loss = cfg.loss_settings()  # the paper's values for "auto", Dr. GRPO's constant (config_algo.LossConfig)
    for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "loss_scale_factor"):
        given, value = getattr(cfg.loss, key), getattr(loss, key)
        if given != value:
            why = (f"loss.policy_loss={loss.policy_loss}'s default, config_algo.POLICY_LOSS_DEFAULTS" if given == AUTO
                   else "seq-mean-token-sum-norm's constant: rollout.max_response_length, the generation budget")
            out.append(Derived(f"loss.{key}", given, value, why))
    r, fg = cfg.rollout, cfg.algorithm.filter_groups
    ev = dataclasses.replace(cfg.eval, max_response_length=cfg.eval_max_response_length)
    if ev != cfg.eval:
        out.append(Derived("eval.max_response_length", None, ev.max_response_length, "the rollout's limit"))
    if r.partial and not r.partial_tokens:
        out.append(Derived("rollout.partial_tokens", 0, r.piece_tokens, "a quarter of rollout.max_response_length"))
        r = dataclasses.replace(r, partial_tokens=r.piece_tokens)
    if cfg.surplus != fg.surplus:
        out.append(Derived("algorithm.filter_groups.surplus", fg.surplus, cfg.surplus,
                           "partial rollouts carry kept groups beyond a step's batch (docs/async_rollouts.md)"))
        fg = dataclasses.replace(fg, surplus=cfg.surplus)
    if fg.adaptive and not fg.max_gen_prompts:
        cap = 4 * cfg.data.gen_prompts_per_batch
        out.append(Derived("algorithm.filter_groups.max_gen_prompts", 0, cap, "4 x data.gen_prompts_per_batch"))
        fg = dataclasses.replace(fg, max_gen_prompts=cap)
    corr = cfg.algorithm.rollout_correction
    if (r.max_staleness or r.partial) and not corr.active:
        why = (f"rollout.max_staleness={r.max_staleness}" if r.max_staleness else "rollout.partial=true") + (
            ": truncated importance sampling corrects stale rollouts (set algorithm.rollout_correction to "
            "choose another)")
        out.append(Derived("algorithm.rollout_correction.rollout_is", corr.rollout_is, "token", why))
        if corr.rollout_is_threshold != ASYNC_TIS_CAP:
            out.append(Derived("algorithm.rollout_correction.rollout_is_threshold", corr.rollout_is_threshold,
                               ASYNC_TIS_CAP, "verl's decoupled_token_is cap"))
        corr = dataclasses.replace(corr, rollout_is="token", rollout_is_threshold=ASYNC_TIS_CAP)
    t = cfg.train
    if t.old_log_probs == AUTO:
        _, why = exact_rollout_log_probs(cfg, on_gpu=on_gpu)
        by_machine = pi_old_source(cfg, on_gpu=False) != pi_old_source(cfg, on_gpu=True)
        out.append(Derived("train.old_log_probs", AUTO, pi_old_source(cfg, on_gpu=on_gpu), why, kept=by_machine))
        if not by_machine:
            t = dataclasses.replace(t, old_log_probs=pi_old_source(cfg, on_gpu=on_gpu))
    alarms = cfg.alarms
    if alarms.audit_fn == AUTO:
        from megatron_dapo.observe.observer import audit_fn_name

        name = audit_fn_name(cfg.alarms, cfg.eval, cfg.reward) or "none"
        out.append(Derived("alarms.audit_fn", AUTO, name,
                           "eval.reward_fn, or the value scorer, unless it is reward.fn"))
        alarms = dataclasses.replace(alarms, audit_fn=name)
    m = cfg.model
    if m.dtype == AUTO:
        out.append(Derived("model.dtype", AUTO, resolve_dtype(m.dtype, on_gpu), _machine(on_gpu), kept=True))
    if m.transformer_impl == AUTO:
        out.append(Derived("model.transformer_impl", AUTO, resolve_transformer_impl(m.transformer_impl, on_gpu),
                           _machine(on_gpu), kept=True))
    algorithm = dataclasses.replace(cfg.algorithm, filter_groups=fg, rollout_correction=corr)
    resolved = dataclasses.replace(cfg, loss=loss, eval=ev, rollout=r, algorithm=algorithm, alarms=alarms, train=t)
    return resolved, out


def derive_for_model(cfg: DAPOConfig, hf_config: dict, *, on_gpu: bool) -> list[Derived]:
    """The derived settings that read the model's config.json as well (run.prepare_run: once the inputs are
    read), decided by the machine and kept "auto" (module doc): train.pack_sequences, packed where the
    layout needs one shape for every micro-batch (micro_batch_shapes.py)."""
    from megatron_dapo.micro_batch_shapes import launch_pack_choice

    if cfg.train.pack_sequences != AUTO:
        return []
    packed, why = launch_pack_choice(AUTO, hf_config, model=cfg.model, parallel=cfg.parallel, moe=cfg.moe,
                                     on_gpu=on_gpu)
    return [Derived("train.pack_sequences", AUTO, packed, why, kept=True)]


def pi_old_source(cfg: DAPOConfig, *, on_gpu: bool) -> str:
    """train.old_log_probs with "auto" resolved: "rollout" where the engine's log-probs are the step's
    pi_old exactly (``exact_rollout_log_probs``), else "trainer"."""
    if cfg.train.old_log_probs != AUTO:
        return cfg.train.old_log_probs
    return "rollout" if exact_rollout_log_probs(cfg, on_gpu=on_gpu)[0] else "trainer"


def exact_rollout_log_probs(cfg: DAPOConfig, *, on_gpu: bool) -> tuple[bool, str]:
    """(whether the engine's log-probs of a step's responses are that step's pi_old, why): only an
    engine that computes as the trainer does (the HF engine's ``fp32_logprobs_are_the_trainers``;
    vLLM's kernels differ) and only at fp32 (any bf16 pass differs), for responses of the step's own
    weights, uncorrected."""
    from megatron_dapo.rollout.engine import engine_dtype, get_engine_cls  # the registry, not the engines' packages

    r = cfg.rollout
    dtype = resolve_dtype(cfg.model.dtype, on_gpu)
    same_math = get_engine_cls(r.engine).fp32_logprobs_are_the_trainers
    for stands, why in ((not same_math, f"rollout.engine={r.engine} computes with kernels of its own"),
                        (dtype != "fp32", f"the model runs in {dtype}"),
                        (resolve_dtype(engine_dtype(r.dtype, cfg.model.dtype), on_gpu) != dtype,
                         f"the engine runs in rollout.dtype={r.dtype}"),
                        (r.max_staleness > 0, f"rollout.max_staleness={r.max_staleness}: older weights' responses"),
                        (r.partial, "rollout.partial=true: responses begun by older weights"),
                        (cfg.algorithm.rollout_correction.active, "a rollout correction compares the two")):
        if stands:
            return False, f"recomputed by the trainer: {why}"
    return True, "the HF engine's own, at fp32 from the step's weights: no recompute pass"


def comments(derived: list[Derived]) -> str:
    """config.yaml's closing comment: the settings this launch decided by its machine."""
    kept = [d for d in derived if d.kept]
    if not kept:
        return ""
    return "# decided by this launch's machine and model (the keys above stay auto):\n" + "".join(
        f"#   {d.line()}\n" for d in kept)


def _machine(on_gpu: bool) -> str:
    return "this launch has a GPU" if on_gpu else "this launch has no GPU"


def _show(value: Any) -> str:
    """``value`` as config.yaml spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)
