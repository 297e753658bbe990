"""Process pool that scores (response, ground_truth) pairs with a wall-time bound per item.

sympy can hang on adversarial answers (e.g. 9^{9^{9^{9}}}), and math-verify's own timeouts use
signal.alarm, which fails off the main thread (docs/reference/megatron_on_cpu.md item 7). So items run
in worker processes, and a worker stuck on one item for more than `timeout_s` is killed and
replaced.

Design:
- Each worker has its own duplex pipe. The parent sends chunks of up to `chunk_size` items and
  keeps at most two chunks in flight per worker, so IPC is paid per chunk and workers never wait.
  The second chunk waits in the socket buffer. If it would not fit (PIPELINE_MAX_BYTES), the
  parent waits until the worker is idle: a blocking send to a stuck worker would stall the
  parent and with it every timeout.
- A worker runs its items in the order they were sent. It sends results in batches: at the end
  of a chunk, or after an item finishes once FLUSH_INTERVAL_S has passed since the last send.
  So the running item started less than FLUSH_INTERVAL_S after the worker's last message (or
  after the chunk was sent to an idle worker). When the parent has heard nothing for
  timeout_s + FLUSH_INTERVAL_S, the running item has had at least timeout_s.
- Before each item the worker writes its index to a shared integer. After a kill, that integer
  names the item that hung. Only that item is scored as timed out. The rest of the worker's
  queue goes back to the shared queue, including items it finished but had not sent yet.
- Workers use the "spawn" start method: nothing from the parent (threads, CUDA, locks) leaks into
  them, and they can be started from any thread. Each worker imports math-verify and warms its
  parser before it reports ready, so startup never counts against an item.
- Responses are cut to their last `max_response_chars` characters before they are sent.
  compute_score reads only that tail, so its results do not change. This avoids pickling 60k
  characters per response. Set it to None for score functions that read the whole text.
- One pool can hold several score functions (`score_fns`, by name); each call of score() picks
  one (`fn`), and each chunk names it. So training and evaluation scorers share the same worker
  processes instead of one pool per scorer (2-core machines).
- A score function may have a quick companion (`quick_fns`, same names): bounded pure Python that
  returns the result where it can decide without the slow path (math-verify), else None. It runs
  in the calling process first and only its None items go to the workers: the prompted
  "Answer: 42" costs microseconds inline against a round trip to a worker, and what could hang
  still runs under the time limit.
"""

import collections
import logging
import math
import multiprocessing
import pickle
import signal
import threading
import time
import weakref
from multiprocessing.connection import wait

from megatron_dapo.reward import math_dapo
from megatron_dapo.reward.math_dapo import TAIL_CHARS, compute_score

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # the trainer's (preemption.py), not a worker's
FLUSH_INTERVAL_S = 0.02  # result latency vs per-message cost; also the timeout's extra slack
# Linux buffers ~180 KiB per socket direction by default (net.core.wmem_default); stay well below.
PIPELINE_MAX_BYTES = 64 * 1024
_READY = "ready"


def _failed(timed_out: bool) -> dict:
    return {"score": -1.0, "acc": False, "pred": "", "timed_out": timed_out}


def _quick_one(quick_fn, response, ground_truth) -> dict | None:
    """The quick companion's result (None: undecided, or it raised: the worker decides)."""
    try:
        result = quick_fn(response, ground_truth)
    except Exception:  # noqa: BLE001 - the full score fn, in a worker, has the last word
        return None
    return None if result is None else {**result, "timed_out": False}


def _score_one(score_fn, response, ground_truth) -> dict:
    try:
        result = dict(score_fn(response, ground_truth))
    except Exception:  # noqa: BLE001 - one bad item must not take the batch down
        return _failed(False)
    result["timed_out"] = False
    return result


def _worker_main(conn, current, score_fns) -> None:
    """Worker loop: receive (fn name, chunk of (index, response, ground_truth)), send [(index, result)]."""
    # Stop signals reach the workers too: Ctrl-C the whole process group, SLURM's --signal=USR1 and
    # its time-limit TERM every process of the job step. Stopping is the trainer's call
    # (preemption.py): a worker killed mid-item would score that item as failed and change the
    # step's groups (a resumed run then no longer equals an uninterrupted one). When the trainer
    # dies, the pipe breaks and the worker ends quietly (below); the pool itself stops workers with
    # SIGKILL, so a kill leaves no worker behind. A signal in the worker's first ~0.1 s (its
    # interpreter booting, before this line) still ends it; the pool reports that as a failed start.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        _serve(conn, current, score_fns)
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the parent went away
        return


def _serve(conn, current, score_fns) -> None:
    # We bound time ourselves, so math-verify's "timeout is disabled" warning is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    math_dapo.warm_up()
    conn.send(_READY)
    while True:
        chunk = conn.recv()
        if chunk is None:
            return
        fn_name, chunk = chunk
        score_fn = score_fns[fn_name]
        done, last_send = [], time.monotonic()
        for index, response, ground_truth in chunk:
            current.value = index
            done.append((index, _score_one(score_fn, response, ground_truth)))
            if time.monotonic() - last_send >= FLUSH_INTERVAL_S:
                conn.send(done)
                done, last_send = [], time.monotonic()
        if done:
            conn.send(done)
        current.value = -1


class _Worker:
    """Parent-side handle: process, pipe, shared current index, and the indices it still owes."""

    def __init__(self, ctx, score_fns):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.current = ctx.RawValue("q", -1)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, self.current, score_fns), daemon=True
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.pending = collections.deque()  # indices sent and not yet answered, in order
        self.heard_at = time.monotonic()  # last message, or dispatch to an idle worker

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()  # SIGKILL: works even inside a long C call (big-int pow)
        self.process.join()
        self.process.close()  # frees the sentinel fd; a long run may replace many workers


def _shutdown(workers: list) -> None:
    for worker in workers:
        try:
            worker.conn.send(None)
        except OSError:
            pass
    for worker in workers:
        if worker.ready:  # a worker still starting up would read None only after its imports
            worker.process.join(timeout=2.0)
        worker.kill()
        worker.conn.close()


class RewardPool:
    """Scores batches in `num_workers` processes; each item gets at most `timeout_s` seconds.

    An item that runs longer is scored incorrect ({"score": -1.0, "acc": False, "pred": ""}),
    marked `timed_out: True` and counted in `num_timeouts` (all calls) and `last_num_timeouts`
    (latest call); its worker is killed and restarted. It is detected at most FLUSH_INTERVAL_S
    late. Every other result has `timed_out: False`. A worker that dies (e.g. killed by the OOM
    killer) costs its current item the same way, counted in `num_crashes`.

    num_workers=0 scores inline in the calling process. That mode has NO timeout protection.
    It is meant for tests and debugging.

    `quick_fns` (by the names of `score_fns`, None for `score_fn`): bounded companions run inline
    first (module docstring); `num_quick` counts the items they decided (all calls).

    Thread-safe: calls from several threads are serialised. Use as a context manager or call
    close(). `score_fn` (the default of score()) and the values of `score_fns` (more scorers by
    name, picked with score(..., fn=name)) must be module-level functions, because workers import
    them by name.
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        score_fn=compute_score,
        max_response_chars: int | None = TAIL_CHARS,
        chunk_size: int = 32,
        start_timeout_s: float = 120.0,
        score_fns: dict | None = None,
        quick_fns: dict | None = None,
    ):
        if num_workers < 0 or timeout_s <= 0 or chunk_size < 1:
            raise ValueError(f"bad RewardPool args: {num_workers=}, {timeout_s=}, {chunk_size=}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.score_fn = score_fn
        self.score_fns = {None: score_fn, **(score_fns or {})}
        self.quick_fns = {k: v for k, v in (quick_fns or {}).items() if v is not None}
        unknown = sorted(map(str, set(self.quick_fns) - set(self.score_fns)))
        if unknown:
            raise ValueError(f"quick_fns {unknown} name no score fn of this pool")
        self.num_quick = 0
        self.max_response_chars = max_response_chars
        self.chunk_size = chunk_size
        self.start_timeout_s = start_timeout_s
        self.num_timeouts = 0
        self.last_num_timeouts = 0
        self.num_crashes = 0
        self._lock = threading.Lock()
        self._ctx = multiprocessing.get_context("spawn")
        self._workers = [_Worker(self._ctx, self.score_fns) for _ in range(num_workers)]
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stops the workers. Idempotent."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def wait_until_ready(self) -> None:
        """Blocks until every worker has started. Optional: score() waits for the workers anyway."""
        with self._lock:
            while not all(w.ready for w in self._workers):
                starting = [w for w in self._workers if not w.ready]
                handles = [w.conn for w in starting] + [w.process.sentinel for w in starting]
                wait(handles, timeout=self._seconds_to_next_deadline())
                for worker in starting:
                    self._drain(worker, [])
                    if not worker.ready and not worker.process.is_alive():
                        code = worker.process.exitcode
                        raise RuntimeError(f"reward worker died during startup (exit code {code})")
                self._enforce_deadlines([], collections.deque())  # raises after start_timeout_s

    def score(self, responses: list[str], ground_truths: list[str], fn: str | None = None) -> list[dict]:
        """Scores pairs with the score fn named ``fn`` (None: ``score_fn``); result i belongs to pair i."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if fn not in self.score_fns:
            names = sorted(k for k in self.score_fns if k)
            raise ValueError(f"RewardPool has no score fn {fn!r}; it has {names}")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self.last_num_timeouts = 0
            if self.max_response_chars is not None:
                responses = [r[-self.max_response_chars:] for r in responses]
            quick = self.quick_fns.get(fn)
            results = [_quick_one(quick, r, g) if quick else None for r, g in zip(responses, ground_truths)]
            todo = [i for i, r in enumerate(results) if r is None]
            self.num_quick += len(results) - len(todo)
            if not todo:
                return results
            if self.num_workers == 0:
                for i in todo:
                    results[i] = _score_one(self.score_fns[fn], responses[i], ground_truths[i])
                return results
            try:
                slow = self._score_in_workers([responses[i] for i in todo], [ground_truths[i] for i in todo], fn)
            except BaseException:
                # E.g. KeyboardInterrupt: busy workers would later answer for indices of this
                # aborted call, so they are replaced.
                for worker in [w for w in self._workers if w.pending]:
                    worker.kill()
                    worker.conn.close()
                    self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.score_fns)
                raise
            self.num_timeouts += self.last_num_timeouts
            for i, result in zip(todo, slow):
                results[i] = result
            return results

    def _score_in_workers(self, responses, ground_truths, fn) -> list[dict]:
        results = [None] * len(responses)
        todo = collections.deque(range(len(responses)))
        while todo or any(w.pending for w in self._workers):
            self._dispatch(todo, responses, ground_truths, fn)
            handles = {w.conn: w for w in self._workers}
            handles.update({w.process.sentinel: w for w in self._workers})
            for handle in wait(list(handles), timeout=self._seconds_to_next_deadline()):
                worker = handles[handle]
                if any(w is worker for w in self._workers):  # not replaced earlier in this loop
                    self._drain(worker, results)
                    if not worker.process.is_alive():
                        self._replace(worker, results, todo, timed_out=False)
            self._enforce_deadlines(results, todo)
        return results

    def _dispatch(self, todo, responses, ground_truths, fn) -> None:
        ready = [w for w in self._workers if w.ready]
        if not ready or not todo:
            return
        # Smaller chunks near the end of the batch keep the workers evenly loaded.
        chunk_len = max(1, min(self.chunk_size, math.ceil(len(todo) / (2 * len(ready)))))
        for worker in ready:
            while todo and len(worker.pending) < chunk_len:
                chunk = [todo.popleft() for _ in range(min(chunk_len, len(todo)))]
                items = [(i, responses[i], ground_truths[i]) for i in chunk]
                num_chars = sum(len(r) + len(str(g)) for _, r, g in items)  # a lower bound on bytes
                payload = None if num_chars > PIPELINE_MAX_BYTES else pickle.dumps((fn, items))
                if worker.pending and (payload is None or len(payload) > PIPELINE_MAX_BYTES):
                    todo.extendleft(reversed(chunk))  # send it once the worker is idle
                    break
                if not worker.pending:
                    worker.heard_at = time.monotonic()
                worker.pending.extend(chunk)
                try:
                    worker.conn.send_bytes(payload if payload is not None else pickle.dumps((fn, items)))
                except OSError:  # dead worker: its sentinel wakes the wait() above
                    break

    def _deadline(self, worker: _Worker) -> float | None:
        if not worker.ready:
            return worker.heard_at + self.start_timeout_s
        return worker.heard_at + self.timeout_s + FLUSH_INTERVAL_S if worker.pending else None

    def _seconds_to_next_deadline(self) -> float:
        deadlines = [d for d in map(self._deadline, self._workers) if d is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else self.timeout_s

    def _drain(self, worker: _Worker, results: list) -> None:
        """Reads every message the worker has sent."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                worker.heard_at = time.monotonic()
                if message == _READY:
                    worker.ready = True
                    continue
                for index, result in message:
                    assert worker.pending.popleft() == index, "worker answered out of order"
                    results[index] = result
        except (EOFError, OSError):  # died mid-message: what it had not sent is re-queued
            pass

    def _enforce_deadlines(self, results, todo) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            deadline = self._deadline(worker)
            if deadline is None or now <= deadline:
                continue
            if not worker.ready:
                raise RuntimeError(f"reward worker did not start within {self.start_timeout_s} s")
            self._replace(worker, results, todo, timed_out=True)

    def _replace(self, worker: _Worker, results: list, todo, timed_out: bool) -> None:
        """Kills `worker`, fails the item it was on, re-queues the rest, starts a new worker."""
        if not worker.ready:
            code = worker.process.exitcode
            raise RuntimeError(f"reward worker died during startup (exit code {code})")
        worker.kill()
        self._drain(worker, results)  # results sent just before the kill still count
        worker.conn.close()
        if worker.pending:
            culprit = worker.current.value
            if culprit not in worker.pending:
                culprit = worker.pending[0]
            worker.pending.remove(culprit)
            results[culprit] = _failed(timed_out)
            if timed_out:
                self.last_num_timeouts += 1
            else:
                self.num_crashes += 1
        todo.extendleft(reversed(worker.pending))  # front of the queue: they are not to blame
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.score_fns)
