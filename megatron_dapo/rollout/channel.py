"""Messages between processes that may wait for one another for a long time, and objects over gloo.

A rank that waits for another across a generation batch or a training phase (an engine rank for
trainer rank 0's next request, trainer ranks for rank 0's answer while it waits for the engines)
must not wait inside a collective: every process group's collectives time out
(``parallel.timeout_minutes``: NCCL's watchdog, gloo's own), and a 32B generation batch lasts longer
than a collective should ever wait (45 min on H100 in the plan). So a ``Channel`` message from its
rank 0 is two parts:

    sender       store.set(<n>)  ------------------->  gloo broadcast of message n
    receivers    store.wait(<n>), up to wait_s  ---->  gloo broadcast of message n

The receivers wait for key n in the launch's rendezvous store, a wait with its own limit (twice
``rollout.wait_timeout_minutes``: the sender's own waits give up first, with the better message),
then join the broadcast, which by then waits only for the sender to pickle the message. A blocking
store wait holds its store client for its whole length, so each channel (and anything else a second
thread of the process uses) takes a client of its own (``Store.clone``). Keys are never reused: a
message's key is its sequence number. They stay in the store (tens of bytes each, about ten a step
on each channel: ~12 MB over 10,000 steps), since nothing tells the sender when the last receiver
has read one.

A sender that fails (or abandons a step at a stop) ``close``s the channel: the next key holds a
mark instead of a message, and the receivers raise ``ChannelClosed`` at once instead of waiting out
their limit (a gloo group's abort does not wake a peer waiting on it; only the peer's exit would).

The object helpers pickle into uint8 tensors on gloo groups made by hand (process group objects
that torch.distributed's registry does not know, so its ``*_object`` functions cannot take them).
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist


def pickled(obj) -> torch.Tensor:
    """[bytes] uint8: ``obj`` pickled."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def unpickled(data: torch.Tensor):
    return pickle.loads(data.cpu().numpy().tobytes())


def broadcast_object(group, obj=None, *, root: int = 0):
    """``root``'s ``obj`` on every member of ``group`` (a gloo group object): a length, then the bytes."""
    mine = group.rank() == root
    data = pickled(obj) if mine else None
    size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64)
    _broadcast(group, size, root)
    buffer = data if mine else torch.empty(int(size), dtype=torch.uint8)
    _broadcast(group, buffer, root)
    return obj if mine else unpickled(buffer)


def _broadcast(group, tensor: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    group.broadcast([tensor], opts).wait()


def send_object(group, obj, dst: int) -> None:
    """``obj`` to member ``dst`` of ``group`` alone (``recv_object`` there): a length, then the bytes."""
    data = pickled(obj)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
    group.send([data], dst, 1).wait()


def recv_object(group, src: int):
    """What member ``src`` of ``group`` sent with ``send_object``."""
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, 0).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    group.recv([data], src, 1).wait()
    return unpickled(data)


def gather_objects(group, members: int, device: torch.device, obj) -> list:
    """Every member's ``obj`` over ``group`` (a process group object of ``members`` ranks, its
    tensors on ``device``), in its rank order, on every member: the lengths, then the bytes padded
    to the longest. For small objects (GPU bindings, run metadata)."""
    data = pickled(obj).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(members)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    group.allgather([sizes], [mine]).wait()
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(members)]
    group.allgather([parts], [padded]).wait()
    return [unpickled(p[:int(s.item())]) for p, s in zip(parts, sizes)]


class WaitTimeout(TimeoutError):
    """A wait across the other side's work outlasted ``rollout.wait_timeout_minutes``."""


class ChannelClosed(RuntimeError):
    """The sender closed the channel: it failed, or left at a stop."""


_CLOSED = b"closed"  # the value of a key that stands where the next message would have


class Channel:
    """Messages from member 0 of ``group`` to all its members (module doc).

    Args:
        store: a store client of this channel's own (a prefix of the launch's store, cloned).
        group: a gloo group object over the members; member 0 sends.
        wait_s: how long a receiver waits for the next message before it gives up.
        waits_for: who a receiver waits for, in the timeout's message ("trainer rank 0").
    """

    def __init__(self, store, group, *, wait_s: float, waits_for: str):
        self.store, self.group, self.wait_s, self.waits_for = store, group, wait_s, waits_for
        self.count = 0  # messages sent (member 0) or received (the others) so far

    @property
    def size(self) -> int:
        return self.group.size()

    def send(self, message) -> None:
        """Member 0: ``message`` to every other member."""
        self.count += 1
        self.store.set(str(self.count), b"")
        broadcast_object(self.group, message)

    def close(self) -> None:
        """Member 0, after a failure: the receivers' next ``receive`` raises ChannelClosed. Never
        waits (a store write), so it is safe on any exit path."""
        self.store.set(str(self.count + 1), _CLOSED)

    def receive(self):
        """The others: the next message, waiting for it in the store (up to ``wait_s``)."""
        self.count += 1
        key = str(self.count)
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.wait_s))
        except dist.DistStoreError as error:
            if "timeout" not in str(error).lower():
                raise
            raise WaitTimeout(f"member {self.group.rank()} waited {self.wait_s / 60:.1f} min for message "
                              f"{self.count} from {self.waits_for} (rollout.wait_timeout_minutes; "
                              f"{self.waits_for}'s log says what it was doing)") from error
        if self.store.get(key) == _CLOSED:
            raise ChannelClosed(f"{self.waits_for} ended without finishing the run (it failed, or left at a "
                                f"stop: its log says which)")
        return broadcast_object(self.group)
