"""A weight version from trainer rank 0 to every engine rank of a separate placement.

Every trainer rank runs the export (its gathers are collectives of the training world); trainer rank
0 sends each bucket of (HF name, full tensor) pairs as a header (names, shapes, dtypes: pickled, on
the ``stream`` gloo group) and one flat byte tensor (on the ``transfer`` group: NCCL on GPU, gloo on
CPU), so a sync is a header and one broadcast a bucket whatever the number of tensors in it. An
engine rank receives in its worker thread, the one thread that drives its device (rollout/
engine_server.py), and hands each bucket to the same ``engine.update_weights`` a colocated sync uses
before the next arrives: an engine rank holds one bucket of the stream at a time (on its device on
a GPU), never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_dapo.rollout.channel import broadcast_object
from megatron_dapo.rollout.weight_sync import bucketed, count_bucket, finish_update, new_counts

_END = "end"  # the header that closes a weight stream
_GAVE_UP = "gave up"  # the header trainer rank 0 sends when the export failed mid-stream

Header = list[tuple[str, tuple[int, ...], torch.dtype]]


def pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[Header, torch.Tensor]:
    """A bucket as (names, shapes and dtypes; [total bytes] uint8: the tensors' bytes in order)."""
    header = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    flat = (torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket]) if bucket
            else torch.empty(0, dtype=torch.uint8))
    return header, flat


def _sizes(header: Header) -> tuple[list[int], list[int]]:
    """(each tensor's element size, its bytes)."""
    items = [torch.empty((), dtype=dtype).element_size() for _, _, dtype in header]
    return items, [torch.Size(shape).numel() * item for (_, shape, _), item in zip(header, items)]


def unpack(header: Header, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``pack``'s inverse: views into ``flat`` where aligned (a piece after a narrower dtype may
    start off its own alignment, and is copied then)."""
    items, sizes = _sizes(header)
    pieces = [p if p.storage_offset() % item == 0 else p.clone()
              for p, item in zip(torch.split(flat, sizes), items)]
    return [(name, piece.view(dtype).view(shape)) for (name, shape, dtype), piece in zip(header, pieces)]


def _bytes(links, tensor: torch.Tensor) -> None:
    """Trainer rank 0's ``tensor`` into every member's, on the transfer group (in place). On a GPU the
    CPU waits for it too: NCCL's wait only orders the stream, and a loop that ran ahead of the
    transfer would hold several buckets (each alive until its broadcast ends) instead of one."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    links.transfer.broadcast([tensor], opts).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def reserve_bucket(links, bucket_bytes: int) -> None:
    """Engine side, before it says it is ready for a stream: a bucket's memory, allocated once and
    given back to the caching allocator, so a device without room fails here, where trainer rank 0
    reads the failure before it streams, not in the middle of a broadcast (a bucket holding one
    tensor larger than the bucket size still allocates that tensor's size during the stream)."""
    if bucket_bytes and links.device.type == "cuda":
        torch.empty(bucket_bytes, dtype=torch.uint8, device=links.device)


def send_weights(links, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> dict[str, int]:
    """Trainer side: every trainer rank consumes ``weights`` (the export's collectives); trainer rank
    0 (``links``: its rollout/worlds.EngineLinks; None on the other trainer ranks) sends each bucket
    to the engines, which must be receiving (SeparatePlacement.sync). Returns the counts
    sync_weights returns. When the export fails mid-stream the engines are told, so that they fail
    at once instead of waiting for the next bucket."""
    stats = new_counts()
    try:
        for bucket in bucketed(weights, bucket_bytes):
            count_bucket(stats, bucket)
            if links is not None:
                header, flat = pack(bucket)
                broadcast_object(links.stream, header)
                _bytes(links, flat.to(links.device))
    except BaseException:
        if links is not None:
            try:
                broadcast_object(links.stream, _GAVE_UP)
            except Exception:  # noqa: BLE001 -- the export's own error is the one to report
                pass
        raise
    if links is not None:
        broadcast_object(links.stream, _END)
    return stats


def receive_weights(links, engine) -> dict[str, int]:
    """Engine side, in the worker thread: the buckets of one ``send_weights``, each into
    ``engine.update_weights`` as it arrives, then ``engine.finish_weight_update()``. Returns the
    same counts. An engine that fails to load a bucket still receives the rest of the stream (trainer
    rank 0 is sending it: leaving would strand it in a broadcast) and raises its error at the end,
    which trainer rank 0 then reads from the progress counters."""
    stats, failed = new_counts(), None
    while (header := broadcast_object(links.stream)) != _END:
        if header == _GAVE_UP:
            raise RuntimeError("the trainers gave up in the middle of a weight stream (a trainer failed "
                               "while exporting; its own error says why)")
        flat = torch.empty(sum(_sizes(header)[1]), dtype=torch.uint8, device=links.device)
        _bytes(links, flat)
        if failed is None:
            try:
                bucket = unpack(header, flat)
                engine.update_weights(bucket)
                count_bucket(stats, bucket)
                del bucket
            except Exception as error:  # noqa: BLE001 -- raised once the stream has ended
                failed = error
        del flat  # one bucket at a time: the next is received into memory of its own
    if failed is not None:
        raise failed
    finish_update(engine)
    return stats
