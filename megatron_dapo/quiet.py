"""Known-harmless third-party start-up messages, filtered at the entry points (cli.main and the
test suite's conftest), so that the first screen of a run shows what the run is doing.

Each entry names why it is harmless. Only these exact messages are filtered; any other warning
from the same libraries still prints. The list (docs/reliability.md, "Quiet start-up"):
"""

import logging
import warnings

# (message regex, why it is harmless) for warnings.warn (any category)
HARMLESS_WARNINGS = (
    (r"Transformer Engine and Apex are not installed", "CPU runs use torch's optimizers and kernels; "
     "GPU runs (the container) have TE, which the GPU tests check"),
    (r"Apex is not installed\. Falling back to Torch Norm", "megatron's local layer spec uses torch's RMSNorm "
     "on CPU (parity-tested against HF)"),
    (r"full scope is deprecated", "raised by megatron-core 0.19's own TransformerConfig default "
     "(cuda_graph_scope), not by a setting of ours; CUDA graphs are off"),
    (r"MimoModelConfig is experimental", "an import side effect of megatron.core.models; MIMO is unused"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", "torch's FutureWarning on every "
     "dist-checkpoint load: megatron-core 0.19's checkpoint format is built on ShardedTensor, not our choice"),
    (r"The following imports from `dynamic_context\.py` will be removed", "a DeprecationWarning megatron-core "
     "0.19's own inference package raises on import; we import nothing from it"),
)
# (logger name, message prefix, why it is harmless) for log records
HARMLESS_LOGS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED", "GPTModel is megatron-core 0.19's "
     "supported model for Qwen2; the migration it points to (HybridModel) is for hybrid SSM models"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated", "printed on "
     "every synchronous save too; we do not use async saves (mcore/checkpoint.py)"),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_start_up() -> None:
    """Installs the filters (idempotent)."""
    for pattern, _ in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, prefix, _ in HARMLESS_LOGS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropPrefix(prefix))
