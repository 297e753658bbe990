"""Each CPU stand-in is needed: without it, the run stops where the stand-in says.

    .venv-nemo/bin/python tests/nemo_aligner/probe_removal.py OUT.json

Imports the stack once, then for a baseline and for each run-time stand-in forks a child that
applies all the others and runs one scenario that reaches every replaced call: build the actor,
one DAPOTrainer.fit() step (generation, log-probs, the loss, the DP gradient reduction, clipping,
Adam), a checkpoint through NeMo's callback, and reading its common state back. The import-time
stand-in is checked in a fresh interpreter. OUT.json: per stand-in, whether the child failed and
whether its error holds the stand-in's ``stop`` text; the baseline must pass.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.nemo_aligner import loop, standins, tiny  # noqa: E402


def scenario(work: Path) -> None:
    from megatron.core import dist_checkpointing

    model = tiny.model_config(tiny.save_tokenizer(work / "tok"), mbs=1, gbs=6)
    model["ppo"]["rollout_micro_batch_size"] = 2
    section = loop.fit_section(3, 1, model_gbs=6, model_mbs=1, save_interval=1)
    exp = {"explicit_log_dir": str(work / "logs"), "exp_dir": None, "name": "dapo_tiny",
           "create_tensorboard_logger": False, "create_wandb_logger": False, "resume_if_exists": False,
           "create_checkpoint_callback": True,
           "checkpoint_callback_params": {"monitor": "step", "save_top_k": 1, "mode": "max",
                                          "always_save_nemo": False, "save_nemo_on_train_end": False,
                                          "filename": "dapo-{step}", "save_last": False}}
    ptl_trainer, actor, cfg = tiny.build(model, extra_trainer=section, exp_manager=exp)
    trainer, _ = loop.build_trainer(ptl_trainer, actor, cfg, num_prompts=24, prompts_per_gen_batch=4)
    trainer.fit()
    saved = next((work / "logs" / "checkpoints").glob("dapo-step=1*"))
    dist_checkpointing.load_common_state_dict(str(saved))


def child(drop: str, work: Path, port: int, status: Path) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"})
    try:
        standins.apply(drop=(drop,) if drop else ())
        scenario(work)
        status.write_text(json.dumps({"failed": False, "error": ""}))
    except BaseException:  # noqa: BLE001 - the error text is the result
        status.write_text(json.dumps({"failed": True, "error": traceback.format_exc()[-3000:]}))
    finally:
        import psutil  # nothing this child started may outlive it (os._exit runs no clean-up)

        for proc in psutil.Process().children(recursive=True):
            proc.kill()
        os._exit(0)


def main(out: str) -> None:
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # compile in-process: no pool to leak
    work = Path(out).parent
    standins.prepare()
    import torch
    torch.set_num_threads(1)
    results = {}
    cases = [""] + [s.name for s in standins.STANDINS if not s.before_import]
    running: dict[int, int] = {}  # pid -> case index; two at a time (one thread each, two cores)
    for i, name in enumerate(cases):
        if len(running) == 2:
            running.pop(os.wait()[0])
        with socket.socket() as sock:  # a free port for the child's one-process world
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        pid = os.fork()
        if pid == 0:
            child(name, work / f"case_{i}", port, work / f"status_{i}.json")
        running[pid] = i
    for pid in running:
        os.waitpid(pid, 0)
    for i, name in enumerate(cases):
        status = work / f"status_{i}.json"
        got = json.loads(status.read_text()) if status.exists() else {"failed": True, "error": "no status"}
        stop = standins.BY_NAME[name].stop if name else ""
        results[name or "baseline"] = {"failed": got["failed"], "error_tail": got["error"][-600:],
                                       "stop_seen": bool(name) and stop in got["error"]}
    for s in standins.STANDINS:
        if s.before_import:
            code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
                    f"from tests.nemo_aligner import standins; standins.prepare(drop=({s.name!r},))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            results[s.name] = {"failed": proc.returncode != 0, "stop_seen": s.stop in proc.stderr,
                               "error_tail": proc.stderr[-600:]}
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
