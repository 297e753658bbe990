"""A throw-away two-node SLURM cluster on this one machine, for tests of the sbatch launchers.

Debian's slurm-wlm (22.05) is built with MULTIPLE_SLURMD, so two ``slurmd -N`` daemons on one host
make a two-node cluster (nodes ``n1`` and ``n2``, both ``NodeAddr=127.0.0.1`` on their own ports).
Everything lives under the directory given to :class:`SlurmCluster`: munge key and socket, the
generated ``slurm.conf``, controller state, slurmd spool, pid and log files. The daemons run in the
foreground (``-D`` / ``-F``) as children of this process; their PIDs come from ``Popen`` (reading
pid files right after a forking start races), and :meth:`SlurmCluster.stop` ends them by PID.

CPUs per node: each node declares the machine's full CPU count (``CPUs=`` from ``slurmd -C``;
2 here). The two nodes therefore share the same real cores, which is fine for tests: slurmd rejects
a node that claims *more* CPUs than the hardware has, and declaring the real count lets a job with
``--nodes=2 --ntasks-per-node=1 --cpus-per-task=C`` run for any C up to that count (2 here).
``RealMemory`` is half the machine's memory per node (memory is not a consumable with ``CR_CPU``;
it only lets ``--mem`` requests up to that size be accepted).

Every process started on behalf of a cluster carries a marker variable (``TEST_SLURM_CLUSTER_ID=<id>``)
in its environment: the daemons, the slurmstepd processes slurmd forks, and the job processes
(``env`` holds it and sbatch exports the submitter's environment). ``stop`` scans ``/proc`` for it
and kills whatever is left, so no test leaves a daemon or job step behind. Daemons started by the
machine's own init scripts carry no marker and are never touched.

Usage::

    reason = slurm_available()
    if reason: pytest.skip(reason)
    with SlurmCluster(tmp_path) as c:
        rc, job_id = c.sbatch("#!/bin/bash\\nsrun hostname\\n", "--nodes=2")
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

MARKER = "TEST_SLURM_CLUSTER_ID"
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "srun", "sinfo", "scontrol", "scancel", "squeue")
INSTALL_HINT = "./install.sh test installs slurm-wlm where apt is available"


class SlurmClusterError(RuntimeError):
    """The cluster did not come up, a command failed, or something it started outlived stop()."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def slurm_available() -> str | None:
    """None when a SlurmCluster can start here, else a one-line reason to skip."""
    if not Path("/proc/self/environ").exists():
        return "SlurmCluster needs Linux /proc"
    for name in _DAEMONS + _CLIENTS:
        if _which(name) is None:
            pkg = "munge" if name.startswith("munge") else "slurm-wlm"
            return f"{name} not installed ({pkg}): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "SlurmCluster runs slurmd with SlurmUser=root: needs root"
    return None


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _machine_node_line() -> dict[str, str]:
    """`slurmd -C`'s first line as a dict (CPUs, RealMemory, ...); {} when it cannot run."""
    try:
        out = subprocess.run([_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    first = out.splitlines()[0] if out else ""
    return dict(tok.split("=", 1) for tok in first.split() if "=" in tok)


def parse_scontrol_line(line: str) -> dict[str, str]:
    """`scontrol show ... -o` output (``Key=Value Key=Value ...``) as a dict; values may hold '='
    (``TRES=cpu=2,node=2``) and, rarely, spaces (a Reason or WorkDir): a value runs to the next
    `` Key=``."""
    line = line.strip()
    keys = list(re.finditer(r"(?:^|(?<= ))([A-Za-z][A-Za-z0-9_:/]*)=", line))
    out = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() - 1 if i + 1 < len(keys) else len(line)
        out[m.group(1)] = line[m.end():end]
    return out


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no file)"
    return "\n".join(text[-lines:]) if text else "(empty)"


def _proc_environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """True while /proc/pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


class SlurmCluster:
    """Two slurmd "nodes" (``n1``, ``n2``) and one slurmctld on 127.0.0.1, under ``root``.

    ``with SlurmCluster(tmp_path) as c:`` starts it and waits until ``sinfo`` shows every node
    idle; leaving the block (also on an exception) cancels jobs, stops the daemons by PID (TERM,
    then KILL after ``stop_grace_s``) and raises :class:`SlurmClusterError` if anything it started
    is still running. ``stop()`` is idempotent.

    kill_wait_s, min_job_age_s and over_time_limit_min go to KillWait, MinJobAge and OverTimeLimit;
    cred_expire_s to AuthInfo's cred_expire (default 120 s), which is also how long a requeued job
    is held (Reason=BeginTime) before it may start again; extra_conf lines are appended to
    slurm.conf before the node lines.
    """

    def __init__(self, root: str | os.PathLike, *, nodes: tuple[str, ...] = ("n1", "n2"),
                 cpus: int | None = None, kill_wait_s: int = 5, min_job_age_s: int = 4,
                 over_time_limit_min: int = 0, cred_expire_s: int | None = None,
                 extra_conf: tuple[str, ...] = (),
                 start_timeout_s: float = 60.0, stop_grace_s: float = 5.0):
        self.root = Path(root).resolve()
        self.nodes = tuple(nodes)
        self.kill_wait_s = kill_wait_s
        self.min_job_age_s = min_job_age_s
        self.over_time_limit_min = over_time_limit_min
        self.cred_expire_s = cred_expire_s
        self.extra_conf = tuple(extra_conf)
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.token = uuid.uuid4().hex[:12]
        self.cluster_name = f"t{self.token}"
        self.partition = "debug"
        machine = _machine_node_line()
        self.cpus = cpus or int(machine.get("CPUs", os.cpu_count() or 1))
        self.real_memory_mb = max(1, int(machine.get("RealMemory", "2048")) // 2)
        self.conf_path = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.log_dir = self.root / "log"
        self._procs: dict[str, subprocess.Popen] = {}
        self._log_files: dict[str, Path] = {}
        self._started = False
        self._stopped = False
        self.env: dict[str, str] = {}
        self.stray: dict[int, str] = {}  # marked processes stop() had to kill: pid -> command line
        self.last_sbatch: subprocess.CompletedProcess | None = None

    # ---------------------------------------------------------------- set-up
    def _write_files(self) -> None:
        for sub in ("etc", "munge", "state", "spool", "run", "log", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o755)  # munged: "execute permissions for all required"
        key = self.root / "etc" / "munge.key"
        if not key.exists():
            subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True,
                           capture_output=True, text=True, timeout=30)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}"
            + (f",cred_expire={self.cred_expire_s}" if self.cred_expire_s else ""),
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"MinJobAge={self.min_job_age_s}",  # else sbatch --wait polls at 2, 10, 42 s
            f"KillWait={self.kill_wait_s}",
            f"OverTimeLimit={self.over_time_limit_min}",
            "InactiveLimit=0",
            "ReturnToService=2",
            "JobRequeue=1",
            "SlurmdTimeout=60",
            *self.extra_conf,
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus} RealMemory={self.real_memory_mb} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=UNLIMITED State=UP")
        self.conf_path.write_text("\n".join(lines) + "\n")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf_path), MARKER: self.token}
        self.env["PATH"] = _SEARCH_PATH
        for var in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var not in ("SLURM_CONF",):
                del self.env[var]  # a test run inside a real allocation must not leak into this one

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = self.log_dir / f"{name}.out"
        self._log_files[name] = out
        with open(out, "ab") as fh:
            self._procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh,
                                                 stderr=subprocess.STDOUT, env=self.env,
                                                 start_new_session=True)

    def _wait_for(self, what: str, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise SlurmClusterError(f"{name} exited with {p.returncode} while waiting for "
                                            f"{what}\n{self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise SlurmClusterError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def _munge_ok(self) -> bool:
        if not self.munge_socket.exists():
            return False
        enc = subprocess.run(["munge", "-n", "-S", str(self.munge_socket)], capture_output=True,
                             timeout=10, env=self.env)
        if enc.returncode:
            return False
        dec = subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=enc.stdout,
                             capture_output=True, timeout=10, env=self.env)
        return dec.returncode == 0 and b"Success" in dec.stdout

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        states = dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)
        return all(states.get(n) == "idle" for n in self.nodes)

    def start(self) -> SlurmCluster:
        if self._started:
            return self
        reason = slurm_available()
        if reason:
            raise SlurmClusterError(reason)
        self._started = True
        try:
            self._write_files()
            r = self.root
            # --force: the socket dir's ancestors (pytest's /tmp/pytest-of-root is 0700) fail munged's
            # "execute permissions for all" check; every client here is root, so it only warns.
            self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={r}/etc/munge.key",
                                   f"--socket={self.munge_socket}", f"--pid-file={r}/run/munged.pid",
                                   f"--log-file={r}/log/munged.log", f"--seed-file={r}/run/munged.seed",
                                   "--num-threads=2"])
            self._wait_for("munged", self._munge_ok, 20)
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf_path)])
            self._wait_for("slurmctld", lambda: self.run("scontrol", "ping", check=False,
                                                         timeout=10).stdout.count("UP") > 0, 30)
            for n in self.nodes:
                self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-f", str(self.conf_path), "-N", n])
            self._wait_for("both nodes idle in sinfo", self._nodes_idle, self.start_timeout_s)
        except BaseException:
            self.stop(check=False)
            raise
        return self

    # ---------------------------------------------------------------- tear-down
    def leftovers(self) -> list[int]:
        """PIDs of live processes carrying this cluster's marker (daemons, slurmstepd, job tasks)."""
        needle = f"{MARKER}={self.token}".encode()
        me = os.getpid()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != me:
                pid = int(entry.name)
                if _proc_environ_has(pid, needle) and _alive(pid):
                    pids.append(pid)
        return pids

    def _cancel_all_jobs(self) -> None:
        ctld = self._procs.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            return
        out = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
        jobs = out.stdout.split()
        if not jobs:
            return
        self.run("scancel", *jobs, check=False, timeout=10)
        deadline = time.monotonic() + self.kill_wait_s + 10
        while time.monotonic() < deadline:
            out = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
            if not out.stdout.split():
                break
            time.sleep(0.3)

    @staticmethod
    def _terminate(pids: list[int], grace: float) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self, check: bool = True) -> None:
        """Cancel jobs, stop slurmd, slurmctld, munged by PID, kill marked leftovers; with check,
        raise SlurmClusterError if anything this cluster started is still alive. Idempotent."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        try:
            self._cancel_all_jobs()
        except Exception:  # noqa: BLE001 - tear-down must go on
            pass
        order = [n for n in self._procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            p = self._procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        stray = self.leftovers()
        if stray:
            self.stray = {p: _cmdline(p) for p in stray}
            self._terminate(stray, self.stop_grace_s)
            time.sleep(0.2)
        alive = [f"{n} (pid {p.pid})" for n, p in self._procs.items() if p.poll() is None]
        alive += [f"pid {p} {_cmdline(p)}" for p in self.leftovers()]
        if alive and check:
            raise SlurmClusterError("still running after stop(): " + ", ".join(alive))

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # a failure inside the block stays the error raised; a clean block checks for leftovers
        self.stop(check=exc_type is None)

    def __del__(self):  # last resort: never leave daemons behind
        try:
            self.stop(check=False)
        except Exception:  # noqa: BLE001
            pass

    # ---------------------------------------------------------------- use
    def run(self, *argv: str, check: bool = True, timeout: float = 60, env: dict | None = None,
            **kw) -> subprocess.CompletedProcess:
        """A client command (sinfo, scontrol, srun, ...) with this cluster's environment."""
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                             env={**self.env, **(env or {})}, **kw)
        if check and out.returncode:
            raise SlurmClusterError(f"{' '.join(argv)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def sbatch(self, script: str | os.PathLike, *args: str, wait: bool = True, env: dict | None = None,
               timeout: float = 180, script_args: tuple[str, ...] = ()) -> tuple[int, int]:
        """Submit ``script`` (a str is the script's text, written under root/jobs; a Path is used as
        it is) with sbatch options ``args`` and the script's own ``script_args``; ``env`` adds
        to/overrides ``self.env``; the job's working directory defaults to root/jobs. With wait,
        ``sbatch --wait`` blocks and its return code is the job's exit code (the batch script's).
        Returns (returncode, job_id). Raises on a submission failure or timeout."""
        if isinstance(script, str):
            path = self.root / "jobs" / f"job-{uuid.uuid4().hex[:8]}.sh"
            path.write_text(script)
            path.chmod(0o755)
        else:
            path = Path(script)
        argv = ["sbatch", "--parsable", *(["--wait"] if wait else []), *args, str(path), *script_args]
        out = self.run(*argv, check=False, timeout=timeout, env=env, cwd=str(self.root / "jobs"))
        first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        m = re.match(r"^(\d+)", first)
        if not m:
            raise SlurmClusterError(f"sbatch gave no job id (rc {out.returncode}):\n{out.stdout}\n"
                                    f"{out.stderr}\n{self.logs()}")
        self.last_sbatch = out
        return out.returncode, int(m.group(1))

    def job_info(self, job_id: int) -> dict[str, str] | None:
        """``scontrol show job -o`` as a dict; None once the job is purged (MinJobAge after its
        end; there is no accounting, so sacct has nothing)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False, timeout=10)
        if out.returncode or not out.stdout.strip():
            return None
        return parse_scontrol_line(out.stdout.splitlines()[0])

    def job_state(self, job_id: int) -> str | None:
        """JobState (PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, ...) or None once purged."""
        info = self.job_info(job_id)
        return info.get("JobState") if info else None

    def wait_job(self, job_id: int, states=("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL",
                                            "OUT_OF_MEMORY", "PREEMPTED"), timeout: float = 180) -> str | None:
        """Poll until the job reaches one of ``states`` (or is purged: None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state is None or state in states:
                return state
            time.sleep(0.5)
        raise SlurmClusterError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")

    def node_addr(self, node: str) -> str:
        """A node's NodeAddr (what to rendezvous on: node names need not resolve)."""
        out = self.run("scontrol", "show", "node", "-o", node, timeout=10)
        return parse_scontrol_line(out.stdout)["NodeAddr"]

    def logs(self, lines: int = 25) -> str:
        """Tails of every daemon's log and captured output, for assertion messages."""
        parts = []
        files = sorted(self.log_dir.glob("*")) if self.log_dir.exists() else []
        for f in files:
            parts.append(f"--- {f.name} ---\n{_tail(f, lines)}")
        return "\n".join(parts) if parts else "(no logs)"
