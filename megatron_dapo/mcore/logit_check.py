"""Numerical check of a conversion: HF model vs the converted Megatron checkpoint at some TP / PP.

Two comparisons, in the spirit of Megatron-Bridge's ``weights_verification_table``:
  * weights: every HF tensor against the same tensor streamed back out of the loaded Megatron
    model (``export_hf_weights``), so a layout error is named by tensor;
  * logits: both models on the same fixed token-id prompts (seeded; the tests' models have no
    tokenizer), Megatron's vocab-parallel logits gathered over TP and stripped of padding rows.
Rank 0 loads the HF model and compares; every rank of the job gets the verdict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_dapo.convert import fused_experts
from megatron_dapo.convert.export import export_hf_weights
from megatron_dapo.convert.safetensors_io import SafetensorsReader
from megatron_dapo.mcore.cpu_compat import apply_cpu_compat
from megatron_dapo.mcore.hf_conversion import load_megatron_checkpoint

DEFAULT_ATOL = {"fp32": 1e-5, "bf16": 5e-2}


@dataclass
class VerifyReport:
    max_logit_diff: float
    atol: float
    weight_rows: list[tuple[str, tuple[int, ...], str, float]] = field(default_factory=list)

    @property
    def weights_ok(self) -> bool:
        return all(diff == 0.0 for *_, diff in self.weight_rows)

    @property
    def ok(self) -> bool:
        return self.weights_ok and self.max_logit_diff <= self.atol

    def format(self) -> str:
        width = max([len(r[0]) for r in self.weight_rows] + [6])
        lines = [f"{'tensor':<{width}}  {'shape':<16} {'dtype':<9} {'max |diff|':>10}  ok"]
        for name, shape, dtype, diff in self.weight_rows:
            ok = "yes" if diff == 0 else "NO"
            lines.append(f"{name:<{width}}  {str(shape):<16} {dtype:<9} {diff:>10.3g}  {ok}")
        lines.append(f"weights: {sum(r[3] == 0 for r in self.weight_rows)}/{len(self.weight_rows)} bit-exact")
        lines.append(f"max |logit diff| = {self.max_logit_diff:.3g} (tolerance {self.atol:g}): "
                     f"{'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def fixed_prompts(vocab_size: int, *, batch: int = 2, seq_len: int = 16, seed: int = 1234) -> torch.Tensor:
    """[batch, seq_len] token ids, the same on every rank and every run."""
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def megatron_logits(chunks, ids: torch.Tensor, tp_group) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, padded_vocab] on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device
    ids = ids.to(device)
    pos = torch.arange(ids.shape[1], device=device).expand_as(ids).contiguous()

    def step(data_iterator, model):
        out = model(next(data_iterator), pos, None)
        return out, lambda output, non_loss_data=False: output

    for c in chunks:
        c.eval()
    outputs = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([ids]), model=chunks, num_microbatches=1,
        seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True,
        collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    local = outputs[0].float()  # [b, s, V / TP]
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(pieces, local.contiguous(), group=tp_group)
    return torch.cat(pieces, dim=-1)


def verify(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1, ep: int = 1,
           atol: float | None = None, batch: int = 2, seq_len: int = 16) -> VerifyReport:
    """Load ``ckpt_dir`` at TP x PP (x EP: an MoE model's experts split over that many of the
    data-parallel ranks), compare weights and logits with ``hf_dir``; collective."""
    apply_cpu_compat()  # an entry point: before megatron.core is imported
    from megatron.core import parallel_state as ps

    chunks, table, tp_group, pp_group, meta = load_megatron_checkpoint(ckpt_dir, tp=tp, pp=pp, ep=ep)
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    rank = dist.get_rank()
    reader = SafetensorsReader(hf_dir) if rank == 0 else None
    rows = []
    for name, tensor in export_hf_weights(chunks, table, tp_group=tp_group, pp_group=pp_group, ep_group=ep_group,
                                          device="cpu"):
        if reader is not None:
            ref = reader.get(name)
            same_shape = ref.shape == tensor.shape
            diff = (ref.float() - tensor.float()).abs().max().item() if same_shape else float("inf")
            rows.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), diff))

    ids = fixed_prompts(table.dims.vocab_size, batch=batch, seq_len=seq_len)
    logits = megatron_logits(chunks, ids, tp_group)
    # One last-stage rank hands its logits to rank 0 (which may sit on another stage).
    is_owner = (logits is not None and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)
    device = next(chunks[0].parameters()).device  # collectives on the backend's device (NCCL: GPU)
    owner = torch.tensor(rank if is_owner else dist.get_world_size(), device=device)
    dist.all_reduce(owner, op=dist.ReduceOp.MIN)
    buf = logits if is_owner else torch.empty(ids.shape + (table.dims.padded_vocab_size,), device=device)
    if owner.item() != 0:
        dist.broadcast(buf, src=owner.item())
    diff = torch.zeros((), device=device)
    if rank == 0:
        hf_logits = _hf_logits(hf_dir, ids, meta["dtype"])
        diff.fill_((buf[..., : table.dims.vocab_size].cpu() - hf_logits).abs().max().item())
    dist.broadcast(diff, src=0)
    return VerifyReport(diff.item(), DEFAULT_ATOL[meta["dtype"]] if atol is None else atol, rows)


@torch.no_grad()
def _hf_logits(hf_dir, ids: torch.Tensor, dtype: str) -> torch.Tensor:
    """Logits of the transformers model. Built with from_config and filled from the safetensors
    files rather than from_pretrained: from_pretrained's meta-device init yielded garbage RoPE
    buffers depending on the order in which the CPU compatibility layer was applied and this module
    was imported, while a plain constructor does not depend on import order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    params = model.state_dict(keep_vars=True)
    with SafetensorsReader(hf_dir) as reader:  # per-expert tensors fill fused parameters: fused_experts
        names = reader.names()
        unexpected = [name for name in names if fused_experts.target(params, name) is None]
        for name in names:
            if name not in unexpected:
                fused_experts.target(params, name).data.copy_(reader.get(name))
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(params) - fused_experts.fused_names(params, names) - tied)
    if missing or unexpected:
        raise RuntimeError(f"HF model vs {hf_dir}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()(ids).logits.float()
