"""The Megatron-Core policy: the only package that imports megatron.core.

Importing it first applies the CPU compatibility patches (cpu_compat.py; a no-op when CUDA is
present), which must precede any ``import megatron.core``: entry points and spawned child
processes that import this package are covered.
"""

from megatron_dapo.policy.cpu_compat import apply_cpu_compat

apply_cpu_compat()

from megatron_dapo.policy.logprobs import vocab_parallel_logprobs  # noqa: E402
from megatron_dapo.policy.model import (  # noqa: E402
    build_model,
    hf_arch,
    padded_vocab_size,
    transformer_config_from_hf,
)
from megatron_dapo.policy.parallel import (  # noqa: E402
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
