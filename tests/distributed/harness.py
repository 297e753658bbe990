"""The 2-process CPU tests' harness: the gloo launcher and weight sharding by hand. The tiny Qwen2
config and the other helpers shared beyond tests/distributed are in tests/helpers/.

Weights move between layouts here without megatron_dapo.convert, so that the parallel model is
checked against an independent statement of Megatron's layout (megatron-core 0.19.2):
  * column-parallel params (``partition_dim == 0``) are split along dim 0: linear_qkv weight and
    bias (whole KV groups per rank), vocabulary rows of the embedding and output layer;
  * the gated ``linear_fc1`` holds ``[gate; up]`` at TP=1 but ``[gate_r; up_r]`` on rank r;
  * row-parallel params (``partition_dim == 1``: linear_proj, linear_fc2) are split along dim 1;
  * everything else (norms) is replicated;
  * vocabulary padding rows (to a multiple of lcm(divisible_by, TP), mcore.model) are zero.
"""

from __future__ import annotations

import os
import re
import socket
import traceback

import torch
import torch.multiprocessing as mp

from tests.helpers.policy import VOCAB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args, world_size: int = 2, init: bool = True) -> None:
    """Run fn(rank, *args) in world_size fresh processes over gloo; re-raise the first failure.
    ``init=False``: the launcher's variables only, fn starts torch.distributed itself."""
    mp.spawn(_entry, args=(fn, world_size, _free_port(), args, init), nprocs=world_size, join=True)


def _entry(rank, fn, world_size, port, args, init=True):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    import torch.distributed as dist

    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # a fresh interpreter: before anything imports megatron.core
    from megatron_dapo.mcore.parallel import destroy_parallel

    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        destroy_parallel()


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def global_name(chunk, name: str) -> str:
    """decoder.layers.<local i>.x -> decoder.layers.<global i>.x (PP/VPP number layers per chunk)."""
    m = _LAYER.match(name)
    if not m:
        return name
    return f"decoder.layers.{chunk.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}"


def shard(full: torch.Tensor, param, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a TP=1 tensor, in the layout of ``param`` (see the module docstring)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
    if dim == 0 and full.shape[0] < param.shape[0] * tp_size:  # vocabulary padding rows
        pad = full.new_zeros(param.shape[0] * tp_size - full.shape[0], *full.shape[1:])
        full = torch.cat([full, pad])
    return full.chunk(tp_size, dim)[tp_rank]


def full_params(chunks) -> dict[str, torch.Tensor]:
    """{global name: detached copy} of a TP=1 model's parameters."""
    return {global_name(c, n): p.detach().clone() for c in chunks for n, p in c.named_parameters()}


def load_full(chunks, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int, vocab_key_for_output=None):
    """Copy TP=1 weights into (possibly TP/PP-sharded) model chunks."""
    with torch.no_grad():
        for c in chunks:
            for n, p in c.named_parameters():
                key = global_name(c, n)
                if key not in full and vocab_key_for_output and key == "output_layer.weight":
                    key = vocab_key_for_output  # tied embeddings: the last stage's copy
                p.copy_(shard(full[key], p, n, tp_rank, tp_size))


def make_batch(seed: int, batch: int, seq: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Token ids, next-token targets, a ragged response mask and per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq)
    for i in range(batch):  # prompt of 3 tokens, then a response of varying length
        mask[i, 3: seq - 1 - i] = 1.0
    return dict(ids=ids, pos=torch.arange(seq).expand(batch, seq).contiguous(),
                targets=torch.roll(ids, -1, dims=1), mask=mask,
                adv=torch.randn(batch, generator=g), noise=0.3 * torch.randn(batch, seq, generator=g))


def assert_close(actual, expected, what: str, atol: float = 2e-6, rtol: float = 1e-4):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
