"""Typed schema of every setting: the one home of defaults.

Each section is a frozen, keyword-only dataclass; every field carries a one-line help text in its
metadata, from which ``conf/base.yaml`` is generated (a test checks the file is current). YAML files
and ``key=value`` overrides are applied by ``megatron_dapo.config_loading``; unknown keys and
inconsistent values fail there, before any heavy work.

Defaults follow the DAPO paper (arXiv 2503.14476, section 4.1) and, where the paper is silent, the
verl reproduction recipe (``run_dapo_qwen2.5_32b.sh``): see docs/reference/dapo.md 1.4, 2.1, 5.
Deviations are noted on the field.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megatron_dapo.config_algo import POLICY_LOSS_DEFAULTS, AlgorithmConfig, FilterGroupsConfig, LossConfig
from megatron_dapo.config_fields import above, at_least, fail, field_help, require, section, setting
from megatron_dapo.config_moe import MoEConfig
from megatron_dapo.config_toy import ToyConfig

__all__ = ["POLICY_LOSS_DEFAULTS", "AlgorithmConfig", "DAPOConfig", "FilterGroupsConfig", "LossConfig", "MoEConfig",
           "ToyConfig", "field_help"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    hf_path: str = setting("", "HF model dir (config.json, tokenizer; safetensors for conversion)")
    checkpoint: str = setting("", "starting weights from a converted dist checkpoint "
                               "(tools/convert_ckpt/hf_to_megatron.py) or a run's checkpoints dir; empty: "
                               "model.hf_path's safetensors, each rank reading its own shard")
    dtype: Literal["auto", "bf16", "fp32"] = setting("auto", "training dtype; auto = bf16 on GPU, fp32 on CPU")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = setting(
        "auto", "layer spec; auto = transformer_engine on GPU, local on CPU")
    fp8: Literal["e4m3", "hybrid"] | None = setting(None, "FP8 format via Transformer Engine; null = off")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise"] = setting("delayed", "FP8 scaling recipe")
    recompute: Literal["none", "selective", "full"] = setting("none", "activation recompute granularity")
    make_vocab_size_divisible_by: int = setting(128, "pad the vocabulary to a multiple of lcm(this, TP): the same size "
                                                "at any TP")

    def __post_init__(self):
        if self.fp8 is not None and self.transformer_impl == "local":
            fail("model.fp8 needs Transformer Engine: set model.transformer_impl=transformer_engine "
                 "(or auto on GPU), or model.fp8=null")
        if self.make_vocab_size_divisible_by < 1:
            fail(f"model.make_vocab_size_divisible_by must be >= 1, got {self.make_vocab_size_divisible_by}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = setting(1, "TP: shards attention heads, MLP and vocabulary")
    pipeline_model_parallel_size: int = setting(1, "PP: splits the layers into stages")
    virtual_pipeline_model_parallel_size: int | None = setting(None, "interleaved PP chunks per stage; null = off")
    sequence_parallel: bool = setting(False, "shard LayerNorm/dropout activations along the sequence (needs TP > 1)")
    context_parallel_size: int = setting(1, "CP: splits long sequences across ranks")
    expert_model_parallel_size: int = setting(1, "EP: splits an MoE layer's experts over this many of the "
                                                 "data- and context-parallel ranks (must divide DP x CP and the "
                                                 "experts)")
    use_distributed_optimizer: bool = setting(True, "shard optimizer states across data-parallel ranks")
    timeout_minutes: float = setting(30.0, "how long one collective may wait for the other ranks (NCCL's watchdog, "
                                      "gloo's timeout); no collective waits for a generation batch or a training phase")

    def __post_init__(self):
        one = at_least(1)
        require("parallel", self, tensor_model_parallel_size=one, pipeline_model_parallel_size=one,
                context_parallel_size=one, expert_model_parallel_size=one, timeout_minutes=above(0))
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 2 or self.pipeline_model_parallel_size < 2):
            fail(f"parallel.virtual_pipeline_model_parallel_size={vpp} needs a value >= 2 and "
                 f"pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size}); or set it to null")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            fail("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1; "
                 "set parallel.sequence_parallel=false")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP x PP x CP); a clear error when it does not divide."""
        mp = self.model_parallel_size
        if world_size % mp:
            fail(f"world size {world_size} is not divisible by TP x PP x CP = "
                 f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size} x "
                 f"{self.context_parallel_size} = {mp}; change parallel.tensor_model_parallel_size, "
                 "pipeline_model_parallel_size or context_parallel_size, or the number of processes")
        return world_size // mp

    def expert_pool(self, world_size: int) -> int:
        """The ranks expert parallelism draws its EP ranks from, which EP must divide (``expert_pool``)."""
        return expert_pool(world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size)


def expert_pool(world_size: int, tp: int, pp: int) -> int:
    """DP x CP = world / (TP x PP): megatron-core 0.19.2 draws the expert-parallel ranks from the data- and
    context-parallel ones (its expert rank generator has no CP; expert TP = TP)."""
    return world_size // (tp * pp)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_files: tuple[str, ...] = setting((), "training prompts: DAPO-format parquet or JSONL files")
    val_files: tuple[str, ...] = setting(("data/aime-2024.parquet",), "evaluation prompts (AIME-2024 ships in data/)")
    dedup: bool = setting(True, "merge identical training prompts (DAPO-Math-17K ships ~100x); eval files always "
                          "merged")
    on_bad_row: Literal["error", "skip"] = setting("error", "malformed rows: stop with an error, or count and skip")
    max_prompt_length: int = setting(2048, "prompts longer than this many tokens are dropped (counted)")
    shuffle: bool = setting(True, "shuffle prompts each epoch (seeded; resumable)")
    prompts_per_step: int = setting(512, "prompt groups in one training (rollout) step")
    gen_prompts_per_batch: int = setting(1536, "prompts per generation batch with dynamic sampling (verl "
                                         "gen_batch_size: 3 x 512); without it a generation batch is prompts_per_step")
    skip_solved_after: int = setting(0, "curation: skip a prompt once every response to it was correct this many times "
                                     "in a row (the pass-rate ledger, counted and logged); 0 = never skip")

    def __post_init__(self):
        one = at_least(1)
        require("data", self, max_prompt_length=one, prompts_per_step=one, gen_prompts_per_batch=one,
                skip_solved_after=at_least(0))


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: str = setting("vllm", "generation backend (registry): vllm (GPU, or its CPU build) or hf (transformers; "
                          "CPU)")
    n: int = setting(16, "responses per prompt (the group size G)")
    temperature: float = setting(1.0, "sampling temperature; trainer log-probs use the same temperature")
    top_p: float = setting(1.0, "nucleus sampling for training rollouts")
    top_k: int = setting(-1, "top-k for training rollouts; -1 = off")
    max_response_length: int = setting(20480, "generation limit L_max in tokens (16384 + 4096 soft cache)")
    dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "the engine's weights and compute; auto = model.dtype. bf16 beside an fp32 trainer gives a CPU run the "
                "engine/trainer numerics mismatch of a GPU run")
    tensor_parallel_size: int = setting(1, "rollout TP: ranks per engine replica (independent of Megatron's TP/PP); "
                                      "world / this = replicas")
    gpu_memory_utilization: float = setting(0.7, "vLLM: fraction of the device's TOTAL memory the engine may use "
                                            "(weights + KV cache) while awake")
    kv_cache_memory_mb: int = setting(0, "vLLM KV cache in MiB, overriding gpu_memory_utilization; 0 = off. Set it "
                                    "on CPU, where vLLM counts the whole process (trainer too) against the fraction")
    enforce_eager: bool = setting(True, "no CUDA graphs in vLLM (the verl recipe notes graphs hurt accuracy)")
    weight_sync_bucket_mb: int = setting(512, "MiB per bucket when streaming weights into the engine: the export "
                                         "gathers that much of full tensors at a time, and the engine loads it in one "
                                         "call")
    check_logprob_mismatch: bool = setting(True, "log rollout/logprob_mismatch (engine vs trainer) every step")
    sleep_level: int = setting(2, "vLLM sleep while the trainer works: 2 discards the engine's weights (valid here: "
                             "every wake is followed by a full weight sync), 1 copies them to pinned host memory and "
                             "back")
    placement: str = setting("colocated", "colocated: every rank trains and holds a replica's share (engines sleep "
                                      "while the trainer works); separate: the last rollout.num_ranks ranks hold only "
                                      "engines")
    num_ranks: int = setting(0, "with placement=separate: the engines' ranks, a multiple of tensor_parallel_size, "
                           "fewer than the world")
    max_staleness: int = setting(0, "with placement=separate: weight versions a trained rollout may lag behind the "
                               "trainer; 0 = generate then train (as colocated), 1 = the next step's first generation "
                               "batch is generated while this step trains, k = up to k steps ahead")
    partial: bool = setting(False, "partial rollouts: a generation batch adds at most partial_tokens to a response; "
                              "one still running continues from its prefix in the next batch, from the weights then")
    partial_tokens: int = setting(0, "with partial: the tokens a response may grow by in one generation batch, a "
                                "divisor of max_response_length; 0 = max_response_length / 4")
    partial_unfinished: Literal["carry", "abort"] = setting(
        "carry", "with partial: groups still growing when a step is full: carried on, or aborted (dropped)")
    wait_timeout_minutes: float = setting(240.0, "with placement=separate: how long a rank waits for the other side's "
                                            "work (the engines' generation, the trainers' step) before it gives "
                                            "up; `megatron-dapo plan` checks the planned step against it")

    def __post_init__(self):
        if self.sleep_level not in (1, 2):
            fail(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.n < 2:
            fail(f"rollout.n must be >= 2 (group-relative advantages need a group), got {self.n}")
        if self.temperature <= 0:
            fail(f"rollout.temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            fail(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.kv_cache_memory_mb < 0:
            fail("rollout.kv_cache_memory_mb must be >= 0 (0 = use gpu_memory_utilization), got "
                 f"{self.kv_cache_memory_mb}")
        require("rollout", self, max_response_length=at_least(1), tensor_parallel_size=at_least(1),
                weight_sync_bucket_mb=at_least(1), wait_timeout_minutes=above(0))
        if not 0 < self.gpu_memory_utilization < 1:
            fail(f"rollout.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        if self.placement not in ("colocated", "separate"):
            fail(f"rollout.placement must be colocated or separate, got {self.placement!r}")
        if (self.placement == "separate") != (self.num_ranks > 0) or self.num_ranks < 0:
            fail(f"rollout.num_ranks={self.num_ranks} with rollout.placement={self.placement}: separate placement "
                 "needs the engines' ranks (rollout.num_ranks >= 1), colocated none (0)")
        if self.max_staleness < 0:
            fail(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness and self.placement != "separate":
            fail(f"rollout.max_staleness={self.max_staleness} with rollout.placement={self.placement}: colocated "
                 "engines share the trainers' devices, so generation cannot overlap training; use "
                 "rollout.placement=separate with rollout.num_ranks, or rollout.max_staleness=0")

    @property
    def piece_tokens(self) -> int:
        """With ``partial``: the most tokens one generation batch adds to a response (else the limit)."""
        return (self.partial_tokens or self.max_response_length // 4) if self.partial else self.max_response_length


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    enable: bool = setting(True, "soft overlong punishment (Eq. 13) added to the +-1 score")
    len: int = setting(4096, "L_cache: the penalty ramps from 0 at L_max - len to -penalty_factor at L_max")
    penalty_factor: float = setting(1.0, "penalty at L_max")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    fn: str = setting("dapo_math", "training scorer (registry): dapo_math (ours, compares values) or math_dapo_paper "
                      "(the paper's exact string rule)")
    num_workers: int = setting(2, "reward worker processes; 0 = score inline without a time limit")
    timeout_s: float = setting(10.0, "per-response scoring time limit; a timeout scores as incorrect")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "soft overlong punishment")
    overlong_filter: bool = setting(False, "mask the loss of truncated responses (off in the verl recipe's best runs)")

    def __post_init__(self):
        require("reward", self, num_workers=at_least(0), timeout_s=above(0))


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = setting(1e-6, "AdamW learning rate, constant after warmup")
    lr_warmup_steps: int = setting(20, "linear warmup, in rollout steps (paper: 20; verl script: 10)")
    weight_decay: float = setting(0.1, "AdamW weight decay (verl recipe; the paper does not say)")
    adam_beta1: float = setting(0.9, "AdamW beta1")
    adam_beta2: float = setting(0.999, "AdamW beta2")
    adam_eps: float = setting(1e-8, "AdamW epsilon")
    clip_grad: float = setting(1.0, "global gradient-norm clip; 0 = off")

    def __post_init__(self):
        beta = ((lambda v: 0 <= v < 1), "in [0, 1)")
        require("optim", self, lr=above(0), lr_warmup_steps=at_least(0), weight_decay=at_least(0),
                 adam_beta1=beta, adam_beta2=beta, adam_eps=above(0), clip_grad=at_least(0))


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    offload_during_rollout: bool = setting(False, "move the optimizer state and gradients to pinned host memory while "
                                             "the engine generates, back before old log-probs: room for vLLM's KV "
                                             "cache")
    offload_weights: bool = setting(False, "with offload_during_rollout: the trainer's weights too (the engine "
                                      "generates with its own copy)")

    def __post_init__(self):
        if self.offload_weights and not self.offload_during_rollout:
            fail("actor.offload_weights=true needs actor.offload_during_rollout=true (weights go with the rest)")


OLD_LOG_PROBS = ("trainer", "rollout", "auto")  # train.old_log_probs


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    total_steps: int = setting(320, "rollout steps, each 16 gradient updates at paper scale (verl#795: the paper ran "
                               "~320)")
    mini_batch_prompts: int = setting(32, "prompt groups per optimizer update (32 x 16 = 512 responses: 16 "
                                      "updates/step)")
    ppo_epochs: int = setting(1, "passes over each step's batch")
    micro_batch_size: int = setting(1, "sequences per micro-batch when max_tokens_per_micro_batch is 0")
    max_tokens_per_micro_batch: int = setting(22528, "token budget per micro-batch (dynamic batch size); 0 = fixed "
                                              "size")
    pack_sequences: bool | Literal["auto"] = setting(
        "auto", "micro-batches of samples laid end to end without padding (THD), up to max_tokens_per_micro_batch "
                "tokens, attention kept within each sample; false = rows padded to their longest; auto = packed where "
                "the layout needs one shape for every micro-batch (interleaved PP 2, an MoE model's allgather "
                "dispatcher under EP or PP) on the local spec, padded elsewhere (docs/packing.md)")
    generation_budget: int = setting(0, "also stop after the step in which this many responses have been generated in "
                                   "all (kept or dropped by dynamic sampling): runs compared at equal generation "
                                   "cost; 0 = no budget")
    logprob_chunk_tokens: int = setting(0, "tokens per chunk of the output layer's log-prob pass; 0 = 256 within 160 "
                                      "MiB per fp32 buffer (tuned on 2 CPU cores: re-measure on a GPU, "
                                      "benchmarks/train_step.py)")
    old_log_probs: str = setting("trainer", "pi_old of the loss: trainer = recomputed by a forward pass over the "
                            "step's batch before its updates; rollout = the engine's own log-probs of the sampled "
                            "tokens, no pass (exact only where the engine computes at the trainer's precision from the "
                            "same weights, as the HF engine in fp32; verl's bypass mode); the engine/trainer mismatch "
                            "is then measured in the first update's forward; auto = rollout where that is exact "
                            "(the HF engine at fp32, no stale or partial rollouts, no rollout correction), else "
                            "trainer")

    def __post_init__(self):
        one, zero = at_least(1), at_least(0)
        require("train", self, total_steps=one, mini_batch_prompts=one, ppo_epochs=one, micro_batch_size=one,
                 max_tokens_per_micro_batch=zero, generation_budget=zero, logprob_chunk_tokens=zero,
                 old_log_probs=((lambda v: v in OLD_LOG_PROBS), f"one of {', '.join(OLD_LOG_PROBS)}"))


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every: int = setting(5, "evaluate every N rollout steps; 0 = never during training")
    before_train: bool = setting(True, "evaluate once before the first step")
    n: int = setting(32, "samples per problem: avg@n, pass@n, cons@n")
    temperature: float = setting(1.0, "sampling temperature (DAPO eval: 1.0)")
    top_p: float = setting(0.7, "nucleus sampling (DAPO eval: 0.7)")
    max_response_length: int | None = setting(None, "generation limit in evaluation; null = "
                                              "rollout.max_response_length (the engine is sized for it: more is "
                                              "refused)")
    reward_fn: str = setting("math_dapo_paper", "scorer of eval/avg@n etc. (registry; the paper's rule, comparable "
                             "with its numbers); eval/*_value always use dapo_math")

    def __post_init__(self):
        require("eval", self, every=at_least(0), n=at_least(1),
                 max_response_length=((lambda v: v is None or v >= 1), ">= 1 (or null: the rollout's)"),
                 temperature=at_least(0), top_p=((lambda v: 0 < v <= 1), "in (0, 1]"))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str = setting("", "checkpoint directory; empty = <logging.dir>/checkpoints")
    save_every: int = setting(5, "save every N rollout steps; 0 = only at the end")
    keep_last: int = setting(2, "checkpoints kept on disk (older ones are deleted after a successful save)")
    resume: Literal["auto", "never"] = setting("auto", "auto: continue from the latest checkpoint in dir")
    stop_grace_s: float = setting(25.0, "seconds from SIGTERM / SIGINT to the kill (torchrun waits 30, SLURM's "
                                   "KillWait is 30): a step that cannot finish and save in them is abandoned, exit 0")
    time_limit_margin_s: float = setting(120.0, "with a known job end (SLURM): stop and save when the next step and "
                                           "its save would end less than this before it")
    memory_efficient_save: bool = setting(True, "distributed optimizer: gather its fully reshardable state on DP rank "
                                           "0 only (the copy that is written), not on every DP rank's host; loads at "
                                           "any TP/PP either way")
    async_save: bool = setting(False, "write a save's files from a child process while the next step trains: "
                               "training waits only for the copy of the device state to host memory, which the "
                               "child holds until written (docs/checkpoints_memory.md); published once written")

    def __post_init__(self):
        require("checkpoint", self, save_every=at_least(0), keep_last=at_least(1), stop_grace_s=at_least(0),
                time_limit_margin_s=at_least(0))


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    dir: str = setting("runs/dapo", "run directory: metrics.jsonl, TensorBoard events, resolved config")
    tensorboard: bool = setting(True, "write TensorBoard events")
    wandb: bool = setting(False, "log to Weights & Biases (when installed)")
    wandb_project: str = setting("megatron-dapo", "W&B project")
    progress: bool = setting(True, "rank 0's progress: a line per step, and inside a step (generation, updates, "
                             "evaluation, save) a line rewritten in place on a terminal, else one every "
                             "progress_every_s")
    progress_every_s: float = setting(30.0, "seconds between two progress lines inside a step in a log (not a "
                                      "terminal); a shorter step prints its step line only")
    samples_every: int = setting(1, "write <dir>/samples/step_N.jsonl every N steps (read: megatron-dapo samples); 0 = "
                                 "never")
    samples_per_step: int = setting(64, "responses per dump, whole prompt groups (and as many of an evaluation's)")
    samples_max_chars: int = setting(8000, "a longer response is cut in its middle in a dump (the answer line kept)")

    def __post_init__(self):
        zero = at_least(0)
        require("logging", self, samples_every=zero, samples_per_step=zero, samples_max_chars=at_least(200),
                progress_every_s=zero)


@dataclass(frozen=True, kw_only=True)
class AlarmsConfig:
    enable: bool = setting(True, "alarm metrics every step (alarm/*), a warning line when one crosses its threshold")
    audit_fn: str = setting("auto", "second scorer of every training response (scorer disagreement); auto = "
                            "eval.reward_fn, or dapo_math when that is reward.fn; none = off")
    scorer_disagreement: float = setting(0.1, "fraction of responses the two scorers judge differently")
    repeated_answer_label: float = setting(0.05, "fraction of responses whose answer line repeats 'Answer' "
                                           "(Answer: Answer: 5) and that the reward accepts")
    no_answer_line: float = setting(0.5, "fraction of responses with no 'Answer:' line")
    identical_groups: float = setting(0.5, "fraction of prompt groups whose responses are all the same wrong text "
                                      "(the same right one is a solved prompt)")
    entropy_min: float = setting(0.02, "actor/entropy below this: entropy collapse")
    mismatch_max: float = setting(1.05, "rollout/logprob_mismatch above this (mean exp|engine - trainer log-prob|; 1 = "
                                  "equal)")
    all_correct: float = setting(0.9, "fraction of generated groups all correct (dynamic sampling saturates)")
    all_correct_steps: int = setting(5, "steps in a row above alarms.all_correct before that alarm is raised: a "
                                     "solved data set stays solved, one lucky draw of prompts does not")
    shortcut_fallbacks: float = setting(0.0, "output-layer gradient shortcuts that fell back to recompute, per step")
    max_samples: int = setting(16, "offending responses written per raised alarm and step (samples/alarm_*.jsonl)")

    def __post_init__(self):
        frac = ((lambda v: 0 <= v <= 1), "in [0, 1]")
        require("alarms", self, scorer_disagreement=frac, repeated_answer_label=frac, no_answer_line=frac,
                identical_groups=frac, all_correct=frac, entropy_min=at_least(0), mismatch_max=at_least(1),
                 shortcut_fallbacks=at_least(0), max_samples=at_least(0), all_correct_steps=at_least(1))


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    steps: tuple[int, ...] = setting((), "[a, b]: a torch profiler trace of steps a..b (1-based, inclusive) under "
                                     "<logging.dir>/profile/ (chrome trace; NVTX ranges on CUDA); [] = off")
    with_stack: bool = setting(False, "record Python stacks in the trace (slower, larger)")

    def __post_init__(self):
        if self.steps and not (len(self.steps) == 2 and 1 <= self.steps[0] <= self.steps[1]):
            fail(f"profile.steps must be [a, b] with 1 <= a <= b (steps to trace), or [] (off); got {list(self.steps)}")


@dataclass(frozen=True, kw_only=True)
class DAPOConfig:
    seed: int = setting(1, "seeds data order, sampling and initialisation")
    num_threads: int = setting(0, "torch intra-op threads per process on CPU; 0 = torch's default")
    model: ModelConfig = section(ModelConfig, "the policy model")
    parallel: ParallelConfig = section(ParallelConfig, "Megatron parallelism")
    moe: MoEConfig = section(MoEConfig, "mixture of experts (Qwen3-MoE): dispatch, router losses, routing replay")
    data: DataConfig = section(DataConfig, "prompts and batch sizes")
    rollout: RolloutConfig = section(RolloutConfig, "generation")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "advantages and dynamic sampling")
    loss: LossConfig = section(LossConfig, "policy loss")
    reward: RewardConfig = section(RewardConfig, "reward and overlong shaping")
    actor: ActorConfig = section(ActorConfig, "the trainer's state around generation")
    optim: OptimConfig = section(OptimConfig, "optimizer")
    train: TrainConfig = section(TrainConfig, "update schedule")
    eval: EvalConfig = section(EvalConfig, "evaluation")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints and resume")
    logging: LoggingConfig = section(LoggingConfig, "metrics, progress and sample dumps")
    alarms: AlarmsConfig = section(AlarmsConfig, "warnings for reward hacking, collapse and drift")
    profile: ProfileConfig = section(ProfileConfig, "torch profiler traces of chosen steps")
    toy: ToyConfig = section(ToyConfig, "the synthetic task and tiny base of the CPU demo")

    def __post_init__(self):
        require("", self, seed=at_least(0), num_threads=at_least(0))  # seeds derive per response (>= 0)
        from megatron_dapo.config_rules import validate_cross_section
        validate_cross_section(self)

    @property
    def updates_per_step(self) -> int:
        return self.data.prompts_per_step // self.train.mini_batch_prompts * self.train.ppo_epochs

    @property
    def surplus(self) -> str:
        """algorithm.filter_groups.surplus, always "carry" with partial rollouts (docs/async_rollouts.md: why)."""
        return "carry" if self.rollout.partial else self.algorithm.filter_groups.surplus

    @property
    def eval_max_response_length(self) -> int:
        """eval.max_response_length, or the rollout's limit when it is null."""
        return self.eval.max_response_length or self.rollout.max_response_length

    def loss_settings(self) -> LossConfig:
        """The loss section with every "auto" resolved for the chosen policy loss (LossConfig.resolved)."""
        return self.loss.resolved(self.rollout.max_response_length)

    @property
    def checkpoint_root(self) -> Path:
        """Where the run's checkpoints live: checkpoint.dir, else <logging.dir>/checkpoints."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.logging.dir) / "checkpoints"
