"""The DAPOTrainer assembled as NeMo-Aligner's train_gpt_reinforce_actor.py assembles its trainer, with
a prompt dataset and a reward server that make dynamic sampling's outcome a hand-worked fact, and the
sequential prompt sampler (upstream trains with the random one) so that the draw order is one too.

Prompt i is [FIRST + i, 5, 6, 7] (its first token names it). The reward stand-in answers like
NeMo-Aligner's RemoteGPTRMClient (``infer_rm(batch).result()`` -> [b, 1]) from the prompt id and the
rollout round r (ReinforceTrainer calls it once per round, rounds 0..G-1 in order, per micro-batch):
i % 3 == 0: +1 always (all correct), i % 3 == 1: -1 always (all wrong), i % 3 == 2: +1 on even rounds
(mixed). So generation does not decide which groups dynamic sampling keeps.
"""

from __future__ import annotations

from functools import partial

import torch

from tests.nemo_aligner import tiny

FIRST = 10  # token id of prompt 0's first token


class PromptDataset(torch.utils.data.Dataset):
    """Items in RLHFDataset's shape (text, length, loss_multiplier)."""

    def __init__(self, n: int):
        self.prompts = [torch.tensor([FIRST + i, 5, 6, 7]) for i in range(n)]

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, idx):
        return {"text": self.prompts[idx], "length": len(self.prompts[idx]), "loss_multiplier": True}


def prompt_ids(response_tokens: torch.Tensor) -> list[int]:
    return [int(t) - FIRST for t in response_tokens[:, 0]]


def expected_reward(prompt_id: int, round_: int) -> float:
    kind = prompt_id % 3
    return 1.0 if kind == 0 or (kind == 2 and round_ % 2 == 0) else -1.0


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class RewardServer:
    """Counts calls to know the round."""

    def __init__(self, group_size: int):
        self.group_size, self.calls = group_size, 0

    def infer_rm(self, rollout_batch):
        round_ = self.calls % self.group_size
        self.calls += 1
        ids = prompt_ids(rollout_batch["response_tokens"])
        return _Done(torch.tensor([expected_reward(i, round_) for i in ids]).unsqueeze(-1))


def build_trainer(ptl_trainer, actor, cfg, *, num_prompts: int, prompts_per_gen_batch: int, rm=None):
    """DAPOTrainer(cfg.trainer.dapo, ...) with NeMo-Aligner's own dataloader builder, collate function,
    batch iterator, optimizer/scheduler extraction, checkpoint callback and timer."""
    from nemo_aligner.data.nlp.builders import build_dataloader, collate_with_pad_to_max_batch
    from nemo_aligner.utils.batch_iterators import get_batch_iterator_cls
    from nemo_aligner.utils.distributed import Timer
    from nemo_aligner.utils.train_script_utils import (CustomLoggerWrapper, add_custom_checkpoint_callback,
                                                        extract_optimizer_scheduler_from_ptl_model,
                                                        init_using_ptl, retrieve_custom_trainer_state_dict)
    from megatron.core import parallel_state as ps

    from megatron_dapo.integrations.nemo_aligner_classes import dapo_trainer_class

    # A checkpoint found by exp_manager: the loop's counters come from it (before init_using_ptl
    # restores the weights and the optimizer from the same path).
    resumed = retrieve_custom_trainer_state_dict(ptl_trainer) if ptl_trainer.ckpt_path else None
    dataset = PromptDataset(num_prompts)
    collate = collate_with_pad_to_max_batch(cfg.model.ppo.length_params.max_length, actor.tokenizer.eos_id,
                                            cfg, generate_masks_and_position_ids=False)
    builder = partial(build_dataloader, cfg=cfg, dataset=dataset, mbs=cfg.model.ppo.rollout_micro_batch_size,
                      gbs=prompts_per_gen_batch, collate_fn=collate, load_gbs=False, use_random_sampler=False)
    dummy = torch.utils.data.DataLoader(dataset, batch_size=cfg.model.global_batch_size
                                        // ps.get_data_parallel_world_size())
    init_using_ptl(ptl_trainer, actor, dummy, dataset)
    del actor._train_dl  # as the train script: the dummy loader only sized NeMo's step count
    optimizer, scheduler = extract_optimizer_scheduler_from_ptl_model(actor)
    rm = rm or RewardServer(tiny.GROUP)
    trainer = dapo_trainer_class()(
        cfg=cfg.trainer.dapo, model=actor, optimizer=optimizer, scheduler=scheduler,
        train_dataloader_builder=builder, val_dataloader_builder=builder, collate_fn=collate, rm=rm,
        batch_iterator_cls=get_batch_iterator_cls(cfg.trainer.dapo.get("batch_iterator", {})),
        logger=CustomLoggerWrapper(ptl_trainer.loggers), ckpt_callback=add_custom_checkpoint_callback(
            ptl_trainer, actor), run_timer=Timer(None))
    if resumed is not None:
        trainer.load_state_dict(resumed)
    return trainer, rm


def fit_section(prompts: int, max_steps: int, **over) -> dict:
    """trainer.dapo for fit(): ReinforceTrainer's loop keys and the adapter's."""
    return tiny.dapo_section(prompts) | {
        "max_epochs": 1, "max_steps": max_steps, "val_check_interval": 0, "save_interval": 0,
        "gradient_clip_val": 1.0, "use_absolute_kl": True, "rollout_batch_seq_length": None,
        "trt_llm": {"enable": False}, "batch_iterator": {"use_flask": False}} | over
