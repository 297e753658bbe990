"""The Megatron-Core policy: the only package that imports megatron.core.

Importing it changes nothing outside it. On a machine without CUDA, megatron-core needs the
compatibility layer (cpu_compat.py) applied before ``megatron.core`` is imported; the places that
start megatron work apply it explicitly (setup, the converter, test fixtures, spawned test
children), and the two doors into megatron (``initialize_parallel``, ``transformer_config_from_hf``)
refuse to run without it, naming the call. See docs/cpu_compat.md.
"""

from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
from megatron_dapo.mcore.logprobs import vocab_parallel_logprobs
from megatron_dapo.mcore.model import (
    build_model,
    hf_arch,
    padded_vocab_size,
    transformer_config_from_hf,
)
from megatron_dapo.mcore.parallel import (
    destroy_parallel,
    initialize_parallel,
    validate_parallel,
)

__all__ = [
    "apply_cpu_compat",
    "build_model",
    "destroy_parallel",
    "hf_arch",
    "initialize_parallel",
    "padded_vocab_size",
    "transformer_config_from_hf",
    "validate_parallel",
    "vocab_parallel_logprobs",
]
