"""Per-GPU memory of a layout, itemised, before anything launches (``megatron-dapo plan``).

All sizes are for the most loaded rank (the first pipeline stage, which holds the embedding and the
most micro-batches in flight). Trainer state, per parameter of that rank's shard:
  weights      2 B (bf16) or 4 B (fp32)
  gradients    4 B (megatron DDP accumulates main gradients in fp32)
  optimizer    Adam m and v, 8 B, plus an fp32 master copy (4 B) when the weights are bf16;
               divided over DP with the distributed optimizer
(18 B / parameter in bf16 without the distributed optimizer and 6 + 12 / DP with it: megatron's own
``theoretical_memory_usage.py``, checked in tests/unit/test_plan.py).

Activations per micro-batch of ``train.max_tokens_per_micro_batch`` tokens, per layer (bf16):
megatron's estimate with selective recompute, T x h x (18 + 4 ffn / h) bytes, divided by TP (the
layouts here use sequence parallelism; without it only part of it divides). With full recompute a
layer keeps only its input, T x h x 2 bytes (/ TP), and one layer is rebuilt at a time. Without
recompute attention's softmax adds 5 x heads x T x s per layer, which at RL lengths dominates: the
plan uses the selective estimate and the flash-attention kernels (TE) that avoid storing it. The
first pipeline stage holds PP micro-batches in flight (1F1B). The log-prob chunk: the fused output
projection materialises chunks of fp32 logits of DEFAULT_CHUNK_BYTES (logprobs.py), about 3 alive.

The colocated vLLM engine takes ``rollout.gpu_memory_utilization`` of the device (weights at
rollout TP, KV cache, its activations) while it generates; ``sleep`` (level 1) frees all of it but a
small residue, and the trainer's state stays resident through generation (no optimizer offload yet).
So a layout must fit twice: generating (trainer state + vLLM's share) and training (trainer state +
activations + log-prob chunk + vLLM's residue).

Step time: FLOPs at a stated MFU (``mfu``), ignoring attention's quadratic term: generation 2 N per
generated token, old log-probs 2 N per token, the update 6 N (8 N with full recompute).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_dapo.config import DAPOConfig
from megatron_dapo.errors import ConfigError

GB = 1e9
SLEEP_RESIDUE_GB = 1.0  # CUDA context and allocator state vLLM keeps while asleep
LOGPROB_CHUNKS_ALIVE = 3  # logits chunk, its softmax, its gradient (logprobs.py)


@dataclass(frozen=True)
class Shard:
    """Parameters of the most loaded rank: ``sharded`` (divided by TP) and ``replicated`` (norms)."""

    total: int  # the whole model's parameters
    on_rank: float  # parameters on the first pipeline stage of one TP rank


def count_parameters(hf: dict, *, tp: int, pp: int, padded_vocab: int) -> Shard:
    """Qwen2 parameter counts (QKV bias included) for the whole model and the most loaded rank."""
    h, f, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = h // heads
    attn = h * h + 2 * h * kv * head_dim + (h + 2 * kv * head_dim) + h * h  # q, k, v (+ bias), o
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h
    embedding = padded_vocab * h
    tied = hf.get("tie_word_embeddings", False)
    total = layers * (attn + mlp + norms) + h + embedding * (1 if tied else 2)
    # first stage: its layers, the embedding; with PP = 1 also the output layer (when untied) and final norm
    on_rank = layers / pp * ((attn + mlp) / tp + norms) + embedding / tp
    if pp == 1:
        on_rank += h + (0 if tied else embedding / tp)
    return Shard(total=total, on_rank=on_rank)


@dataclass(frozen=True)
class Plan:
    parts: dict[str, float]  # part -> bytes on the most loaded rank (keys: see ``plan``)
    labels: dict[str, str]  # part -> what the printed table calls it
    capacity_gb: float
    tokens_per_step: float
    step_s: float
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def state(self) -> float:
        """The trainer's resident state: weights, gradients, optimizer."""
        return self.parts["weights"] + self.parts["gradients"] + self.parts["optimizer"]

    @property
    def generating_gb(self) -> float:
        return (self.state + self.parts["vllm_generating"]) / GB

    @property
    def training_gb(self) -> float:
        return (self.state + self.parts["activations"] + self.parts["logprob_chunks"] + self.parts["vllm_asleep"]) / GB

    def format(self) -> str:
        lines = [f"  {self.labels[k]:<72} {size / GB:8.2f} GB" for k, size in self.parts.items()]
        lines.append(f"  {'peak while generating (state + vLLM share)':<72} {self.generating_gb:8.2f} GB")
        lines.append(f"  {'peak while training (state + activations + ...)':<72} {self.training_gb:8.2f} GB")
        lines.append(f"  of {self.capacity_gb:.0f} GB per GPU; {self.tokens_per_step / 1e6:.1f}M tokens per step; "
                     f"~{self.step_s / 60:.0f} min per step (estimate)")
        return "\n".join(["per-GPU memory (most loaded rank):", *lines, *self.notes])


def plan(cfg: DAPOConfig, hf: dict, world_size: int, *, capacity_gb: float = 80.0, mfu: float = 0.3,
         peak_tflops: float = 989.0, mean_response_fraction: float = 0.5, on_gpu: bool = True) -> Plan:
    """The plan of ``cfg`` at ``world_size``; ``peak_tflops``: dense bf16 of one GPU (H100/H200: 989)."""
    from megatron_dapo.mcore.logprobs import DEFAULT_CHUNK_BYTES
    from megatron_dapo.mcore.model import padded_vocab_size, resolve_runtime

    p, t, r = cfg.parallel, cfg.train, cfg.rollout
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = p.data_parallel_size(world_size)
    padded = padded_vocab_size(hf["vocab_size"], cfg.model.make_vocab_size_divisible_by, tp)
    shard = count_parameters(hf, tp=tp, pp=pp, padded_vocab=padded)
    bf16 = resolve_runtime(cfg.model, on_gpu, check_installed=False).params_dtype.itemsize == 2
    optimizer_bytes = 8 + (4 if bf16 else 0)
    h, f = hf["hidden_size"], hf["intermediate_size"]
    seq = cfg.data.max_prompt_length + r.max_response_length
    tokens = t.max_tokens_per_micro_batch or t.micro_batch_size * seq
    per_layer = tokens * h * (18 + 4 * f / h) / tp  # megatron's estimate (selective recompute, SP)
    layers = hf["num_hidden_layers"] // pp
    if cfg.model.recompute == "full":
        activations = layers * tokens * h * 2 / tp + per_layer
    else:
        activations = layers * per_layer
    activations *= pp  # micro-batches in flight on the first stage (1F1B)
    vllm = r.engine == "vllm"
    other_optimizer = "without" if p.use_distributed_optimizer else "with"
    rows = {  # part: (label, bytes)
        "weights": (f"weights ({'bf16' if bf16 else 'fp32'}, {shard.on_rank / 1e9:.2f}B params on this rank)",
                    shard.on_rank * (2 if bf16 else 4)),
        "gradients": ("gradients (fp32)", shard.on_rank * 4),
        "optimizer": (f"optimizer ({'fp32 master + ' if bf16 else ''}Adam m, v; "
                      f"{'distributed over DP ' + str(dp) if p.use_distributed_optimizer else 'not distributed'})",
                      shard.on_rank * optimizer_bytes / (dp if p.use_distributed_optimizer else 1)),
        "optimizer_other": (f"(optimizer {other_optimizer} the distributed optimizer)",
                            shard.on_rank * optimizer_bytes / (1 if p.use_distributed_optimizer else dp)),
        "activations": (f"activations ({tokens} tokens/micro-batch, recompute {cfg.model.recompute}, x{pp} in flight)",
                        activations),
        "logprob_chunks": ("log-prob chunks (fp32 logits, logprobs.py)", LOGPROB_CHUNKS_ALIVE * DEFAULT_CHUNK_BYTES),
        "vllm_generating": (f"vLLM while generating (gpu_memory_utilization {r.gpu_memory_utilization})",
                            r.gpu_memory_utilization * capacity_gb * GB if vllm else 0.0),
        "vllm_asleep": ("vLLM asleep (what sleep leaves)", SLEEP_RESIDUE_GB * GB if vllm else 0.0),
    }
    prompts = cfg.data.gen_prompts_per_batch if cfg.algorithm.filter_groups.enable else cfg.data.prompts_per_step
    generated = prompts * r.n * r.max_response_length * mean_response_fraction
    trained = cfg.data.prompts_per_step * r.n * (cfg.data.max_prompt_length / 2 + r.max_response_length * mean_response_fraction)
    update = 8 if cfg.model.recompute == "full" else 6
    flops = shard.total * (2 * generated + (2 + update) * trained * t.ppo_epochs)
    step_s = flops / (world_size * peak_tflops * 1e12 * mfu)
    notes = [f"  assumptions: responses average {mean_response_fraction:.0%} of rollout.max_response_length and "
             f"prompts half of data.max_prompt_length; MFU {mfu:.0%} of {peak_tflops:.0f} TFLOP/s; the generation "
             f"batch is {prompts} prompts (a step with dynamic sampling may draw more)"]
    return Plan({k: v for k, (_, v) in rows.items()}, {k: label for k, (label, _) in rows.items()}, capacity_gb,
                trained, step_s, notes)


def check_fits(result: Plan, cfg: DAPOConfig) -> None:
    """ConfigError naming the knob when either phase exceeds the capacity."""
    worst = max(result.generating_gb, result.training_gb)
    if worst <= result.capacity_gb:
        return
    parts = result.parts
    if result.generating_gb >= result.training_gb:
        fix = (f"lower rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} (the trainer's state "
               f"stays resident while vLLM generates)")
    elif parts["activations"] >= max(parts["weights"], parts["optimizer"]):
        fix = "set model.recompute=full or lower train.max_tokens_per_micro_batch"
    elif not cfg.parallel.use_distributed_optimizer:
        fix = "set parallel.use_distributed_optimizer=true"
    else:
        fix = "raise parallel.tensor_model_parallel_size or pipeline_model_parallel_size"
    phase = "generating" if result.generating_gb >= result.training_gb else "training"
    raise ConfigError(f"the layout needs {worst:.1f} GB per GPU while {phase}, over {result.capacity_gb:.0f} GB: {fix}")
