"""DAPOTrainer.fit() through the real ReinforceTrainer: dynamic sampling over whole steps.

    .venv-nemo/bin/torchrun --nproc_per_node N tests/nemo_aligner/probe_fit.py OUT.json

Two steps of 3 mixed groups (G = 4) from generation batches of 4 prompts (loop.py's prompts and
reward). Records, per step, the prompts each generation batch drew (on rank 0: the batch is global),
the prompts that trained and on which DP rank, the sampler's counts, consumed_samples, and whether
the weights moved. Rank 0 writes OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.nemo_aligner import loop, tiny  # noqa: E402

PROMPTS_PER_STEP, GEN_BATCH, STEPS, GBS = 3, 4, 2, 6


def main(out: str) -> None:
    tiny.setup()
    from megatron.core import parallel_state as ps

    model = tiny.model_config(tiny.save_tokenizer(Path(out).parent / "tok"), mbs=1, gbs=GBS)
    model["ppo"]["rollout_micro_batch_size"] = 2
    section = loop.fit_section(PROMPTS_PER_STEP, STEPS, model_gbs=GBS, model_mbs=1)
    ptl_trainer, actor, cfg = tiny.build(model, extra_trainer=section)
    trainer, rm = loop.build_trainer(ptl_trainer, actor, cfg, num_prompts=48, prompts_per_gen_batch=GEN_BATCH)

    steps, drawn = [], []
    run_inference, generate = trainer._run_inference, trainer.generate_rollouts

    def recording_inference(*args, **kwargs):
        batch, metrics = run_inference(*args, **kwargs)
        drawn.append(sorted(set(loop.prompt_ids(batch["response_tokens"]))))
        return batch, metrics

    def recording_generate():
        drawn.clear()
        data, metrics, timers = generate()
        mine = loop.prompt_ids(data["response_tokens"])
        per_rank = [None] * ps.get_data_parallel_world_size()
        torch.distributed.all_gather_object(per_rank, mine, group=ps.get_data_parallel_group())
        steps.append({"drawn": [list(d) for d in drawn], "trained_per_rank": per_rank,
                      "consumed_samples": metrics["consumed_samples"],
                      "sampling": {k.split("/")[1]: v for k, v in metrics.items()
                                   if k.startswith("dynamic_sampling/num_")},
                      "advantage_rows": data["advantages"].abs().sum(-1).gt(0).sum().item(),
                      "timers": sorted(timers)})
        return data, metrics, timers

    trainer._run_inference, trainer.generate_rollouts = recording_inference, recording_generate
    start = [p.detach().clone() for p in actor.parameters()]
    trainer.fit()
    result = {"dp": ps.get_data_parallel_world_size(), "steps": steps, "trainer_step": trainer.step,
              "optimizer_steps": trainer.reinforce_optimization_step,
              "weights_moved": any(not torch.equal(a, b) for a, b in zip(actor.parameters(), start)),
              "reward_calls_rank0": rm.calls}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
