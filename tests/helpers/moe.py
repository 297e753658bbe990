"""A random tiny Qwen3-MoE for the MoE conversion and training tests, and the tests' own HF -> Megatron
name map of its MoE block (a second statement of the layout, independent of megatron_dapo.convert).

Megatron's layout of a Qwen3-MoE layer (megatron-core 0.19.2, SequentialMLP experts, local spec), as
these tests state it:
  * ``mlp.router.weight`` [experts, hidden] = HF ``mlp.gate.weight`` (replicated over TP);
  * ``mlp.experts.local_experts.<e>.linear_fc1.weight`` = cat(gate_proj_e, up_proj_e) (dim 0), e the
    global expert index at EP=1; rank r of EP=k holds experts r * E / k .. as local 0 ..;
  * ``mlp.experts.local_experts.<e>.linear_fc2.weight`` = down_proj_e;
  * ``pre_mlp_layernorm.weight`` = ``post_attention_layernorm.weight`` (a module of its own under
    both specs: an MoE layer has no linear_fc1 to fuse it into);
  * the attention block as in a dense Qwen3 (tests/helpers/convert.hf_to_megatron_by_hand).

transformers is imported inside the functions (spawned workers may not need it).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.convert import hf_to_megatron_by_hand

# 4 experts of 32, top-2, over a width of 64; Qwen3's attention (4 heads of 24, 2 KV groups)
TINY_MOE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, architectures=["Qwen3MoeForCausalLM"])


def moe_samples(shapes, *, routes: bool = False, seed: int = 4) -> list:
    """Trainer samples of the given (prompt, response) lengths over TINY_MOE's vocabulary, with random
    advantages and old log-probs; ``routes``: random R3 routes, two distinct experts per (token, layer)
    (a sample's last token has none)."""
    from megatron_dapo.batching import Sample

    e, k, layers = TINY_MOE["num_experts"], TINY_MOE["num_experts_per_tok"], TINY_MOE["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in shapes:
        ids = torch.randint(0, TINY_MOE["vocab_size"], (p + r,), generator=g)
        pairs = torch.rand(p + r - 1, layers, e, generator=g).argsort(-1)[..., :k]
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], advantages=float(torch.randn((), generator=g)),
                          old_log_probs=-torch.rand(r, generator=g),
                          routed_experts=pairs.reshape(p + r - 1, layers * k).to(torch.int16) if routes else None))
    return out


def one_update(actor, hf_dir, samples) -> dict:
    """What the MoE equality tests compare of one update from ``hf_dir``'s weights over ``samples`` (the actor
    gives each DP rank its share): every sample's log-probs, the update's metrics, the weights after it."""
    assert actor.load_hf_weights(str(hf_dir)) > 0
    log_probs = actor.get_inference_log_probs(samples)
    metrics = actor.get_loss_and_metrics(samples)
    return {"log_probs": log_probs, "metrics": metrics,
            "weights": {name: tensor.clone() for name, tensor in actor.export_hf_weights()}}


def assert_same_update(have: dict, want: dict, what: str, keys: tuple[str, ...]) -> None:
    """``one_update`` results equal: log-probs and weights to fp32 round-off, the metrics ``keys`` to 1e-5;
    with R3's agreement among them, some random routes agree and some do not."""
    close = torch.testing.assert_close
    for i, (a, b) in enumerate(zip(have["log_probs"], want["log_probs"], strict=True)):
        close(a, b, atol=2e-6, rtol=1e-4, msg=lambda m, i=i: f"{what}: log-probs of sample {i}: {m}")
    for key in keys:
        assert have["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5), (what, key)
    if "moe/route_agreement" in keys:
        assert 0.05 < have["metrics"]["moe/route_agreement"] < 0.95, what
    assert sorted(have["weights"]) == sorted(want["weights"]), what
    for name, tensor in want["weights"].items():
        close(have["weights"][name], tensor, atol=1e-5, rtol=1e-4,
              msg=lambda m, name=name: f"{what}: {name} after the update: {m}")


def tiny_moe_model(*, seed: int = 0, norm_topk_prob: bool = True, **overrides):
    """A random fp32 ``Qwen3MoeForCausalLM`` (TINY_MOE): norms N(1, 0.1) (HF initialises them to exactly
    1, which would hide a mix-up) and router weights N(0, 0.5) (so the top-k is far from ties and a
    routing difference shows in the logits)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY_MOE, "norm_topk_prob": norm_topk_prob, **overrides})
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
    return model.eval()


def save_tiny_moe(path: Path, *, seed: int = 0, norm_topk_prob: bool = True, **overrides) -> Path:
    """tiny_moe_model saved by transformers itself (``save_pretrained``), sharded small."""
    tiny_moe_model(seed=seed, norm_topk_prob=norm_topk_prob, **overrides).save_pretrained(path, max_shard_size="60KB")
    return path


def read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor of the safetensors files) of an HF dir, read with safetensors alone."""
    from safetensors import safe_open

    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for name in s.keys():
                assert name not in tensors, f"{name} in two shards"
                tensors[name] = s.get_tensor(name)
    return json.loads((Path(path) / "config.json").read_text()), tensors


def moe_hf_to_megatron_by_hand(hf_sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Qwen3-MoE HF names (per-expert tensors) -> megatron local-spec names at TP = EP = 1 (module docstring)."""
    layers, experts = config["num_hidden_layers"], config.get("num_experts") or config["num_local_experts"]
    arch = SimpleNamespace(num_query_groups=config["num_key_value_heads"], kv_channels=config["head_dim"],
                           num_layers=layers, tie_word_embeddings=config.get("tie_word_embeddings", False))
    # the attention block and norms from the dense map (its MLP entries are placeholders, dropped below)
    placeholders = {f"model.layers.{i}.mlp.{p}_proj.weight": torch.empty(0)
                    for i in range(layers) for p in ("gate", "up", "down")}
    out = {k: v for k, v in hf_to_megatron_by_hand({**hf_sd, **placeholders}, arch).items()
           if ".mlp.linear_fc" not in k}
    for i in range(layers):
        hf, mg = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        out[mg + "router.weight"] = hf_sd[hf + "gate.weight"]
        for e in range(experts):
            x = f"{hf}experts.{e}."
            out[f"{mg}experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
                [hf_sd[x + "gate_proj.weight"], hf_sd[x + "up_proj.weight"]])
            out[f"{mg}experts.local_experts.{e}.linear_fc2.weight"] = hf_sd[x + "down_proj.weight"]
    return out
