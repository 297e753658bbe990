"""Compare an HF model with its converted Megatron checkpoint: weights (bit-exact?) and logits.

    python tools/convert_ckpt/verify.py --hf-dir Qwen2.5-0.5B --ckpt ckpt/qwen2.5-0.5b
    torchrun --nproc-per-node 2 tools/convert_ckpt/verify.py --hf-dir D --ckpt C --tp 2   # N x M processes

Prints a per-tensor table and the max absolute logit difference on fixed prompts; exits 1 when a
weight differs or the logits differ by more than --atol (default 1e-5 for fp32, 5e-2 for bf16).
"""

import argparse
import sys

from megatron_dapo.convert import ConversionError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="the HF model dir the checkpoint was converted from")
    p.add_argument("--ckpt", required=True, help="checkpoint dir written by hf_to_megatron.py")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size to load the checkpoint at")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to load the checkpoint at")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallel size to load an MoE checkpoint at (of the data-parallel processes)")
    p.add_argument("--atol", type=float, help="max allowed |logit difference|")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per prompt")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch.distributed as dist

        from megatron_dapo.mcore.logit_check import verify

        report = verify(args.hf_dir, args.ckpt, tp=args.tp, pp=args.pp, ep=args.ep, atol=args.atol,
                        seq_len=args.seq_len)
    except ConversionError as e:
        print(f"verify: error: {e}", file=sys.stderr)
        return 2
    if dist.get_rank() == 0:
        print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    code = main()
    from megatron_dapo.mcore.parallel import shutdown_distributed

    shutdown_distributed()  # gloo left alive can abort the interpreter at exit
    sys.exit(code)
