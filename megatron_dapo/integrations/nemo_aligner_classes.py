"""NeMo-Aligner's classes with DAPO inside (nemo-aligner 0.7.0): ``DAPOActor(MegatronGPTActorModel)``
and ``DAPOTrainer(ReinforceTrainer)``, built on first use from the installed upstream (importing this
module imports no NeMo), and the upstream functions they override, extend or call, which the tests
check against the installed source. The pure parts they are made of: nemo_aligner.py; what each
override changes and why: its module docstring and docs/nemo_aligner.md."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from megatron_dapo.algo import DynamicSampler
from megatron_dapo.integrations.nemo_aligner import (
    INSTALL_HINT,
    LOSS_METRIC_KEYS,
    ROLLOUT_KEYS,
    LossCounts,
    batch_keys_for_stage,
    concat_rollout_batches,
    correctness,
    dapo_micro_batch_loss,
    dapo_rollout_data,
    data_parallel_share,
    group_rows,
    local_loss_counts,
    loss_settings,
    reduce_micro_batch_metrics,
    select_rows,
    trainer_settings,
)


@dataclass(frozen=True)
class UpstreamDef:
    """One function of NeMo-Aligner v0.7.0 this adapter relies on; tests parse the installed source."""
    path: str               # inside the nemo-aligner wheel (= the repository at tag v0.7.0)
    owner: str | None       # class name, None for a module-level function
    name: str
    params: tuple[str, ...]  # as written in the def, defaults included
    line: int               # line of the def at v0.7.0
    use: str                # overridden / extended / called / inherited / reference


_ACTOR = "nemo_aligner/models/nlp/gpt/megatron_gpt_ppo_actor.py"
_REINFORCE = "nemo_aligner/algorithms/reinforce.py"
UPSTREAM_INTERFACE: tuple[UpstreamDef, ...] = (
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "__init__", ("self", "cfg", "trainer"), 65, "extended"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "get_actor_forward_output_and_loss_func", ("self",), 104,
                "overridden"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "prepare_for_training", ("self",), 181, "inherited"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "get_loss_and_metrics", ("self", "batch", "forward_only"),
                193, "overridden"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "finish_training", ("self",), 233, "inherited"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "get_inference_log_probs",
                ("self", "response_tokens", "forward_micro_batch_size=None"), 260, "inherited"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "prepare_for_inference", ("self",), 291, "inherited"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "infer", ("self", "inference_batch"), 305, "inherited"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "get_init_policy_logprobs", ("self", "response_tokens"), 363,
                "overridden"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "finish_inference", ("self",), 375, "inherited"),
    UpstreamDef(_ACTOR, "MegatronGPTActorModel", "get_ltor_masks_and_position_ids", ("self", "tokens"), 406,
                "called"),
    UpstreamDef(_REINFORCE, "ReinforceRolloutBatch", "chunk", ("self", "rank", "split_size", "seed"), 102,
                "reference"),
    UpstreamDef(_REINFORCE, "ReinforceTrainer", "__init__",
                ("self", "cfg", "model", "optimizer", "scheduler", "train_dataloader_builder",
                 "val_dataloader_builder", "collate_fn", "rm", "batch_iterator_cls", "logger",
                 "ckpt_callback", "run_timer"), 130, "extended"),
    UpstreamDef(_REINFORCE, "ReinforceTrainer", "_run_inference",
                ("self", "dataloader_builder", "consumed_samples", "is_validation"), 248, "called"),
    UpstreamDef(_REINFORCE, "ReinforceTrainer", "generate_rollouts", ("self",), 381, "overridden"),
    UpstreamDef("nemo_aligner/utils/ppo_utils.py", None, "create_mask",
                ("values", "prompt_lengths", "response_lengths"), 85, "reference"),
    UpstreamDef("nemo_aligner/utils/distributed.py", None, "from_parallel_logits_to_logprobs",
                ("vocab_parallel_logits", "target", "inference_only=False", "higher_stability=False",
                 "ignore_last=True"), 354, "called"),
)
# Names the actor takes from megatron_gpt_ppo_actor's module namespace (its imports, lines 20-61).
UPSTREAM_ACTOR_NAMES = ("MegatronGPTActorModel", "get_forward_backward_func", "get_num_microbatches",
                        "get_iterator_k_split", "get_last_rank", "set_sync_funcs",
                        "from_parallel_logits_to_logprobs", "parallel_state")

# -- NeMo-Aligner classes, built on first use --------------------------------------------------------

def _import_upstream(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the NeMo-Aligner adapter needs {module}, which did not import ({e}); "
                          f"{INSTALL_HINT}") from e


_CLASSES: dict[str, type] = {}


def dapo_actor_class() -> type:
    """``DAPOActor(MegatronGPTActorModel)``; built once, on the first call (ImportError naming
    nemo-aligner when it or its stack is missing)."""
    if "actor" not in _CLASSES:
        up = _import_upstream("nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor")
        _CLASSES["actor"] = _build_actor_class(up)
    return _CLASSES["actor"]


def dapo_trainer_class() -> type:
    """``DAPOTrainer(ReinforceTrainer)``: no critic, dynamic sampling, group advantages."""
    if "trainer" not in _CLASSES:
        _CLASSES["trainer"] = _build_trainer_class(_import_upstream("nemo_aligner.algorithms.reinforce"))
    return _CLASSES["trainer"]


def _build_actor_class(up) -> type:
    ps = up.parallel_state

    class DAPOActor(up.MegatronGPTActorModel):
        """The PPO actor with the DAPO loss and global token-mean; generation, log-probs, weight
        offload and TRT-LLM refit are inherited unchanged."""

        def __init__(self, cfg, trainer):
            if (cp := int(getattr(cfg, "context_parallel_size", 1) or 1)) > 1:  # its batches are not split over CP
                raise ValueError(f"model.context_parallel_size={cp}: the NeMo-Aligner adapter's loss runs without "
                                 "context parallelism; set it to 1 (megatron-dapo's own trainer has CP)")
            super().__init__(cfg, trainer=trainer)
            self.dapo_loss = loss_settings(self.cfg.ppo)
            self._dapo_counts: LossCounts | None = None

        def get_init_policy_logprobs(self, response_tokens):
            raise RuntimeError("DAPO has no KL to the initial policy: set "
                               "trainer.dapo.initial_policy_kl_penalty: 0")

        def get_actor_forward_output_and_loss_func(self):
            def fwd_output_and_loss_func(data_iterator, model):
                batch = next(data_iterator)
                keys = batch_keys_for_stage(ps.get_pipeline_model_parallel_world_size(),
                                            ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
                batch = {k: v.cuda(non_blocking=True) if keys is None or k in keys else None
                         for k, v in batch.items()}
                parallel_logits = model(batch["response_tokens"], batch["position_ids"],
                                        batch["attention_mask"], labels=None)

                def loss_func(parallel_logits):
                    curr = up.from_parallel_logits_to_logprobs(
                        vocab_parallel_logits=parallel_logits, target=batch["response_tokens"],
                        higher_stability=True)
                    return dapo_micro_batch_loss(curr, batch, self.dapo_loss, self._dapo_counts)

                return parallel_logits, loss_func

            return fwd_output_and_loss_func

        def get_loss_and_metrics(self, batch, forward_only):
            device = torch.cuda.current_device()
            dp_group, num_micro_batches = ps.get_data_parallel_group(), up.get_num_microbatches()
            counts = local_loss_counts(batch["mask"]).to(device)
            torch.distributed.all_reduce(counts, group=dp_group)
            scale = float(num_micro_batches * ps.get_data_parallel_world_size())
            self._dapo_counts = LossCounts(counts[0], counts[1], scale)

            tokens = batch["response_tokens"]
            attention_mask, _, position_ids = self.get_ltor_masks_and_position_ids(tokens=tokens)
            batch = dict(batch, attention_mask=attention_mask, position_ids=position_ids)
            up.set_sync_funcs(self, forward_only)
            micro_batches = self._make_data_iterator_list(up.get_iterator_k_split(batch, num_micro_batches))
            per_micro_batch = up.get_forward_backward_func()(
                forward_step_func=self.get_actor_forward_output_and_loss_func(),
                data_iterator=micro_batches,
                model=self.model, num_microbatches=num_micro_batches, forward_only=forward_only,
                seq_length=tokens.size(1), micro_batch_size=self.cfg.micro_batch_size)

            values = reduce_micro_batch_metrics(per_micro_batch, device)
            is_max = torch.tensor([k.endswith("_max") for k in LOSS_METRIC_KEYS], device=device)
            sums, maxes = values.masked_fill(is_max, 0.0), values.masked_fill(~is_max, 0.0)
            torch.distributed.all_reduce(sums, group=dp_group)
            torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=dp_group)
            values = torch.where(is_max, maxes, sums)
            torch.distributed.broadcast(values, up.get_last_rank())  # only the last stage computed them
            metrics = dict(zip(LOSS_METRIC_KEYS, values.cpu().tolist()))
            metrics["loss"] = metrics["actor/pg_loss"]
            return metrics["loss"], metrics

    return DAPOActor


def _build_trainer_class(up) -> type:
    ps = up.parallel_state

    class DAPOTrainer(up.ReinforceTrainer):
        """ReinforceTrainer with DAPO's rollout step; ``cfg`` is ``trainer.dapo``, ``rm`` the reward
        server client (``infer_rm``). Validation, training loop and checkpoints are inherited."""

        def __init__(self, cfg, model, *args, **kwargs):
            super().__init__(cfg, model, *args, **kwargs)
            self.dapo = trainer_settings(cfg, max_response_length=model.cfg.ppo.length_params.max_length,
                                         model_gbs=cfg.model_gbs)
            fg = self.dapo.algorithm.filter_groups
            self.dapo_sampler = DynamicSampler(
                prompts_per_step=self.dapo.prompts_per_step, group_size=self.dapo.group_size,
                max_num_gen_batches=fg.max_num_gen_batches, enabled=fg.enable, on_exhausted=fg.on_exhausted)

        @torch.no_grad()
        def generate_rollouts(self):
            with self.timer("prepare_for_inference"):
                self.model.prepare_for_inference()
            self.dapo_sampler.start_step()
            durations: dict[str, float] = {}
            while not self.dapo_sampler.is_full:
                rollout_batch, rollout_metrics = self._run_inference(self.train_dataloader_builder,
                                                                     consumed_samples=self.consumed_samples,
                                                                     is_validation=False)
                # The timer holds one measurement per name: consume each round's (summed per step).
                for name, seconds in self.timer.consume_durations().items():
                    durations[name] = durations.get(name, 0.0) + seconds
                # rollout_size counts responses (prompts x G); the prompt sampler counts prompts.
                # Upstream adds responses (reinforce:390), which skips G - 1 prompts of every G.
                self.consumed_samples += rollout_metrics["rollout_size"] // self.dapo.group_size
                batch = {k: rollout_batch[k] for k in ROLLOUT_KEYS}
                groups = group_rows(batch["response_tokens"], batch["prompt_lengths"], self.dapo.group_size)
                acc = correctness(batch["rewards"]).cpu()[groups]
                self.dapo_sampler.add([select_rows(batch, g) for g in groups], acc)
            kept, sampling_metrics = self.dapo_sampler.pop()
            batch = concat_rollout_batches(kept, self.model.tokenizer.eos_id)
            groups = torch.arange(len(kept) * self.dapo.group_size).reshape(len(kept), self.dapo.group_size)
            data, data_metrics = dapo_rollout_data(batch, groups, self.dapo)
            data = data_parallel_share(data, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
            with self.timer("finish_inference"):
                self.model.finish_inference()
            metrics = rollout_metrics | data_metrics | sampling_metrics
            metrics |= {"consumed_samples": self.consumed_samples}
            return data, metrics, durations | self.timer.consume_durations()

    return DAPOTrainer
