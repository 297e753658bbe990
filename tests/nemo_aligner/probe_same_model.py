"""NeMo-Aligner's side of the same-model comparison: ours_side.py's weights and batch through the
adapter's DAPO actor on the real NeMo 2.1 / megatron-core 0.10 stack.

    .venv-nemo/bin/torchrun --nproc_per_node 1 tests/nemo_aligner/probe_same_model.py OUT.json OURS.pt

Builds tiny.SHAPE's actor as tiny.build does, copies in every weight from OURS.pt (megatron-core
0.19.2 names -> 0.10 names, ``megatron_name_map``; shapes checked one by one), then runs the
training step's first half in ReinforceTrainer.run_training's order: prepare_for_training,
zero_grad, prepare_for_training_step, get_loss_and_metrics(forward_only=False) (megatron-core
0.10's schedule over micro-batches of MBS rows, each padded to the batch width, log-probs from
NeMo-Aligner's from_parallel_logits_to_logprobs), finish_training_step (NeMo's gradient
all-reduce). The gradients are then what clip_gradients and the optimizer would read.

What is shared with our side and what is not: the per-token DAPO surrogate is ours on both
(algo.compute_policy_loss, via the adapter's loss_func). Independent: the transformer (another
megatron-core, NeMo's config translation, NeMo's attention mask and position ids, unfused
DotProductAttention vs our SDPA), the log-probs (log-softmax of the full logits vs our chunked
output layer with its gradient hint), the batching (fixed-size padded micro-batches vs our token
budget) and the loss scaling and gradient path (NeMo's schedule call and grads vs our DDP buffer).

OUT.json: loss both sides, per-parameter max relative gradient difference (max |ours - nemo| /
max |ours|), the names that did not map either way, and the shape / layout checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.nemo_aligner import tiny  # noqa: E402

MBS = 2  # 8 rows -> 4 micro-batches here (our side: 3 of a token budget)
BATCH_KEYS = ("response_tokens", "prev_logprobs", "advantages", "mask", "is_end")  # dapo_rollout_data's


def megatron_name_map(num_layers: int) -> dict[str, str]:
    """megatron-core 0.19.2 local-spec name -> 0.10 local-spec name. The same at these versions
    (GPTModel, TransformerLayer and SelfAttention kept their submodule names); written out so that a
    rename in either version shows up as an unmapped name instead of a silent partial load."""
    names = {"embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
             "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
             "output_layer.weight": "output_layer.weight"}
    per_layer = ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                 "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
    for i in range(num_layers):
        for leaf in per_layer:
            names[f"decoder.layers.{i}.{leaf}"] = f"decoder.layers.{i}.{leaf}"
    return names


def layout_notes(gpt) -> dict[str, str]:
    """Facts of the 0.10 block that decide whether a tensor copies as is: the fused QKV's row order
    (per query group: its q heads, then k, then v, in both versions at TP = 1), the GLU's halves
    (gate first, then up: megatron's glu chunks fc1's output in that order in both), the norm and
    the activation NeMo built."""
    layer = gpt.decoder.layers[0]
    attn, cfg, inv_freq = layer.self_attention, gpt.config, gpt.rotary_pos_emb.inv_freq
    per_group = attn.num_attention_heads_per_partition // attn.num_query_groups_per_partition
    return {"qkv_rows": f"{attn.num_query_groups_per_partition} groups x ({per_group} q + 1 k + 1 v) x "
                        f"{attn.hidden_size_per_attention_head}",
            "norm": type(layer.input_layernorm).__name__ + f"(eps={cfg.layernorm_epsilon})",
            "activation": f"{cfg.activation_func.__name__}, gated_linear_unit={cfg.gated_linear_unit}",
            "core_attention": type(attn.core_attention).__name__,
            # inv_freq[i] = base ** (-2 i / d): the base from the second entry
            "rotary": f"base {float(inv_freq[1]) ** (-inv_freq.numel()):.6g}, "
                      f"rotary_interleaved={cfg.rotary_interleaved}",
            "bias": f"add_qkv_bias={cfg.add_qkv_bias}, add_bias_linear={cfg.add_bias_linear}",
            "tied": str(gpt.share_embeddings_and_output_weights)}


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def load_weights(gpt, weights: dict[str, torch.Tensor], num_layers: int) -> dict:
    """Copies ours into the 0.10 model by the map; returns what did not map or did not fit."""
    mapping = megatron_name_map(num_layers)
    theirs = dict(gpt.named_parameters())
    report = {"ours_unmapped": sorted(set(weights) - set(mapping)),
              "ours_missing": sorted(set(mapping) - set(weights)),
              "nemo_missing": sorted(v for v in mapping.values() if v not in theirs),
              "nemo_not_loaded": sorted(set(theirs) - set(mapping.values())),
              "shape_mismatch": {}}
    with torch.no_grad():
        for ours, nemo in mapping.items():
            if ours not in weights or nemo not in theirs:
                continue
            if tuple(weights[ours].shape) != tuple(theirs[nemo].shape):
                report["shape_mismatch"][ours] = [list(weights[ours].shape), list(theirs[nemo].shape)]
                continue
            theirs[nemo].copy_(weights[ours])
    return report


def main(out: str, ours_path: str) -> None:
    tiny.setup()
    from megatron.core import parallel_state as ps
    from nemo_aligner.utils.train_script_utils import (
        extract_optimizer_scheduler_from_ptl_model, init_using_ptl,
    )

    ours = torch.load(ours_path, weights_only=True)
    shape = {k: v for k, v in ours["shape"].items() if k != "vocab_size"}
    if shape != tiny.SHAPE:
        raise SystemExit(f"ours_side's shape {shape} is not tiny.SHAPE {tiny.SHAPE}")
    batch = {k: ours["batch"][k] for k in BATCH_KEYS}
    rows = batch["response_tokens"].shape[0]

    work = Path(out).parent
    model_cfg = tiny.model_config(tiny.save_tokenizer(work / "tok"), mbs=MBS, gbs=rows)
    ptl_trainer, actor, _ = tiny.build(model_cfg)
    init_using_ptl(ptl_trainer, actor, None, None)  # NeMo's optimizer, as a real run has it
    optimizer, _ = extract_optimizer_scheduler_from_ptl_model(actor)
    if ps.get_data_parallel_world_size() != 1:
        raise SystemExit("run with --nproc_per_node 1: the comparison is of one whole batch")
    gpt = unwrap(actor.model)
    vocab = gpt.output_layer.weight.shape[0]
    if vocab != ours["shape"]["vocab_size"]:
        raise SystemExit(f"NeMo padded the vocabulary to {vocab}, ours has {ours['shape']['vocab_size']}")
    report = load_weights(gpt, ours["weights"], tiny.SHAPE["num_layers"])

    loss, metrics, micro_batches = tiny.loss_and_gradients(actor, optimizer, batch)

    mapping = megatron_name_map(tiny.SHAPE["num_layers"])
    theirs = dict(gpt.named_parameters())
    grad_rel, no_grad = {}, []
    for name, want in ours["grads"].items():
        p = theirs.get(mapping.get(name, ""))
        if p is None or p.grad is None:
            no_grad.append(name)
            continue
        grad_rel[name] = ((p.grad - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    loss_rel = abs(loss - ours["loss"]) / abs(ours["loss"])
    result = {"loss": loss, "ours_loss": ours["loss"], "loss_rel": loss_rel,
              "grad_max_rel": grad_rel, "worst_grad": max(grad_rel.items(), key=lambda kv: kv[1]),
              "no_grad": no_grad, "metrics": {k: metrics[k] for k in ("actor/pg_clipfrac_high",
                                                                     "actor/pg_clipfrac_low")},
              "ours_metrics": ours["metrics"], "micro_batches": micro_batches,
              "mapping": report, "layout": layout_notes(gpt), "ours_block": ours["block"],
              "ours_versions": ours["versions"]}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
