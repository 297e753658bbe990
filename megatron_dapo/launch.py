"""torchrun that ends as the run ended: ``python -m megatron_dapo.launch [torchrun options] -m megatron_dapo.cli ...``.

torchrun's agent meets a stop signal (Ctrl-C, SIGTERM from a scheduler or an operator) by forwarding
SIGTERM to the workers, waiting for them, and then raising ``SignalException``: exit code 1 and a
traceback of some forty lines, even when every trainer saved its checkpoint and exited 0
(preemption.py). This launcher runs the same agent (torch.distributed.run, the same options) and
catches that exception: when the run left its status (rank 0 writes "stopped ..." or "finished ..."
to ``MEGATRON_DAPO_STATUS_FILE``, time_limit.write_status; a temporary file is named here when the
caller named none) the launcher prints it as one line and exits 0, as the run did; otherwise one
line naming the signal, and exit code 128 + its number, as a process killed by it would.
Anything else (a worker's failure: torchrun's own report) is left as torchrun reports it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from megatron_dapo.time_limit import STATUS_FILE_ENV


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    argv = sys.argv[1:] if argv is None else argv
    own = STATUS_FILE_ENV not in os.environ
    if own:  # the workers inherit it
        handle, path = tempfile.mkstemp(prefix="megatron-dapo-status-")
        os.close(handle)
        os.environ[STATUS_FILE_ENV] = path
    status = Path(os.environ[STATUS_FILE_ENV])
    try:
        torchrun(argv)
        return 0
    except SignalException as stop:
        left = status.read_text().strip() if status.is_file() else ""
        if left.startswith(("stopped ", "finished ")):
            print(f"megatron-dapo: {stop.sigval.name} reached the launcher; the run {left}", file=sys.stderr,
                  flush=True)
            return 0
        print(f"megatron-dapo: {stop.sigval.name} reached the launcher before the run left a status: it ended "
              "without a checkpoint of this invocation; rerun the same command to resume from the last one",
              file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    finally:
        if own:
            status.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
