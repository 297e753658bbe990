"""HF <-> Megatron-Core checkpoint conversion (Qwen2, Qwen3 dense and Qwen3-MoE) and streaming weight export.

* ``mapping.py`` / ``table.py`` / ``decoder.py``: the declarative mapping table, pure torch;
  ``qwen2.py``, ``qwen3.py`` and ``qwen3_moe.py`` register the architectures.
* ``safetensors_io.py``: one-tensor-at-a-time reads, size-bounded sharded writes.
* ``export.py``: ``(hf_name, full tensor)`` from a live TP/PP-sharded model, in byte buckets.
* ``shard_plan.py``: per-rank shard sizes on meta tensors (dry run).

Nothing here imports megatron.core (tests/unit/test_boundaries.py): the parts of conversion that
need it live under mcore/ (``mcore/hf_conversion.py``: HF dir <-> Megatron dist checkpoint;
``mcore/logit_check.py``: HF vs Megatron logits), and they use this package's tables.
"""

from megatron_dapo.convert import qwen2 as _qwen2  # noqa: F401  (registers Qwen2ForCausalLM)
from megatron_dapo.convert import qwen3 as _qwen3  # noqa: F401  (registers Qwen3ForCausalLM)
from megatron_dapo.convert import qwen3_moe as _qwen3_moe  # noqa: F401  (registers Qwen3MoeForCausalLM)
from megatron_dapo.convert.export import export_hf_weights, load_hf_weights
from megatron_dapo.convert.mapping import ConversionError, ModelDims
from megatron_dapo.convert.shard_plan import format_shard_plan, shard_plan
from megatron_dapo.convert.safetensors_io import (
    SafetensorsReader, ShardedSafetensorsWriter, copy_side_files, read_hf_config,
)
from megatron_dapo.convert.table import (
    Architecture, ConversionTable, architecture, conversion_table, hf_to_megatron_state_dict,
    megatron_to_hf_state_dict, merge_tp, register_architecture, split_tp, supported_architectures,
)

__all__ = [
    "Architecture", "ConversionError", "ConversionTable", "ModelDims", "SafetensorsReader", "ShardedSafetensorsWriter",
    "architecture",
    "conversion_table", "copy_side_files", "export_hf_weights", "format_shard_plan",
    "hf_to_megatron_state_dict", "load_hf_weights",
    "megatron_to_hf_state_dict", "merge_tp", "read_hf_config", "register_architecture", "shard_plan",
    "split_tp", "supported_architectures",
]
