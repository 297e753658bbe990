"""The checkpoint benchmarks' model (async_save.py, checkpoint_memory.py, checkpoint_save.py): a Qwen2
shape at a given width and depth with Qwen's head layout and a 32k vocabulary, and its actor after
one real update, so that the optimizer state a save writes exists."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32000


def qwen2_shape(hidden: int, layers: int) -> dict:
    return dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=1024, hidden_act="silu")


def trained_actor(hidden: int, layers: int):
    """(MegatronActor with the distributed optimizer, fp32, cpu_tiny's settings; the 4 samples of 16
    tokens it took its update on). Call after apply_cpu_compat()."""
    import dataclasses

    import torch

    from megatron_dapo.batching import Sample
    from megatron_dapo.config_loading import load_config
    from megatron_dapo.mcore.actor import MegatronActor

    cfg = load_config(ROOT / "conf" / "cpu_tiny.yaml")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, use_distributed_optimizer=True))
    actor = MegatronActor(cfg, qwen2_shape(hidden, layers))
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(0, VOCAB, (8,), generator=g),
                      response_ids=torch.randint(0, VOCAB, (8,), generator=g), advantages=1.0 - 2 * (i % 2),
                      old_log_probs=torch.full((8,), -10.0)) for i in range(4)]
    actor.get_loss_and_metrics(samples)  # the Adam moments exist from here on
    return actor, samples
