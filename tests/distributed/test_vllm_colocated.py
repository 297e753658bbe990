"""A colocated vLLM engine (vLLM's CPU build, external_launcher) and a Megatron actor at TP=2 in the
same 2 gloo processes, as training places them: the engine's log-probs equal the actor's after
every weight sync.

Per spawn (one per rollout layout: TP=2, and TP=1 x 2 replicas), for untied and tied embeddings:
build the actor from a DAPOConfig + HF config dict and the engine with VLLMEngine.from_spec on
a directory holding only config.json (dummy weights until the first sync); score fixed probe
tokens with those dummy weights; sync the actor's export into the engine in small buckets (fused
qkv / gate_up and tied embeddings go through vLLM's own load_weights): the engine's log-probs of
the probes now equal the actor's and differ from the dummy ones by far more than the tolerance
(so the first sync really replaced the weights); generate (the replicas take different numbers
of prompts); the engine's log-probs of its samples equal actor.get_inference_log_probs. Then one
DAPO update, sync again: the engine's log-probs of the same tokens (vLLM prompt log-probs) equal
the actor's new ones and differ from the old ones by far more than the tolerance, and fresh
samples agree too. Last, a stop's abort reaching one rank only ends the batch on both as it must.
Both sides compute in fp32; the largest difference measured is ~1e-6 (TOL = 1e-4), while
the update moves the log-probs by ~1.
"""

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.config import (
    DAPOConfig, DataConfig, OptimConfig, OverlongBufferConfig, ParallelConfig, RewardConfig, RolloutConfig,
    TrainConfig,
)
from tests.distributed.harness import spawn
from tests.helpers.policy import tiny_hf_config

pytestmark = [
    pytest.mark.distributed, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (./install.sh vllm installs its CPU build)"),
]
TOL = 1e-4
PROMPTS = [[5, 17, 42, 8], [7, 9, 11], [100, 101, 102, 103, 104, 105], [3, 4]]
N = 2
# Fixed token sequences (first token as prompt) scored before and after the first sync.
PROBES = [SimpleNamespace(prompt_ids=p[:1], response_ids=p[1:]) for p in PROMPTS]


def hf_config(tied: bool) -> dict:
    """Head_dim 32 (vLLM's CPU attention has no 16): 2 heads and 2 KV groups, both split by TP=2."""
    return tiny_hf_config(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)


def dapo_cfg(rollout_tp: int) -> DAPOConfig:
    return DAPOConfig(
        seed=3,
        parallel=ParallelConfig(tensor_model_parallel_size=2),
        data=DataConfig(max_prompt_length=8, prompts_per_step=4, gen_prompts_per_batch=4),
        rollout=RolloutConfig(n=N, temperature=1.0, max_response_length=16, tensor_parallel_size=rollout_tp,
                              kv_cache_memory_mb=16),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)),
        train=TrainConfig(mini_batch_prompts=4, max_tokens_per_micro_batch=64),
        # One large, unclipped, undecayed step: the log-probs must move far beyond TOL.
        optim=OptimConfig(lr=3e-2, lr_warmup_steps=0, weight_decay=0.0, clip_grad=0.0))


def all_rollouts(engine, params):
    """This replica's share of PROMPTS (one replica: all; two: [0, 2, 3] and [1], unequal on
    purpose), generated with global prompt indices, then every replica's rollouts gathered in
    prompt order on every rank. Returns (rollouts, this replica's prompt indices)."""
    import torch.distributed as dist

    shares = [[0, 1, 2, 3]] if engine.dp_size == 1 else [[0, 2, 3], [1]]
    mine = shares[engine.dp_rank]
    out = engine.generate([PROMPTS[i] for i in mine], N, params, prompt_indices=mine)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, out))
    by_index = {}
    for indices, groups in gathered:
        for i, group in zip(indices, groups):
            by_index.setdefault(i, group)
    return [r for i in sorted(by_index) for r in by_index[i]], mine


def samples_of(rollouts, advantages=None, old=None):
    from megatron_dapo.batching import Sample

    return [Sample(prompt_ids=torch.tensor(r.prompt_ids), response_ids=torch.tensor(r.response_ids),
                   advantages=0.0 if advantages is None else advantages[i],
                   old_log_probs=None if old is None else old[i])
            for i, r in enumerate(rollouts)]


def engine_scores(engine, rollouts):
    """The engine's log-probs of given tokens: vLLM prompt log-probs of prompt + response (T = 1)."""
    import vllm

    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": r.prompt_ids + r.response_ids} for r in rollouts],
                               [sp] * len(rollouts), use_tqdm=False)
    return [torch.tensor([out.prompt_logprobs[len(r.prompt_ids) + t][tok].logprob
                          for t, tok in enumerate(r.response_ids)])
            for r, out in zip(rollouts, outs)]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _worker(rank, config_dirs, rollout_tp):
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.parallel import destroy_parallel
    from megatron_dapo.rollout import SamplingParams, sync_weights
    from megatron_dapo.rollout.engine import EngineSpec
    from megatron_dapo.rollout.vllm_engine import VLLMEngine

    cfg = dapo_cfg(rollout_tp)
    bucket = 24 * 1024  # splits layers: q/k/v, weight/bias and gate/up land in different buckets
    for tied in (False, True):
        torch.manual_seed(11)
        actor = MegatronActor(cfg, hf_config(tied))
        engine = VLLMEngine.from_spec(EngineSpec.of(cfg, model_path=config_dirs[tied]))
        assert (engine.dp_rank, engine.dp_size) == ((0, 1) if rollout_tp == 2 else (rank, 2))
        assert torch.get_num_threads() == 1  # the harness's setting survives the engine build
        dummy = engine_scores(engine, PROBES)  # vLLM's dummy weights: what the first sync replaces
        stats = sync_weights(engine, actor.export_hf_weights(), bucket)
        assert stats["num_buckets"] > 4
        actor.prepare_for_inference()
        probe_ref = actor.get_inference_log_probs(samples_of(PROBES))
        assert max_diff(engine_scores(engine, PROBES), probe_ref) < TOL, f"tied={tied}: the first sync"
        assert max_diff(dummy, probe_ref) > 100 * TOL, f"tied={tied}: the engine was the actor before the sync"
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
        rollouts, mine = all_rollouts(engine, params)
        assert len(rollouts) == len(PROMPTS) * N
        assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in rollouts)

        actor.prepare_for_inference()
        old = actor.get_inference_log_probs(samples_of(rollouts))
        engine_old = [torch.tensor(r.logprobs) for r in rollouts]
        assert max_diff(engine_old, old) < TOL, f"tied={tied}: engine vs actor before the update"

        actor.prepare_for_training()
        g = torch.Generator().manual_seed(0)
        adv = [float(a) for a in torch.randn(len(rollouts), generator=g)]
        metrics = actor.get_loss_and_metrics(samples_of(rollouts, adv, old))
        assert metrics["actor/num_tokens"] > 0
        actor.prepare_for_inference()
        new = actor.get_inference_log_probs(samples_of(rollouts))
        assert max_diff(new, old) > 100 * TOL, "the update must move the log-probs far beyond TOL"

        sync_weights(engine, actor.export_hf_weights(), bucket)
        fresh, _ = all_rollouts(engine, params)  # closes the reload; fresh samples agree too
        fresh_actor = actor.get_inference_log_probs(samples_of(fresh))
        assert max_diff([torch.tensor(r.logprobs) for r in fresh], fresh_actor) < TOL
        share = [rollouts[i * N + k] for i in mine for k in range(N)]  # this replica's old samples
        scored = engine_scores(engine, share)
        new_share = [new[i * N + k] for i in mine for k in range(N)]
        old_share = [old[i * N + k] for i in mine for k in range(N)]
        assert max_diff(scored, new_share) < TOL, f"tied={tied}: engine vs actor after the update"
        assert max_diff(scored, old_share) > 100 * TOL
        if tied:
            _abort_reaching_rank_0_only(engine, rank)
        engine.shutdown()
        destroy_parallel(process_group=False)


def _abort_reaching_rank_0_only(engine, rank):
    """A separate-placement stop's abort, as if it reached rank 0 two engine steps into a batch of
    16-token responses (no EOS) and rank 1 not at all. At rollout TP=2 the replica's two ranks agree
    on it and both end the batch at the same step (were rank 0 to end it alone, rank 1's next
    forward would wait for it for ever). At TP=1 x 2 replicas rank 0 ends its requests and keeps
    stepping vLLM's dummy batches until rank 1, not aborted, has generated its share. After
    ``clear_abort`` the engine serves on (a cancelled batch, rollout/separate.py): the same batch
    again draws what it drew before the abort, token for token."""
    import torch.distributed as dist

    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout.engine import GenerationAborted

    core, steps = engine.llm.llm_engine, []
    real_step = core.step

    def step():
        steps.append(1)
        if rank == 0 and len(steps) == 2:
            engine.abort()  # the flag only; the loop ends the requests before its next step
        return real_step()

    engine.eos_token_ids = ()
    mine = [0, 1, 2, 3] if engine.dp_size == 1 else [[0, 2, 3], [1]][engine.dp_rank]

    def batch():
        out = engine.generate([PROMPTS[i] for i in mine], N, SamplingParams(max_tokens=16, seed=5),
                              prompt_indices=mine)
        return [[r.response_ids for r in group] for group in out]

    before = batch()
    core.step = step
    try:
        batch()
        outcome = "generated"
    except GenerationAborted:
        outcome = "aborted"
    del core.step
    engine.clear_abort()
    assert batch() == before  # the cancelled batch's requests are gone; the seeds draw as before
    seen = [None, None]
    dist.all_gather_object(seen, (outcome, len(steps)))
    if engine.dp_size == 1:
        assert seen == [("aborted", 2), ("aborted", 2)], seen
    else:
        assert [o for o, _ in seen] == ["aborted", "generated"] and seen[0][1] == seen[1][1] >= 16, seen


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """{tied: a directory with config.json only}: colocated engines start from dummy weights."""
    dirs = {}
    for tied in (False, True):
        path = tmp_path_factory.mktemp("tied" if tied else "untied")
        config = {**hf_config(tied), "architectures": ["Qwen2ForCausalLM"]}
        (path / "config.json").write_text(json.dumps(config))
        dirs[tied] = str(path)
    return dirs


@pytest.mark.parametrize("rollout_tp", [2, 1], ids=["rollout_tp2", "rollout_tp1x2_replicas"])
def test_engine_logprobs_follow_the_actor(config_dirs, rollout_tp):
    spawn(_worker, config_dirs, rollout_tp)
