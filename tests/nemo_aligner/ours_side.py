"""Our side of the same-model comparison: tiny.SHAPE's model in OUR MegatronActor, one DAPO update's
loss and gradients on a fixed batch, written for probe_same_model.py to replay in NeMo-Aligner.

    .venv/bin/python tests/nemo_aligner/ours_side.py OUT.pt

Runs in ``.venv`` (megatron-core 0.19.2), one process, gloo. The model is tiny.SHAPE's Qwen2 block
(hidden 32, 2 layers, ffn 64, 4 heads, 2 KV groups, vocab 140 unpadded, RoPE base 1e4, RMSNorm eps
1e-6, untied, fp32, no dropout); the weights are redrawn at a scale where every part of the block
matters (non-zero q/k/v biases, norm gains away from 1), since megatron's init (zero biases, unit
gains) would let a side that ignores a bias or a gain pass.

The loss and gradients come from ``MegatronActor.get_loss_and_metrics``, the update itself: our
micro-batching (a token budget, so several micro-batches of different shapes), our fused
output-layer log-probs with the gradient hint, the schedule's pre-division, DDP's gradient buffer.
The gradients are read where the optimizer reads them (``main_grad``), by wrapping its ``step``;
the weights are those before that step. The rollout temperature is 1: NeMo-Aligner's
from_parallel_logits_to_logprobs applies none.

The file holds: the weights (megatron names, unwrapped model's state dict), the batch in
NeMo-Aligner's layout (see integrations/nemo_aligner.py's module docstring), our loss, our
gradients (megatron names) and the shape, for the other side to check against tiny.SHAPE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.nemo_aligner.shape import EOS, SHAPE, VOCAB  # noqa: E402 (after the path line)

# (prompt, response) lengths: all different, longest row 27 < seq_length; row 1 gets a partial loss mask.
SHAPES = [(3, 9), (5, 14), (2, 6), (7, 20), (4, 11), (6, 3), (3, 17), (8, 8)]
BUDGET = 64  # tokens per micro-batch: several micro-batches of different shapes on our side


def hf_config() -> dict:
    from tests.helpers.policy import tiny_hf_config

    return tiny_hf_config(vocab_size=VOCAB, hidden_size=SHAPE["hidden_size"],
                          intermediate_size=SHAPE["ffn_hidden_size"], num_hidden_layers=SHAPE["num_layers"],
                          num_attention_heads=SHAPE["num_attention_heads"],
                          num_key_value_heads=SHAPE["num_query_groups"], rms_norm_eps=1e-6,
                          rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                          max_position_embeddings=SHAPE["seq_length"], tie_word_embeddings=False)


def dapo_cfg():
    from megatron_dapo.config import (
        DAPOConfig, DataConfig, ModelConfig, OptimConfig, OverlongBufferConfig, RewardConfig, RolloutConfig,
        TrainConfig,
    )

    # One update of all 8 rows (2 prompts x 4 is only bookkeeping here: the batch is given).
    # Loss settings are the defaults: clip 0.2 / 0.28, dual clip 10, token-mean (tiny.model_config's
    # model.ppo.loss has the same, and the adapter fills the rest from the same defaults).
    return DAPOConfig(
        seed=1,
        model=ModelConfig(make_vocab_size_divisible_by=1, dtype="fp32", transformer_impl="local"),
        data=DataConfig(prompts_per_step=2, gen_prompts_per_batch=2, max_prompt_length=8),
        rollout=RolloutConfig(temperature=1.0, max_response_length=24),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(len=8)),
        train=TrainConfig(mini_batch_prompts=2, max_tokens_per_micro_batch=BUDGET),
        optim=OptimConfig(lr=1e-3, lr_warmup_steps=0, clip_grad=0.0))


def redraw_weights(module, seed: int = 0) -> None:
    """Every parameter from N(0, 0.1), norm gains 1 + N(0, 0.1): all of them shape the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            base = 1.0 if "layernorm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))


def make_samples(seed: int = 5):
    """The shared test samples (tests/helpers/policy.py) at this model's shapes, ids below eos."""
    from tests.helpers import policy

    return policy.make_samples(seed, shapes=SHAPES, vocab=EOS)


def nemo_batch(samples) -> dict[str, torch.Tensor]:
    """Our samples in NeMo-Aligner's layout: response_tokens [B, S] eos-padded; response_lengths =
    prompt + response (the end column); shifted [B, S-1] columns, j = the prediction of token j+1,
    so response token k of a row with prompt P sits at column P - 1 + k."""
    width = max(x.num_tokens for x in samples)
    rows = len(samples)
    tokens = torch.full((rows, width), EOS, dtype=torch.long)
    prev, adv, mask = (torch.zeros(rows, width - 1) for _ in range(3))
    for i, x in enumerate(samples):
        p, r = x.num_prompt_tokens, x.num_response_tokens
        tokens[i, :p], tokens[i, p:p + r] = x.prompt_ids, x.response_ids
        m = torch.ones(r) if x.loss_mask is None else x.loss_mask.float()
        cols = slice(p - 1, p - 1 + r)
        prev[i, cols], mask[i, cols] = x.old_log_probs, m
        adv[i, cols] = float(x.advantages) * m
    prompt_lengths = torch.tensor([x.num_prompt_tokens for x in samples])
    return {"response_tokens": tokens, "prompt_lengths": prompt_lengths,
            "response_lengths": prompt_lengths + torch.tensor([x.num_response_tokens for x in samples]),
            "prev_logprobs": prev, "advantages": adv, "mask": mask,
            "is_end": torch.ones(rows, dtype=torch.bool)}


def run(out: str | None = None) -> dict:
    """Builds the actor in the current (or a new one-process) world, runs one update, returns (and
    with ``out`` saves) the record. Tears megatron's groups down only if it started them."""
    import torch.distributed as dist

    from megatron_dapo.mcore import destroy_parallel
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
    from tests.helpers.policy import unwrap, with_actor_log_probs

    apply_cpu_compat()
    started = not dist.is_initialized()
    try:
        actor = MegatronActor(dapo_cfg(), hf_config())
        module = unwrap(actor.model[0])
        redraw_weights(module)
        actor.optimizer.reload_model_params()  # the optimizer's copies follow the redrawn weights
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()
                   if isinstance(v, torch.Tensor)}  # (no _extra_state: the local spec has none)
        # old log-probs: the actor's own plus N(0, 0.3) noise, so ratios reach both clip edges
        samples = with_actor_log_probs(actor, make_samples(), seed=3)

        params = dict(module.named_parameters())
        grads: dict[str, torch.Tensor] = {}
        step = actor.optimizer.step

        def capture_then_step():  # the gradients exactly as the optimizer receives them
            grads.update({n: p.main_grad.detach().clone() for n, p in params.items()})
            return step()

        actor.optimizer.step = capture_then_step
        actor.prepare_for_training()
        metrics = actor.get_loss_and_metrics(samples)
        actor.optimizer.step = step
        if set(grads) != set(params):
            raise RuntimeError("the optimizer step was not reached: no gradients captured")
        record = {"shape": dict(SHAPE, vocab_size=VOCAB), "weights": weights, "batch": nemo_batch(samples),
                  "loss": metrics["actor/pg_loss"], "grads": grads,
                  "metrics": {k: metrics[k] for k in ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low",
                                                      "actor/num_tokens", "actor/num_micro_batches",
                                                      "actor/grad_shortcut_used")},
                  "block": block_notes(module),
                  "versions": {"megatron-core": _version("megatron-core"), "torch": str(torch.__version__)}}
    finally:
        if started:
            destroy_parallel()
    if out:
        torch.save(record, out)
    return record


def block_notes(gpt) -> dict[str, str]:
    """The same facts as probe_same_model.layout_notes, of our block, for the report."""
    layer, cfg = gpt.decoder.layers[0], gpt.config
    inv_freq = gpt.rotary_pos_emb.inv_freq
    return {"norm": type(layer.input_layernorm).__name__ + f"(eps={cfg.layernorm_epsilon})",
            "activation": f"{cfg.activation_func.__name__}, gated_linear_unit={cfg.gated_linear_unit}",
            "core_attention": type(layer.self_attention.core_attention).__name__,
            # inv_freq[i] = base ** (-2 i / d): the base from the second entry
            "rotary": f"base {float(inv_freq[1]) ** (-inv_freq.numel()):.6g}, "
                      f"rotary_interleaved={cfg.rotary_interleaved}"}


def _version(dist_name: str) -> str:
    import importlib.metadata as md

    return md.version(dist_name)


if __name__ == "__main__":
    r = run(sys.argv[1])
    print(f"loss {r['loss']:.8g}  {r['metrics']}  {len(r['grads'])} gradients -> {sys.argv[1]}")
