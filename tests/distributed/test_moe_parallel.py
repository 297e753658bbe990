"""A tiny Qwen3-MoE (4 experts, top-2) converted once at TP=1 by the CLIs, then loaded at EP=2 (2
processes), TP=2 x EP=2 and PP=2 x EP=2 (4 processes): the weights streamed back out of the model equal
the HF files bit for bit on every rank (verify compares them on rank 0; here every rank also checks
its own stream, in small buckets), and the logits match transformers' within 1e-5 in fp32, both for
verify's prompts and for each data-parallel rank's own prompts (each EP rank routes its own tokens
through experts held by the other). norm_topk_prob=false (a softmax over all experts before the
top-k, megatron's moe_router_pre_softmax) is checked through the verify CLI at EP=2. Gloo processes.

Measured on 2 shared cores, OMP_NUM_THREADS=1: the conversion 5-7 s, EP=2 13-15 s, TP2 x EP2 and
PP2 x EP2 25-27 s each (4 processes on 2 cores), the norm_topk_prob=false case 15-16 s (its own
conversion and the CLI); the module ~90 s.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "convert_ckpt"
VOCAB = 100


def _run(*cmd, nproc=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    prefix = [sys.executable] if nproc is None else [sys.executable, "-m", "torch.distributed.run",
                                                     f"--nproc-per-node={nproc}", "--standalone"]
    return subprocess.run(prefix + [str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=300)


def _convert(root: Path, norm_topk_prob: bool = True) -> tuple[Path, Path]:
    """(HF dir, Megatron checkpoint) of tests/helpers/moe.py's tiny Qwen3-MoE, via hf_to_megatron.py."""
    from tests.helpers.moe import save_tiny_moe

    hf = save_tiny_moe(root / "hf", norm_topk_prob=norm_topk_prob)
    done = _run(TOOLS / "hf_to_megatron.py", "--hf-dir", hf, "--out", root / "ckpt", "--no-progress",
                "--make-vocab-size-divisible-by", "64")
    assert done.returncode == 0, done.stderr[-3000:]
    return hf, root / "ckpt"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return _convert(tmp_path_factory.mktemp("qwen3_moe"))


def _worker(rank, hf, ckpt, tp, pp, ep):
    from megatron.core import parallel_state as ps

    from megatron_dapo.convert.export import export_hf_weights
    from megatron_dapo.convert.safetensors_io import SafetensorsReader
    from megatron_dapo.mcore.hf_conversion import load_megatron_checkpoint
    from megatron_dapo.mcore.logit_check import _hf_logits, fixed_prompts, megatron_logits, verify

    report = verify(hf, ckpt, tp=tp, pp=pp, ep=ep)
    assert report.max_logit_diff <= 1e-5, report.max_logit_diff
    if rank == 0:
        assert report.ok and len(report.weight_rows) == 45, report.format()  # 2 x (9 + 3 x 4 experts) + 3
    assert ps.get_expert_model_parallel_world_size() == ep

    chunks, table, tp_group, pp_group, _ = load_megatron_checkpoint(ckpt, tp=tp, pp=pp, ep=ep)
    ep_group = ps.get_expert_model_parallel_group()
    with SafetensorsReader(hf) as ref:  # every rank's stream, many small buckets
        names = []
        for name, tensor in export_hf_weights(chunks, table, tp_group=tp_group, pp_group=pp_group,
                                              ep_group=ep_group, bucket_bytes=20_000, dtype=torch.float32):
            assert torch.equal(tensor, ref.get(name)), f"rank {rank}: {name}"
            names.append(name)
        assert sorted(names) == sorted(ref.names()) and len(names) == len(set(names))

    # each data-parallel rank's own prompts: its tokens meet the experts of the other EP rank
    ids = fixed_prompts(VOCAB, seed=100 + ps.get_data_parallel_rank())
    logits = megatron_logits(chunks, ids, tp_group)
    if logits is not None:  # the last stage
        diff = (logits[..., :VOCAB] - _hf_logits(hf, ids, "fp32")).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: max |logit diff| {diff}"


def test_ep2_weights_bit_exact_and_logits_match(converted):
    spawn(_worker, *map(str, converted), 1, 1, 2, world_size=2)


# PP 2 x EP 2 is extended: EP's expert broadcast is TP 2 x EP 2's, and PP's stage broadcast every dense PP test's
@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.extended)], ids=["tp2_ep2", "pp2_ep2"])
def test_ep2_with_tp2_or_pp2_on_four_processes(converted, tp, pp):
    spawn(_worker, *map(str, converted), tp, pp, 2, world_size=4)


@pytest.mark.extended  # the routing rule in one process: tests/unit/test_moe_logits.py
def test_norm_topk_prob_false_through_the_verify_cli_at_ep2(tmp_path):
    """Without renormalisation the top-k weights are the full softmax's (megatron's moe_router_pre_softmax):
    swapped, the logits differ by ~6e-3 and verify fails."""
    hf, ckpt = _convert(tmp_path, norm_topk_prob=False)
    done = _run(TOOLS / "verify.py", "--hf-dir", hf, "--ckpt", ckpt, "--ep", "2", nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "weights: 45/45 bit-exact" in done.stdout and "PASS" in done.stdout
    diff = float(done.stdout.split("max |logit diff| = ")[1].split()[0])
    assert diff <= 1e-5
