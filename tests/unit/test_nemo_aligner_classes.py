"""The NeMo-Aligner adapter's two classes, built on stand-ins that follow the interface recorded from
nemo-aligner 0.7.0's source (NeMo cannot run here), driven through one training call and one
rollout step. The interface itself is checked in test_nemo_aligner_upstream.py."""

import contextlib
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dapo.algo import compute_policy_loss
from megatron_dapo.config import LossConfig
from megatron_dapo.integrations import nemo_aligner as na
from megatron_dapo.integrations import nemo_aligner_classes as nac
from tests.helpers.nemo_aligner_batches import EOS, MIXED, groups_and_data, rollout_batch, settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "megatron_dapo/integrations/nemo_aligner_dapo.yaml"
VENDORED = ROOT / ".venv/upstream" / f"nemo-aligner-{na.NEMO_ALIGNER_VERSION}"
LOSS = LossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


# -- the two classes on stand-ins that follow the recorded interface ------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self, vocab=50, hidden=8):
        super().__init__()
        self.embed, self.out = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        return self.out(torch.tanh(self.embed(tokens)))


def stand_in_actor_module(num_micro_batches):
    """megatron_gpt_ppo_actor's names with single-process behaviour: megatron-core's schedule (each
    micro-batch loss / M, backward per micro-batch), NeMo-Aligner's shifted log-prob convention."""
    up = types.ModuleType("stand_in_ppo_actor")

    class MegatronGPTActorModel:
        def __init__(self, cfg, trainer):
            self.cfg, self.model = cfg, TinyLM()

        def get_ltor_masks_and_position_ids(self, tokens):
            b, s = tokens.shape
            return torch.ones(b, 1, s, s, dtype=torch.bool), None, torch.arange(s).expand(b, s)

        def _make_data_iterator_list(self, it):
            return it

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, forward_only, seq_length,
                 micro_batch_size):
        reduced = []
        for _ in range(num_microbatches):
            output, loss_func = forward_step_func(data_iterator, model)
            loss, metrics = loss_func(output)
            if not forward_only:
                (loss / num_microbatches).backward()
            reduced.append(metrics)
        return reduced

    def logprobs(vocab_parallel_logits, target, inference_only=False, higher_stability=False, ignore_last=True):
        lp = torch.log_softmax(vocab_parallel_logits.float(), -1).gather(-1, target.roll(-1, -1)[..., None])[..., 0]
        return lp[:, :-1]

    up.MegatronGPTActorModel = MegatronGPTActorModel
    up.get_forward_backward_func = lambda: schedule
    up.get_num_microbatches = lambda: num_micro_batches
    up.get_iterator_k_split = lambda batch, k: iter([{n: v.tensor_split(k)[i] for n, v in batch.items()}
                                                     for i in range(k)])
    up.get_last_rank = lambda: 0
    up.set_sync_funcs = lambda model, forward_only: None
    up.from_parallel_logits_to_logprobs = logprobs
    up.parallel_state = types.SimpleNamespace(
        get_pipeline_model_parallel_world_size=lambda: 1, is_pipeline_first_stage=lambda: True,
        is_pipeline_last_stage=lambda: True, get_data_parallel_group=lambda: None,
        get_data_parallel_world_size=lambda: 1, get_data_parallel_rank=lambda: 0)
    return up


@pytest.fixture
def one_process_group(monkeypatch):
    """A 1-rank gloo group and CPU stand-ins for the two CUDA calls the actor makes."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    yield
    if created:
        dist.destroy_process_group()


def test_dapo_actor_class_trains_with_the_global_token_mean(one_process_group):
    """get_loss_and_metrics with 1 and 4 micro-batches: the same loss, metrics and gradients, equal
    to our loss on the whole batch computed directly."""
    batch = rollout_batch(**MIXED)
    data = {k: v.float() if v.is_floating_point() else v for k, v in groups_and_data(batch, settings())[1].items()}
    cfg = types.SimpleNamespace(ppo={"entropy_bonus": 0.0, "loss": {"clip_ratio_c": 3.0}}, micro_batch_size=2)
    results = []
    for m in (1, 4):
        torch.manual_seed(0)
        actor = nac._build_actor_class(stand_in_actor_module(m))(cfg, trainer=None)
        loss, metrics = actor.get_loss_and_metrics(batch=dict(data), forward_only=False)
        results.append((loss, metrics, [p.grad.clone() for p in actor.model.parameters()]))
        with pytest.raises(RuntimeError, match="initial_policy_kl_penalty"):
            actor.get_init_policy_logprobs(data["response_tokens"])
    (loss1, metrics1, grads1), (loss4, metrics4, grads4) = results
    assert loss1 == pytest.approx(loss4, rel=1e-6) and metrics1.keys() == metrics4.keys()
    assert all(metrics1[k] == pytest.approx(metrics4[k], rel=1e-5, abs=1e-7) for k in metrics1)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads1, grads4))
    torch.manual_seed(0)
    model = TinyLM()
    curr = stand_in_actor_module(1).from_parallel_logits_to_logprobs(model(data["response_tokens"], None, None),
                                                                      data["response_tokens"])
    direct, _ = compute_policy_loss(curr, data["prev_logprobs"], data["advantages"], data["mask"],
                                    clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    direct.backward()
    assert loss1 == pytest.approx(direct.item(), rel=1e-6)
    assert all(torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7) for a, p in zip(grads1, model.parameters()))


class AttrDict(dict):
    __getattr__ = dict.__getitem__


def stand_in_reinforce_module(generation_batches, dp_rank, dp_size):
    up = types.ModuleType("stand_in_reinforce")
    calls = []

    class ReinforceTrainer:
        def __init__(self, cfg, model, optimizer, scheduler, train_dataloader_builder, val_dataloader_builder,
                     collate_fn, rm, batch_iterator_cls, logger, ckpt_callback, run_timer):
            self.cfg, self.model, self.consumed_samples = cfg, model, 0
            self.train_dataloader_builder = train_dataloader_builder
            self.timer = lambda name: contextlib.nullcontext()  # ScopedTimer's use: a context per phase
            self.timer.consume_durations = lambda: {}

        def _run_inference(self, dataloader_builder, consumed_samples, is_validation):
            calls.append(("generate", consumed_samples))
            batch = next(generation_batches)
            return dict(batch, prompt_tokens=batch["response_tokens"][:, :2]), {"rollout_size": len(batch["rewards"])}

    up.ReinforceTrainer = ReinforceTrainer
    up.parallel_state = types.SimpleNamespace(get_data_parallel_rank=lambda: dp_rank,
                                              get_data_parallel_world_size=lambda: dp_size)
    return up, calls


def test_dapo_trainer_class_runs_a_rollout_step_with_dynamic_sampling():
    """Two generation batches of 4 prompt groups; 3 mixed groups are found, the first 2 are kept;
    DP rank 1 of 2 trains on the second."""
    right, wrong, mixed = [1, 1, 1, 1], [-1, -1, -1, -1], [1, -1, -1, 1]
    def second():
        return rollout_batch(prompt_lens=[2] * 16, gen_lens=[4, 3, 2, 1] * 4, group_size=4, seed=2, width=9,
                             rewards=mixed + [1, 1, -1, 1] + right + wrong)

    batches = iter([rollout_batch(prompt_lens=[2] * 16, gen_lens=[1, 2, 3, 4] * 4, group_size=4, seed=1,
                                  rewards=right + mixed + wrong + wrong), second()])
    expected = second()
    up, calls = stand_in_reinforce_module(batches, dp_rank=1, dp_size=2)
    model = types.SimpleNamespace(
        cfg=types.SimpleNamespace(ppo=types.SimpleNamespace(length_params=types.SimpleNamespace(max_length=8))),
        tokenizer=types.SimpleNamespace(eos_id=EOS),
        prepare_for_inference=lambda: calls.append("prepare"), finish_inference=lambda: calls.append("finish"))
    cfg = AttrDict(initial_policy_kl_penalty=0, num_rollouts_per_prompt=4, prompts_per_step=2, model_gbs=4,
                   reward={"overlong_buffer": {"len": 4}})
    trainer = nac._build_trainer_class(up)(cfg=cfg, model=model, optimizer=None, scheduler=None,
                                          train_dataloader_builder=None, val_dataloader_builder=None, collate_fn=None,
                                          rm=None, batch_iterator_cls=None, logger=None, ckpt_callback=None,
                                          run_timer=None)
    data, metrics, _ = trainer.generate_rollouts()
    # consumed_samples counts prompts (4 per batch of 16 rows), as the prompt sampler does
    assert calls == ["prepare", ("generate", 0), ("generate", 4), "finish"]
    assert metrics["dynamic_sampling/num_gen_batches"] == 2 and metrics["consumed_samples"] == 8
    assert torch.equal(data["response_tokens"], expected["response_tokens"][:4])  # the 2nd batch's first group
    assert torch.equal(data["prev_logprobs"], expected["logprobs"][:4])
    r = np.array(mixed, dtype=np.float64)
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    got = [data["advantages"][i][data["mask"][i] > 0] for i in range(4)]
    assert all(torch.allclose(g, torch.full_like(g, a), atol=1e-6) for g, a in zip(got, want))
