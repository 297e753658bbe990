"""Checkpoint save and restore through NeMo's own path, then one more step.

    .venv-nemo/bin/torchrun --nproc_per_node N tests/nemo_aligner/probe_ckpt.py OUT.json MODE LOG_DIR

MODE ``straight``: fit() for 2 steps, no checkpoint. ``first``: fit() for 1 step, saving at its
end (ReinforceTrainer.save -> NeMo-Aligner's custom_save on NeMo's NeMoModelCheckpoint, from
exp_manager, into LOG_DIR). ``resume``: a new process, exp_manager(resume_if_exists) finds that
checkpoint, retrieve_custom_trainer_state_dict + init_using_ptl restore the loop's counters, the
weights and the optimizer, and fit() runs the second step. NeMo's checkpoint holds no sampling RNG
state, so each step's generation is seeded from its step number (not greedy: identical responses
with opposite advantages cancel to a zero gradient); ``resume`` must end where ``straight`` does.
Rank 0 writes every parameter, the counters and the trained prompts to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.nemo_aligner import loop, tiny  # noqa: E402

STEPS = {"straight": 2, "first": 1, "resume": 2}


def main(out: str, mode: str, log_dir: str) -> None:
    tiny.setup()
    torch.manual_seed(0)
    model = tiny.model_config(tiny.save_tokenizer(Path(log_dir).parent / "tok"), mbs=1, gbs=6)
    model["ppo"]["rollout_micro_batch_size"] = 2
    saving = mode != "straight"
    section = loop.fit_section(3, STEPS[mode], model_gbs=6, model_mbs=1, save_interval=1 if saving else 0)
    exp = {"explicit_log_dir": log_dir, "exp_dir": None, "name": "dapo_tiny",
           "create_tensorboard_logger": False, "create_wandb_logger": False, "resume_if_exists": True,
           "resume_ignore_no_checkpoint": True,
           "create_checkpoint_callback": saving,
           "checkpoint_callback_params": {"monitor": "step", "save_top_k": 1, "mode": "max",
                                          "always_save_nemo": False, "save_nemo_on_train_end": False,
                                          # resume reads these four counters from the name
                                          "filename": "dapo-{step}-{consumed_samples}-"
                                                      "{reinforce_optimization_step}-{epoch}",
                                          "save_last": True}}
    ptl_trainer, actor, cfg = tiny.build(model, extra_trainer=section, exp_manager=exp if saving else None)
    trainer, _ = loop.build_trainer(ptl_trainer, actor, cfg, num_prompts=48, prompts_per_gen_batch=4)
    resumed_from = {"step": trainer.step, "consumed_samples": trainer.consumed_samples,
                    "optimizer_steps": trainer.reinforce_optimization_step,
                    "ckpt_path": str(ptl_trainer.ckpt_path) if ptl_trainer.ckpt_path else None}
    trained = []
    generate = trainer.generate_rollouts

    def recording_generate():
        torch.manual_seed(1000 + trainer.step)  # NeMo keeps no sampling RNG state in its checkpoint
        data, metrics, timers = generate()
        trained.append(sorted(set(loop.prompt_ids(data["response_tokens"]))))
        return data, metrics, timers

    trainer.generate_rollouts = recording_generate
    trainer.fit()
    state = {k: v.detach().tolist() for k, v in actor.model.state_dict().items() if torch.is_tensor(v)}
    adam = [{k: v.tolist() for k, v in s.items() if torch.is_tensor(v)}
            for s in trainer.optimizer.state_dict()["state"].values()]
    result = {"mode": mode, "resumed_from": resumed_from, "trained": trained, "step": trainer.step,
              "consumed_samples": trainer.consumed_samples,
              "optimizer_steps": trainer.reinforce_optimization_step, "weights": state, "adam": adam,
              "files": sorted(str(p.relative_to(log_dir)) for p in Path(log_dir).rglob("*") if p.is_file())
              if Path(log_dir).exists() else []}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
