"""tests/helpers/slurm_cluster.py: a real two-node SLURM cluster on this machine runs a 2-node
srun step on both nodes, passes the batch script's exit code through `sbatch --wait`, and leaves
nothing running after its context. Skips with the reason where slurm-wlm / munge are missing."""

import pytest

from tests.helpers.slurm_cluster import SlurmCluster, parse_scontrol_line, slurm_available

REASON = slurm_available()

TWO_NODES = """#!/bin/bash
srun --ntasks-per-node=1 bash -c 'echo "answer $SLURMD_NODENAME $SLURM_NODEID"'
exit "$1"
"""


def test_parse_scontrol_line_keeps_values_with_equals_and_spaces():
    got = parse_scontrol_line("JobId=7 JobState=RUNNING TRES=cpu=2,node=2 Reason=a b c CPUs/Task=1")
    assert got == {"JobId": "7", "JobState": "RUNNING", "TRES": "cpu=2,node=2", "Reason": "a b c",
                   "CPUs/Task": "1"}


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_two_node_job_runs_on_both_nodes_and_exit_codes_propagate(tmp_path):
    cluster = SlurmCluster(tmp_path / "slurm")
    with cluster as c:
        assert c.node_addr("n1") == "127.0.0.1"
        out = tmp_path / "ok.out"
        rc, job = c.sbatch(TWO_NODES, "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                           "--time=1", f"--output={out}", script_args=("0",), timeout=120)
        assert rc == 0, (out.read_text() if out.exists() else "", c.logs())
        answers = sorted(line.split()[1:] for line in out.read_text().splitlines()
                         if line.startswith("answer "))
        assert answers == [["n1", "0"], ["n2", "1"]]

        rc, job3 = c.sbatch(TWO_NODES, "--nodes=2", "--time=1", f"--output={tmp_path / 'three.out'}",
                            script_args=("3",), timeout=120)
        assert rc == 3
        assert job3 != job
        assert c.job_state(job3) in ("FAILED", "COMPLETING", None)  # None: purged after MinJobAge
    assert cluster.leftovers() == []
    assert all(p.poll() is not None for p in cluster._procs.values())
    cluster.stop()  # idempotent
