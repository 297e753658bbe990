"""Which layouts need one [b, s] for every micro-batch, and so where ``train.pack_sequences=auto`` packs.

Two parts of megatron-core 0.19.2 need every micro-batch of a mini-batch to have one shape:

* pipeline stages that cannot exchange shapes: they send each micro-batch's shape before its
  activations (``variable_seq_lengths``), except under the interleaved schedule at PP 2, whose
  batched p2p ops pair sends with the wrong receives when the previous and next stage are one
  rank (``exchanges_shapes``);
* the allgather token dispatcher of a mixture-of-experts model: every MoE layer gathers the EP
  ranks' tokens (as many on each) and it refuses variable shapes between stages.

There a padded micro-batch is padded to the step's longest sample, one row each when that sample is
near the cap: ~70% of the computed tokens are padding at DAPO's response lengths, and packing does
the same work in a third of the time (2.97x on a CPU, 3.76x modelled at 32B: docs/packing.md).
Elsewhere micro-batches are filled by a token budget, first-fit decreasing by length: they pad
0.5-2%, and packed and padded are level (0.96x-1.11x measured). So ``auto`` packs where one shape is
needed, on the spec whose packed attention has been verified (the local spec), and pads elsewhere.
The train step reads the same rule from the built TransformerConfig (``one_shape_of``, used by
mcore/micro_batches.py); tests/unit/test_packing_default.py holds it to megatron's own
``variable_seq_lengths`` of that config.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_dapo.config import ModelConfig, ParallelConfig
from megatron_dapo.config_algo import AUTO
from megatron_dapo.config_moe import MoEConfig
from megatron_dapo.precision import resolve_token_dispatcher, resolve_transformer_impl


def exchanges_shapes(pp: int, vpp: int | None) -> bool:
    """megatron's ``variable_seq_lengths`` for a dense model: whether pipeline stages send each
    micro-batch's shape first (not under the interleaved schedule at PP 2, module doc)."""
    return pp > 1 and not (vpp is not None and pp == 2)


def one_shape(*, pp: int, vpp: int | None, ep: int, allgather_moe: bool) -> bool:
    """Whether every micro-batch must have one [b, s]: stages that cannot exchange shapes (interleaved PP 2,
    or any PP > 1 of an MoE model on the allgather dispatcher), or EP ranks gathering each other's
    tokens (``allgather_moe``: a model with experts on megatron's allgather dispatcher)."""
    stages = pp > 1 and (allgather_moe or not exchanges_shapes(pp, vpp))
    return stages or (ep > 1 and allgather_moe)


def pack_choice(given: bool | str, *, transformer_impl: str, one_shape: bool) -> tuple[bool, str]:
    """(whether micro-batches are packed, why) for ``train.pack_sequences=given`` on the resolved layer
    spec ``transformer_impl`` and layout (``one_shape``). An explicit true or false is taken as given
    (true on the Transformer Engine spec is refused at launch: mcore/parallel.check_packing)."""
    if given != AUTO:
        return bool(given), "set"
    if transformer_impl != "local":
        return False, ("padded: Transformer Engine's packed (THD) attention has not run here; the local spec's "
                       "has (docs/packing.md)")
    if one_shape:
        return True, ("every micro-batch must have one shape in this layout (module micro_batch_shapes): "
                      "padded, each would be as long as the step's longest sample")
    return False, ("padded: micro-batches of varying shapes, filled by length, pad ~1-2% and the two are level "
                   "(docs/packing.md)")


def launch_pack_choice(given: bool | str, hf_config: Mapping[str, Any], *, model: ModelConfig,
                       parallel: ParallelConfig, moe: MoEConfig, on_gpu: bool) -> tuple[bool, str]:
    """``pack_choice`` from the config and the model's config.json, before any model is built: what the
    actor will find in its TransformerConfig (``from_transformer_config``)."""
    from megatron_dapo.plan_params import experts

    impl = resolve_transformer_impl(model.transformer_impl, on_gpu)
    allgather_moe = experts(dict(hf_config)) is not None and (
        resolve_token_dispatcher(moe.token_dispatcher, on_gpu) == "allgather")
    shape = one_shape(pp=parallel.pipeline_model_parallel_size,
                      vpp=parallel.virtual_pipeline_model_parallel_size,
                      ep=parallel.expert_model_parallel_size, allgather_moe=allgather_moe)
    return pack_choice(given, transformer_impl=impl, one_shape=shape)


def allgather_moe_of(config: Any) -> bool:
    """Whether a built megatron TransformerConfig is a model with experts on the allgather dispatcher."""
    return bool(config.num_moe_experts) and config.moe_token_dispatcher_type == "allgather"


def one_shape_of(config: Any) -> bool:
    """``one_shape`` of a built megatron TransformerConfig (the train step's micro-batches, the actor's choice)."""
    return one_shape(pp=config.pipeline_model_parallel_size, vpp=config.virtual_pipeline_model_parallel_size,
                     ep=config.expert_model_parallel_size, allgather_moe=allgather_moe_of(config))


def from_transformer_config(given: bool | str, config: Any) -> tuple[bool, str]:
    """``pack_choice`` from a built megatron TransformerConfig (the actor's)."""
    return pack_choice(given, transformer_impl=config.transformer_impl, one_shape=one_shape_of(config))
