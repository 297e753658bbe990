"""A command that ran megatron tears its process group down when it ends (cli._end_megatron).

Left alive, gloo aborted a finished one-process run at interpreter exit in CI (rc -6). The
group is the real gloo one a plain ``python`` run starts for itself (a HashStore world of 1).
"""

import argparse

import pytest
import torch.distributed as dist

from megatron_dapo import cli


@pytest.fixture
def gloo_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("entry", [False, True])
def test_a_run_without_a_launcher_ends_its_group(gloo_world, monkeypatch, entry):
    monkeypatch.delenv("RANK", raising=False)
    cli._end_megatron(argparse.Namespace(process_entry=entry))
    assert not dist.is_initialized()


def test_a_caller_under_torchrun_keeps_its_group_for_the_next_run(gloo_world, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cli._end_megatron(argparse.Namespace(process_entry=False))
    assert dist.is_initialized()


def test_the_console_script_under_torchrun_ends_its_group(gloo_world, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cli._end_megatron(argparse.Namespace(process_entry=True))
    assert not dist.is_initialized()
