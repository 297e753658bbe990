"""``MegatronActor``: the policy behind NeMo-Aligner's actor method names
(docs/reference/nvidia_stack.md 1.3).

One object per rank holds this rank's model chunks (DDP-wrapped), the optimizer and the
lr schedule, built from a DAPOConfig and an HF config.json. Batches are lists of
``batching.Sample``: the whole mini-batch, the same list on every rank. Each DP rank takes its
share (``split_for_data_parallel``, token-balanced), so callers never deal with the layout.

What NeMo-Aligner's hooks do here: ``prepare_for_inference`` / ``finish_inference`` switch
train / eval mode. Offloading while the engine generates (``actor.offload_during_rollout``,
NeMo-Aligner's ``offload_adam_states``) has its own pair, ``offload_for_rollout`` /
``onload_after_rollout`` (mcore/offload.py, docs/offload.md). ``export_hf_weights`` streams full
HF tensors (megatron_dapo.convert.export) for the rollout engine's weight sync.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megatron_dapo.config import DAPOConfig
from megatron_dapo.mcore import checkpoint
from megatron_dapo.batching import Sample, split_for_data_parallel
from megatron_dapo.mcore.model import build_model, conversion_table_for, hf_arch
from megatron_dapo.mcore.moe import install_replay
from megatron_dapo.mcore.offload import StateOffloader
from megatron_dapo.mcore.optimizer import build_optimizer, build_scheduler, wrap_model
from megatron_dapo.mcore.parallel import all_gather_rows, check_packing, initialize_parallel
from megatron_dapo.mcore.micro_batches import batch_counts
from megatron_dapo.mcore.step_metrics import PendingMetrics, reduce_metrics
from megatron_dapo.mcore.step_settings import StepSettings, compute_device
from megatron_dapo.micro_batch_shapes import from_transformer_config
from megatron_dapo.mcore.train_step import compute_log_probs, train_step


class MegatronActor:
    def __init__(self, cfg: DAPOConfig, hf_config, *, initialize: bool = True, **model_overrides):
        """``initialize``: start torch.distributed / megatron's parallel state here (False when
        the caller already did, with the same cfg.parallel). ``model_overrides`` go to the
        TransformerConfig (build_model)."""
        if initialize:
            initialize_parallel(hf_config, parallel=cfg.parallel, model=cfg.model, seed=cfg.seed)
        self.cfg, self.hf_config = cfg, hf_config
        use_dist_opt = cfg.parallel.use_distributed_optimizer
        chunks = build_model(hf_config, model=cfg.model, parallel=cfg.parallel, moe=cfg.moe, **model_overrides)
        # auto resolved as run.prepare_run logged it (config_derived.derive_for_model), from the built config
        packed, _ = from_transformer_config(cfg.train.pack_sequences, chunks[0].config)
        # launch_checks.check_layout said it at launch; here for callers of the class itself
        if packed:
            check_packing(transformer_impl=chunks[0].config.transformer_impl)
        if cfg.moe.router_replay == "R3":
            install_replay(chunks)
        self.model = wrap_model(chunks, use_distributed_optimizer=use_dist_opt)
        self.optimizer = build_optimizer(self.model, cfg.optim, use_distributed_optimizer=use_dist_opt)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, updates_per_step=cfg.updates_per_step)
        self.settings = StepSettings.from_config(cfg, hf_arch(hf_config).vocab_size, packed=packed)
        self.offloader = (StateOffloader(self.model, self.optimizer, weights=cfg.actor.offload_weights)
                          if cfg.actor.offload_during_rollout else None)
        self._offloaded_metrics: dict[str, float] = {}  # of the last offload that moved anything

    # -- training -----------------------------------------------------------------------------
    def prepare_for_training(self) -> None:
        for chunk in self.model:
            chunk.train()

    def get_loss_and_metrics(self, batch: list[Sample], forward_only: bool = False, *,
                             mismatch: bool = False, defer_metrics: bool = False,
                             counts_table: torch.Tensor | None = None) -> dict[str, float] | PendingMetrics:
        """One optimizer update on the mini-batch (or, ``forward_only``, its loss and metrics
        without one). Every sample needs ``old_log_probs``. Returns metrics, equal on all ranks
        (train_step.train_step lists them), among them ``actor/grad_shortcut_fallbacks``: the
        micro-batches of this update whose output-layer gradients had to be recomputed because
        the loss's gradient hint did not hold (``actor/grad_shortcut_used``: those where it held).
        ``mismatch``: also the engine/trainer log-prob mismatch of the mini-batch in this update's
        forward (every sample then needs ``rollout_log_probs``). ``defer_metrics``: the metrics'
        exchange over DP is left to ``reduce_metrics``, which takes several updates' at once;
        ``counts_table``: the batch's entry of ``batch_counts`` (its token counts, gathered ahead)."""
        self._require_on_device("an update")
        missing = [i for i, x in enumerate(batch) if x.old_log_probs is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} have no old_log_probs; compute them with "
                             "get_inference_log_probs (or pass the rollout engine's)")
        no_rollout = [i for i, x in enumerate(batch) if mismatch and x.rollout_log_probs is None]
        if no_rollout:
            raise ValueError(f"samples {no_rollout[:8]} have no rollout_log_probs to measure the mismatch "
                             "against; fill them from Rollout.logprobs (collect.to_samples does)")
        return train_step(self.model, self.optimizer, self.scheduler, self._local(batch), self.settings,
                          forward_only=forward_only, mismatch=mismatch, defer_metrics=defer_metrics,
                          counts_table=counts_table)

    def batch_counts(self, batches: list[list[Sample]]) -> list[torch.Tensor]:
        """Each mini-batch's token counts over DP (train_step.batch_counts), from one exchange
        (collective: every rank passes its own shares of the same mini-batches)."""
        return batch_counts(self.model, [self._local(b) for b in batches], self.settings)

    def reduce_metrics(self, pending: list[PendingMetrics]) -> list[dict[str, float]]:
        """The metrics of updates made with ``defer_metrics``, in their order, from one exchange
        (collective: every rank passes its own pending list of the same updates)."""
        return reduce_metrics(pending)

    # -- offloading while the engine generates --------------------------------------------------
    def offload_for_rollout(self) -> dict[str, float]:
        """Before the engine generates (a step's rollouts, an evaluation, the engine's build): the
        gradients, the optimizer state (and, with actor.offload_weights, the weights) to host memory,
        until onload_after_rollout; {} (nothing moves) unless actor.offload_during_rollout. Returns
        {"actor/offloaded_gb": device GB (1e9 bytes) held off}, also when it was already off (an
        evaluation offloaded it). No method that reads the state may run until the onload. Idempotent."""
        if self.offloader is None:
            return {}
        stats = self.offloader.offload()
        if stats.num_storages:
            self._offloaded_metrics = stats.metrics()
        return dict(self._offloaded_metrics)

    def onload_after_rollout(self) -> None:
        """After generation (and after the engine slept), before old log-probs: everything back, bit for
        bit (gradients as zeros: each update zeroes them first anyway). Idempotent."""
        if self.offloader is not None:
            self.offloader.onload()

    def _require_on_device(self, what: str) -> None:
        """The state is released while offloaded: reading it would read freed storage."""
        if self.offloader is not None and self.offloader.offloaded:
            raise RuntimeError(f"{what} while the trainer's state is offloaded: call onload_after_rollout() "
                               "first")

    # -- inference ----------------------------------------------------------------------------
    def prepare_for_inference(self) -> None:
        for chunk in self.model:
            chunk.eval()

    def finish_inference(self) -> None:
        self.prepare_for_training()

    def get_inference_log_probs(self, batch: list[Sample]) -> list[torch.Tensor]:
        """Log-probs of every sample's response tokens ([R] fp32 each, CPU), at the rollout
        temperature, for the whole batch on every rank."""
        self._require_on_device("log-probs")
        from megatron.core import parallel_state as ps

        shards = split_for_data_parallel(batch, ps.get_data_parallel_world_size())
        mine = shards[ps.get_data_parallel_rank()]
        log_probs, _ = compute_log_probs(self.model, [batch[i] for i in mine], self.settings)
        # All-gather over DP: every rank knows every shard's lengths, so pad to the longest.
        sizes = [sum(batch[i].num_response_tokens for i in shard) for shard in shards]
        flat = torch.zeros(max(sizes), dtype=torch.float32, device=compute_device())
        flat[: sizes[ps.get_data_parallel_rank()]] = torch.cat(log_probs).to(flat.device) if mine else 0
        gathered = all_gather_rows(flat, ps.get_data_parallel_group())
        out: list[torch.Tensor | None] = [None] * len(batch)
        for shard, size, values in zip(shards, sizes, gathered):
            lengths = [batch[i].num_response_tokens for i in shard]
            for i, lp in zip(shard, torch.split(values[:size].cpu(), lengths)):
                out[i] = lp
        return out

    def _local(self, batch: list[Sample]) -> list[Sample]:
        from megatron.core import parallel_state as ps
        shards = split_for_data_parallel(batch, ps.get_data_parallel_world_size())
        return [batch[i] for i in shards[ps.get_data_parallel_rank()]]

    # -- weights and checkpoints ----------------------------------------------------------------
    def export_hf_weights(self, *, bucket_bytes: int | None = None,
                          dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight, on every rank; all ranks of the model-parallel
        group must consume the whole iterator (it runs collectives). A tensor that needs no
        gather (TP-replicated norms, everything at TP = PP = 1) may be the parameter itself:
        copy what must outlive the next update."""
        if self.cfg.actor.offload_weights:  # otherwise an offload leaves the weights where they are
            self._require_on_device("a weight export")
        from megatron.core import parallel_state as ps

        from megatron_dapo.convert.export import DEFAULT_BUCKET_BYTES, export_hf_weights

        tp, pp = self.cfg.parallel.tensor_model_parallel_size, self.cfg.parallel.pipeline_model_parallel_size
        return export_hf_weights(
            self.model, self._conversion_table(),
            tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
            ep_group=self._ep_group(), bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES, dtype=dtype)

    def _ep_group(self):
        from megatron.core import parallel_state as ps
        return ps.get_expert_model_parallel_group() if self.cfg.parallel.expert_model_parallel_size > 1 else None

    def _conversion_table(self):
        return conversion_table_for(self.hf_config, model=self.cfg.model,
                                    tp=self.cfg.parallel.tensor_model_parallel_size)

    def save_checkpoint(self, dir: str, trainer_state: dict) -> str:
        """Save under the checkpoint root ``dir`` as step ``trainer_state["step"]``; collective.
        ``trainer_state``: any JSON object with the step (the loop's is TrainerState.to_json())."""
        self._require_on_device("a checkpoint save")
        if not isinstance(trainer_state, dict) or not isinstance(trainer_state.get("step"), int):
            raise ValueError("trainer_state must hold the rollout step as an int under 'step'")
        path = checkpoint.save_checkpoint(dir, trainer_state["step"], model=self.model,
                                          optimizer=self.optimizer, scheduler=self.scheduler,
                                          trainer_state=trainer_state,
                                          keep_last=self.cfg.checkpoint.keep_last,
                                          memory_efficient=self.cfg.checkpoint.memory_efficient_save)
        return str(path)

    def write_checkpoint(self, dir: str, step: int, background: bool = False) -> checkpoint.PendingCheckpoint:
        """The heavy half of a save (collective): weights, optimizer and schedule into
        <dir>/step_N.tmp, while the engine sleeps; nothing is visible until publish_checkpoint.
        ``background``: a child process writes the files (checkpoint.async_save)."""
        self._require_on_device("a checkpoint write")
        return checkpoint.write_checkpoint(dir, step, model=self.model, optimizer=self.optimizer,
                                           scheduler=self.scheduler, background=background,
                                           memory_efficient=self.cfg.checkpoint.memory_efficient_save)

    def publish_checkpoint(self, pending: checkpoint.PendingCheckpoint, trainer_state: dict,
                           rng: dict | None = None) -> str:
        """The other half (collective), after the step is logged: RNG states (``rng``: this rank's as
        the step ended; None: as they are now), the trainer state, the rename into place, ``latest``,
        pruning. A write in the background is finished first."""
        if trainer_state.get("step") != pending.step:
            raise ValueError(f"trainer_state is for step {trainer_state.get('step')}, the written checkpoint "
                             f"for step {pending.step}")
        return str(checkpoint.publish_checkpoint(pending, trainer_state=trainer_state, rng=rng,
                                                 keep_last=self.cfg.checkpoint.keep_last))

    def load_checkpoint(self, dir: str) -> dict | None:
        """Resume from ``dir`` (a checkpoint, or a root: its latest); returns the trainer state,
        None when there is nothing to resume. A model-only dist checkpoint (converted from HF)
        loads the weights and returns {}."""
        state = checkpoint.load_checkpoint(dir, model=self.model, optimizer=self.optimizer,
                                           scheduler=self.scheduler)
        if state == {}:  # weights only: the optimizer's fp32 main copies (bf16 training) follow
            self.optimizer.reload_model_params()
        return state

    def load_hf_weights(self, hf_dir: str) -> int:
        """Starting weights straight from an HF safetensors dir: each rank reads only the tensors
        (and slices) of its own TP/PP shard, so no process ever holds the whole model and no
        conversion step runs first. No collective. Returns the number of parameters loaded."""
        from megatron.core import parallel_state as ps

        from megatron_dapo.convert import SafetensorsReader, load_hf_weights

        tp = self.cfg.parallel.tensor_model_parallel_size
        with SafetensorsReader(hf_dir) as reader:
            count = load_hf_weights(self.model, self._conversion_table(), reader,
                                    tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
                                    ep_group=self._ep_group())
        self.optimizer.reload_model_params()
        return count
