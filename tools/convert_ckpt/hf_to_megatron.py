"""HF Qwen2-family dir -> Megatron dist checkpoint (torch_dist), loadable at any TP / PP / DP.

    python tools/convert_ckpt/hf_to_megatron.py --hf-dir Qwen2.5-0.5B --out ckpt/qwen2.5-0.5b [--dtype bf16]
    torchrun --nproc-per-node 2 tools/convert_ckpt/hf_to_megatron.py ... --tp 2   # in parallel: each rank
                      # reads only its shard's tensors and writes its part of the checkpoint
    python tools/convert_ckpt/hf_to_megatron.py --hf-dir D --dry-run --tp 8 --pp 2  # per-rank sizes only

Writes <out>/ (dist checkpoint), <out>/hf/ (config.json, tokenizer files) and <out>/convert.json.
"""

import argparse
import sys

from megatron_dapo.convert import ConversionError, format_shard_plan, read_hf_config, shard_plan


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True,
                   help="HF model dir: config.json + safetensors (single file or sharded)")
    p.add_argument("--out", help="output dir for the Megatron checkpoint (must be empty unless --force)")
    p.add_argument("--dtype", choices=["bf16", "fp32"],
                   help="checkpoint dtype; default: the HF weights' dtype")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of this conversion job")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size of this conversion job")
    p.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="vocabulary padding multiple (x TP); default: the trainer's "
                        "model.make_vocab_size_divisible_by")
    p.add_argument("--dry-run", action="store_true",
                   help="print per-rank shard sizes at --tp/--pp; read no weights")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not args.dry_run and not args.out:
        p.error("--out is required (unless --dry-run)")
    return args


def dry_run(args) -> None:
    from megatron_dapo.config import ModelConfig
    from megatron_dapo.mcore import padded_vocab_size  # arithmetic only: megatron is not imported

    config = read_hf_config(args.hf_dir)
    divisible_by = args.make_vocab_size_divisible_by or ModelConfig().make_vocab_size_divisible_by
    padded = padded_vocab_size(config["vocab_size"], divisible_by, args.tp)
    print(f"{config.get('architectures')} at TP={args.tp} PP={args.pp}, vocabulary {config['vocab_size']} "
          f"padded to {padded}, {args.dtype or 'bf16'}:")
    rows = shard_plan(config, tp=args.tp, pp=args.pp, padded_vocab_size=padded)
    print(format_shard_plan(rows, bytes_per_param=4 if args.dtype == "fp32" else 2))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.dry_run:
            dry_run(args)
            return 0
        from megatron_dapo.mcore.hf_conversion import hf_to_megatron

        meta = hf_to_megatron(args.hf_dir, args.out, dtype=args.dtype, tp=args.tp, pp=args.pp,
                              force=args.force, progress=not args.no_progress,
                              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    except ConversionError as e:
        print(f"hf_to_megatron: error: {e}", file=sys.stderr)
        return 2
    import resource

    import torch.distributed as dist

    # Peak resident memory of every rank (what a node must hold per process), gathered to rank 0.
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_mb)
    if dist.get_rank() == 0:
        print(f"wrote {args.out}: {meta['architecture']}, {meta['dtype']}, vocabulary {meta['vocab_size']} "
              f"(padded to {meta['padded_vocab_size']}) at TP={args.tp} PP={args.pp}; peak RSS per rank: "
              + ", ".join(f"{p:.0f} MB" for p in peaks))
    return 0


if __name__ == "__main__":  # the converter may start torch.distributed and child processes: never on import
    code = main()
    from megatron_dapo.mcore.parallel import shutdown_distributed

    shutdown_distributed()  # gloo left alive can abort the interpreter at exit
    sys.exit(code)
