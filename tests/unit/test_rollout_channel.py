"""rollout/channel.py's Channel between real gloo groups (the members as threads of one process, over
a real TCPStore): a message that comes later than the group's collective timeout still arrives (the
receiver waits in the store, not in the broadcast); a sender that closes the channel ends the
receivers' wait at once; a receiver waiting past its own limit says for whom it waited."""

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from megatron_dapo.rollout.channel import Channel, ChannelClosed, WaitTimeout

COLLECTIVE_S = 1.0  # every gloo collective's timeout here


@pytest.fixture
def members(request):
    """Two channels over one gloo group and a TCPStore: (sender, receiver)."""
    port = 29700 + (hash(request.node.name) % 200)
    server = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    groups: list = [None, None]

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, 1, False)
        groups[rank] = (client, dist.ProcessGroupGloo(dist.PrefixStore("g/", client), rank, 2,
                                                      datetime.timedelta(seconds=COLLECTIVE_S)))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    channels = [Channel(dist.PrefixStore("c/", client.clone()), group, wait_s=10.0, waits_for="trainer rank 0")
                for client, group in groups]
    yield channels
    del server


def _receiving(receiver, count: int) -> tuple[threading.Thread, list]:
    """A thread receiving ``count`` messages (a member is a process of its own in a run: the sender's
    broadcast waits for the receivers to join it)."""
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(receiver.receive() for _ in range(count)))
    thread.start()
    return thread, got


def test_a_message_later_than_the_collective_timeout_arrives(members):
    sender, receiver = members
    thread, got = _receiving(receiver, 2)
    time.sleep(3 * COLLECTIVE_S)  # a collective waiting this long would have failed
    sender.send({"request": 7})
    sender.send("next")  # in order, and the channel goes on
    thread.join(timeout=10)
    assert got == [{"request": 7}, "next"]


def test_a_closed_channel_ends_the_receivers_wait_at_once(members):
    sender, receiver = members
    thread, got = _receiving(receiver, 1)
    sender.send("first")
    thread.join(timeout=10)
    assert got == ["first"]
    errors = []

    def wait() -> None:
        try:
            receiver.receive()
        except ChannelClosed as error:
            errors.append((time.monotonic(), error))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    closed = time.monotonic()
    sender.close()
    thread.join(timeout=5)
    assert errors and errors[0][0] - closed < 1.0 and "trainer rank 0 ended" in str(errors[0][1])


def test_a_receiver_gives_up_after_its_limit_naming_whom_it_waited_for(members):
    _, receiver = members
    receiver.wait_s = 0.5
    with pytest.raises(WaitTimeout, match=r"waited 0.0 min for message 1 from trainer rank 0 "
                                          r"\(rollout.wait_timeout_minutes"):
        receiver.receive()
