"""A random tiny transformers Qwen2 for the rollout-engine tests (generation, weight sync)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 200


def tiny_qwen2(seed: int, tie: bool = False) -> Qwen2ForCausalLM:
    """vocab 200, 2 layers, hidden 32: random weights from ``seed``."""
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, eos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    # The default init (std 0.02) gives near-uniform next-token distributions; larger weights make
    # them peaked, so top-p/top-k truncate something and greedy runs do not loop on one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()
