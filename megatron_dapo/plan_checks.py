"""A plan that does not fit, refused in one line naming the knob that fixes it, each fix sized from the
plan (memory_plan.py) so that what it advises fits when set: vLLM's share while one still holds the
engine's weights and one sequence, else the offload, the wider trainer or the larger rollout TP that
makes room for it; and, with separate placement, a wait timeout shorter than the planned step.
``megatron-dapo plan`` and ``train --dry-run`` end with these checks."""

from __future__ import annotations

import math

from megatron_dapo.config import DAPOConfig, RolloutConfig
from megatron_dapo.errors import ConfigError
from megatron_dapo.memory_plan import GB, Plan


def check_fits(result: Plan, cfg: DAPOConfig) -> None:
    """ConfigError naming the knob when either phase exceeds the reported capacity, then when vLLM's
    share leaves no KV cache for one sequence of data.max_prompt_length + rollout.max_response_length."""
    r, cap = result.rollout, result.capacity_gb
    knob = _kv_knob(cfg.rollout)
    worst = max(result.generating_gb, result.training_gb)
    if worst > cap:
        raise ConfigError(_over_capacity(result, cfg, worst))
    if r is not None and r.tokens(r.kv) < r.max_sequence:
        raise ConfigError(
            f"vLLM's KV cache would hold {r.tokens(r.kv):,.0f} tokens per replica, less than one "
            f"{r.max_sequence}-token sequence (vLLM refuses to start): raise {knob} or "
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}")


def check_waits(result: Plan, rollout: RolloutConfig) -> None:
    """Separate placement: a ConfigError naming rollout.wait_timeout_minutes when it is less than
    twice the planned step (the longest a rank waits for the other side is a generation batch or a
    training phase, each within a step; twice, since the plan's estimates are not measurements)."""
    limit = rollout.wait_timeout_minutes
    if rollout.placement == "separate" and 2 * result.step_s / 60 > limit:
        raise ConfigError(f"rollout.wait_timeout_minutes={limit:g} is less than twice the planned step "
                          f"(~{result.step_s / 60:.0f} min): a rank waiting for the other side's generation or "
                          f"training would give up; raise it to >= {math.ceil(2 * result.step_s / 60)}")


def _kv_knob(rollout: RolloutConfig) -> str:
    """The setting that sizes vLLM's KV cache, with its value."""
    return (f"rollout.kv_cache_memory_mb={rollout.kv_cache_memory_mb}" if rollout.kv_cache_memory_mb
            else f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}")


def _over_capacity(result: Plan, cfg: DAPOConfig, worst: float) -> str:
    """The message for a phase over capacity, with the knob that fixes it."""
    parts = result.parts
    generating = result.rollout is not None and result.generating_gb >= result.training_gb
    if generating:
        fix = _generating_fix(result, cfg)
    elif parts["activations"] >= max(parts["weights"], parts.get("master", 0.0) + parts["adam"]):
        fix = _activations_fix(result, cfg)
    elif not cfg.parallel.use_distributed_optimizer:
        fix = "set parallel.use_distributed_optimizer=true"
    else:
        fix = "raise parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size" + (
            " or parallel.expert_model_parallel_size" if _has_experts(result) else "")
    phase = "generating" if generating else "training"
    return (f"the layout needs {worst:.1f} GB per GPU while {phase}, over the {result.capacity_gb:.1f} GB "
            f"{result.gpu.name} reports: {fix}")


def _activations_fix(result: Plan, cfg: DAPOConfig) -> str:
    """What shrinks the activations: full recompute, a smaller micro-batch while it holds more than
    one sequence, and context parallelism, which divides every sequence's positions (the only one
    left when a single sequence is the micro-batch: 20k-32k-token responses); else more TP or PP
    ranks."""
    t, p = cfg.train, cfg.parallel
    fixes = ["set model.recompute=full"] if cfg.model.recompute != "full" else []
    sequence = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if t.max_tokens_per_micro_batch > sequence:
        fixes.append(f"lower train.max_tokens_per_micro_batch (down to one sequence, {sequence})")
    elif not t.max_tokens_per_micro_batch and t.micro_batch_size > 1:
        fixes.append(f"lower train.micro_batch_size={t.micro_batch_size}")
    cp, dp = p.context_parallel_size, p.data_parallel_size(result.world_size)
    where = "" if dp % 2 == 0 else f" on twice the GPUs (DP {dp} does not halve)"
    fixes.append(f"raise parallel.context_parallel_size={cp} to {2 * cp}{where} (each rank then holds "
                 f"1/{2 * cp} of every sequence)")
    return " or ".join(fixes or ["raise parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size"])


def _generating_fix(result: Plan, cfg: DAPOConfig) -> str:
    """How the generating phase fits: a smaller vLLM share while one still holds the engine's weights and
    one sequence (Plan.engine_floor), else only what makes room for that (_room_for_engine)."""
    r, a, cap = result.rollout, cfg.actor, result.capacity_bytes
    kept = "what the offload leaves" if a.offload_during_rollout else "the trainer's state"
    room = cap - result.beside_engine(offload=a.offload_during_rollout, offload_weights=a.offload_weights)
    if room >= result.engine_floor:
        fix = (f"lower {_kv_knob(cfg.rollout)} to <= {_most(result, cfg.rollout, room)} ({kept} stays resident "
               "while vLLM generates)")
        if not a.offload_during_rollout:
            offloaded = cap - result.beside_engine(offload=True, offload_weights=a.offload_weights)
            fix += (f", or set actor.offload_during_rollout=true (moves {r.offload / GB:.1f} GB off the GPU "
                    f"while generating; then up to {_most(result, cfg.rollout, offloaded)})")
        elif not a.offload_weights:
            fix += f", or set actor.offload_weights=true (another {result.parts['weights'] / GB:.1f} GB)"
        return fix
    if result.engine_floor > cap:
        share = "more than the whole GPU: "
    elif cfg.rollout.kv_cache_memory_mb:
        share = ""
    else:
        share = f"a utilization of {result.least_utilization:.2f}: "
    return (f"no {_kv_knob(cfg.rollout).split('=')[0]} fits: vLLM needs {result.engine_floor / GB:.1f} GB per GPU "
            f"({share}its weights at rollout TP {r.tensor_parallel} {r.weights / GB:.1f} GB, activations "
            f"{r.activations / GB:.1f} GB, the KV cache of one {r.max_sequence}-token sequence "
            f"{r.max_sequence * r.kv_bytes_per_token_per_gpu / GB:.1f} GB) and {max(0.0, room) / GB:.1f} GB is left "
            f"beside {kept}; " + " or ".join(_room_for_engine(result, cfg)))


def _has_experts(result: Plan) -> bool:
    """Whether the plan's model has experts, whose share per GPU a larger EP shrinks too."""
    return result.shard is not None and result.shard.experts_on_rank > 0


def _most(result: Plan, rollout: RolloutConfig, room: float) -> str:
    """The largest value of the knob that sizes vLLM's share (_kv_knob) within ``room`` bytes per GPU."""
    r = result.rollout
    if rollout.kv_cache_memory_mb:
        return str(int((room - r.weights - r.activations) // 2**20))
    return f"{math.floor(100 * room / result.capacity_bytes) / 100:.2f}"


def _room_for_engine(result: Plan, cfg: DAPOConfig) -> list[str]:
    """What would leave Plan.engine_floor free while vLLM generates, each sized from the plan: the first
    offload setting not yet on that does, a trainer spread over more GPUs (its state per GPU shrinks with
    TP x PP at the same DP), else a larger rollout TP or a larger GPU."""
    a, p, r = cfg.actor, cfg.parallel, result.rollout
    cap, floor = result.capacity_bytes, result.engine_floor
    fixes = []
    offload = [] if a.offload_during_rollout else ["actor.offload_during_rollout=true"]
    offloads = [(offload, False)] if offload else []  # (settings to add, whether the weights move too)
    if not a.offload_weights:
        offloads.append(([*offload, "actor.offload_weights=true"], True))
    value = cfg.rollout.kv_cache_memory_mb or cfg.rollout.gpu_memory_utilization
    for keys, weights in offloads:
        room = cap - result.beside_engine(offload=True, offload_weights=weights)
        if room >= floor:
            most = _most(result, cfg.rollout, room)
            knob = _kv_knob(cfg.rollout)
            then = f"{knob} then fits" if value <= float(most) else f"then lower {knob} to <= {most}"
            fixes.append(f"set {' and '.join(keys)} ({then})")
            break
    fixed = result.beside_engine(offload=True, offload_weights=True)  # the context and the communicators
    state = result.beside_engine(offload=a.offload_during_rollout, offload_weights=a.offload_weights) - fixed
    spare = cap - fixed - floor  # what the trainer's state may take beside the smallest engine
    if spare > 0:
        times = 2 ** math.ceil(math.log2(state / spare))
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        ep = f" or EP (now {p.expert_model_parallel_size})" if _has_experts(result) else ""
        fixes.append(f"spread the trainer over more GPUs with a larger TP x PP (now {mp}){ep}: its {state / GB:.1f} GB "
                     f"per GPU resident while vLLM generates must come down to {spare / GB:.1f} GB, about {times}x "
                     "the GPUs")
    else:
        fixes.append(f"raise rollout.tensor_parallel_size={r.tensor_parallel} (the engine's weights, "
                     f"{r.weights / GB:.1f} GB per GPU, shrink in proportion) or use GPUs with more memory")
    return fixes
