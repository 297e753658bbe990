"""HF model dir <-> Megatron dist checkpoint (torch_dist), streaming one tensor / bucket at a time.

Lives under mcore/ (the only importer of megatron.core); the pure mapping it applies is
megatron_dapo.convert. This module is the converter's front door, the one import of its callers
(tools/convert_ckpt, logit_check.py, benchmarks, tests); the work is in three modules, so that each
direction reads on its own:
- converted_checkpoint.py: the checkpoint's layout (hf/, convert.json), the model it describes at a
  TP / PP / VPP, loading it (``load_megatron_checkpoint``), and the output-directory rule;
- hf_to_mcore.py: ``hf_to_megatron``, through megatron's own saver fed from the HF files;
- mcore_to_hf.py: ``megatron_to_hf``, and ``write_hf_checkpoint`` for a live model.

Memory: neither direction holds a loaded model (each direction's module says how).
Both run in one process (TP=PP=1) or under torchrun with ``tp`` x ``pp`` dividing the world.
"""

from megatron_dapo.mcore.converted_checkpoint import (
    DTYPES,
    HF_SUBDIR,
    META_NAME,
    build_parallel_model,
    load_megatron_checkpoint,
    read_checkpoint_meta,
)
from megatron_dapo.mcore.hf_to_mcore import hf_to_megatron
from megatron_dapo.mcore.mcore_to_hf import CONVERT_BUCKET_BYTES, megatron_to_hf, write_hf_checkpoint

__all__ = [
    "CONVERT_BUCKET_BYTES",
    "DTYPES",
    "HF_SUBDIR",
    "META_NAME",
    "build_parallel_model",
    "hf_to_megatron",
    "load_megatron_checkpoint",
    "megatron_to_hf",
    "read_checkpoint_meta",
    "write_hf_checkpoint",
]
