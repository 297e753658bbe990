"""Random tiny Qwen2 and Qwen3 checkpoints and Megatron-named stand-ins for the conversion tests, and the
tests' own HF -> Megatron name map (independent of megatron_dapo.convert, so the converter is
checked against a second statement of the layout).

transformers is imported inside the functions: spawned test workers that only need the stand-ins
skip that import."""

from __future__ import annotations

import torch
from torch import nn

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])


# Qwen3 dense at toy width: a head size of its own (4 heads of 24 over a width of 32 or 64), no q/k/v
# biases, per-head query/key RMSNorm
QWEN3 = dict(head_dim=24, architectures=["Qwen3ForCausalLM"])


def _classes(arch: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {"qwen2": (Qwen2Config, Qwen2ForCausalLM, {}), "qwen3": (Qwen3Config, Qwen3ForCausalLM, QWEN3)}[arch]


def hf_state_dict(arch: str = "qwen2", **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random tiny Qwen2 (GQA 4 heads / 2 groups, q/k/v bias) or Qwen3 (``arch``, QWEN3 above): its
    config dict and saved tensors."""
    config_cls, model_cls, extra = _classes(arch)
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **extra, **overrides})
    model = model_cls(config)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # save_pretrained stores a tied head once, as embed_tokens
    return config.to_dict(), sd


def save_tiny_hf(path, *, tied=False, dtype=torch.float32, seed=0, num_layers=2, arch="qwen2"):
    """A random tiny Qwen2 (or Qwen3: ``arch``) HF dir (vocab 100, hidden 64), sharded small, with a side file."""
    config_cls, model_cls, extra = _classes(arch)
    torch.manual_seed(seed)
    config = config_cls(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, **extra)
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # HF initialises norms to exactly 1: make them random so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="60KB")
    (path / "tokenizer_config.json").write_text("{}\n")  # side files must travel along
    return path


def stand_in_chunk(megatron: dict[str, torch.Tensor], layers: range) -> nn.Module:
    """An nn.Module whose named_parameters are ``megatron``'s (layer-local indices, global layer_number)."""
    root = nn.Module()
    for name, t in megatron.items():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            if int(parts[2]) not in layers:
                continue
            parts[2] = str(int(parts[2]) - layers.start)
        mod = root
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                while len(mod) <= int(part):
                    mod.append(nn.Module())
                    mod[-1].layer_number = layers.start + len(mod)
                mod = mod[int(part)]
            else:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.ModuleList() if parts[i + 1].isdigit() else nn.Module())
                mod = getattr(mod, part)
        mod.register_parameter(parts[-1], nn.Parameter(t.clone()))
    return root


def hf_to_megatron_by_hand(hf_sd, arch):
    """Qwen2 / Qwen3 HF names -> megatron local-spec names (TP=1). linear_qkv rows are grouped per KV
    group: [q heads of group g, k_g, v_g] for g = 0..groups-1 (a bias where the HF model has one,
    Qwen2); linear_fc1 is [gate; up]; Qwen3's q_norm / k_norm are q_layernorm / k_layernorm."""
    groups, hd = arch.num_query_groups, arch.kv_channels
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf_sd["model.norm.weight"]}
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    for i in range(arch.num_layers):
        hf_p, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if f"{hf_p}self_attn.q_proj.bias" in hf_sd else ("weight",):
            q, k, v = (hf_sd[f"{hf_p}self_attn.{n}_proj.{kind}"] for n in "qkv")
            q = q.reshape(groups, -1, *q.shape[1:])
            k, v = (t.reshape(groups, hd, *t.shape[1:]) for t in (k, v))
            out[f"{mg}self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], 1).reshape(-1, *q.shape[2:])
        out[f"{mg}self_attention.linear_proj.weight"] = hf_sd[f"{hf_p}self_attn.o_proj.weight"]
        for norm in ("q", "k"):
            if f"{hf_p}self_attn.{norm}_norm.weight" in hf_sd:
                out[f"{mg}self_attention.{norm}_layernorm.weight"] = hf_sd[f"{hf_p}self_attn.{norm}_norm.weight"]
        out[f"{mg}input_layernorm.weight"] = hf_sd[f"{hf_p}input_layernorm.weight"]
        out[f"{mg}pre_mlp_layernorm.weight"] = hf_sd[f"{hf_p}post_attention_layernorm.weight"]
        out[f"{mg}mlp.linear_fc1.weight"] = torch.cat([hf_sd[f"{hf_p}mlp.gate_proj.weight"],
                                                      hf_sd[f"{hf_p}mlp.up_proj.weight"]])
        out[f"{mg}mlp.linear_fc2.weight"] = hf_sd[f"{hf_p}mlp.down_proj.weight"]
    return out
