"""Megatron dist checkpoint (written by hf_to_megatron.py) -> HF dir that from_pretrained loads.

    python tools/convert_ckpt/megatron_to_hf.py --ckpt ckpt/qwen2.5-0.5b --out Qwen2.5-0.5B-rl [--dtype bf16]

Weights stream out of the loaded model one bucket at a time into size-bounded safetensors shards
(model-0000i-of-0000N.safetensors + index); config, generation config and tokenizer files are
copied from <ckpt>/hf/.
"""

import argparse
import sys

from megatron_dapo.convert import ConversionError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint dir written by hf_to_megatron.py")
    p.add_argument("--out", required=True, help="output HF model dir (must be empty unless --force)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="output dtype; default: the checkpoint's")
    p.add_argument("--max-shard-size", type=float, default=5.0, help="GB (10^9 bytes) per safetensors shard")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of this conversion job")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this conversion job")
    p.add_argument("--workers", type=int, help="processes writing the output side by side when launched as one "
                   "process (each writes every N-th shard, the same files); default: one per 4 cores, at most "
                   "8 and one per output shard")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from megatron_dapo.mcore.hf_conversion import megatron_to_hf

        files = megatron_to_hf(args.ckpt, args.out, dtype=args.dtype, tp=args.tp, pp=args.pp,
                               force=args.force, max_shard_bytes=int(args.max_shard_size * 1e9),
                               progress=not args.no_progress, workers=args.workers)
    except ConversionError as e:
        print(f"megatron_to_hf: error: {e}", file=sys.stderr)
        return 2
    if files:
        print(f"wrote {args.out}: {len(files)} safetensors file(s)")
    return 0


if __name__ == "__main__":
    code = main()
    from megatron_dapo.mcore.parallel import shutdown_distributed

    shutdown_distributed()  # gloo left alive can abort the interpreter at exit
    sys.exit(code)
