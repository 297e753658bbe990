"""An engine rank's host memory while a weight version streams in (separate placement), in 2
processes: trainer rank 0 (SeparatePlacement, no megatron: the export is a model's state dict) and
one engine rank running the real ``serve`` with the HF engine.

The model is ~85 MB of fp32 tensors of at most 2 MiB each, sent in 4 MiB buckets (rollout.
weight_sync_bucket_mb=4), twice. The engine rank's peak resident memory (VmHWM, reset before each
stream through /proc/self/clear_refs) may grow by a few buckets over what it held before the
stream: the worker receives a bucket and copies it into the model before the next arrives. The bound
is 4 buckets (16 MiB, a fifth of the model): the first stream's growth varies with the allocator
(7.3-12.3 MiB over 8 runs on 2 cores, the same before and after the change that brought the stop's
cut; glibc raises its mmap threshold after the first freed bucket, so later buckets reuse heap
pages), the second's is 0-4 MiB. Before,
the engine's main thread held the whole stream in host memory until the worker loaded it (the whole
model per rank and version: 65.5 GB at 32B). The stream's content is checked too: after it, the
engine generates what an HF engine holding the trainer's weights generates."""

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.hf_engine import HFEngine
from tests.distributed.harness import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SHAPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
             tie_word_embeddings=False, rms_norm_eps=1e-6)
BUCKET_MB = 4
PROMPTS = [[5, 17, 42, 8], [7, 9, 11]]


def _resident_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


class MeasuredHFEngine(HFEngine):
    """``rollout.engine=measured_hf``: the HF engine, writing how far each weight stream raised this
    process's peak resident memory ($HOST_MEMORY_OUT/engine_streams.json)."""

    @classmethod
    def from_spec(cls, spec, **kwargs):
        engine = super().from_spec(spec, **kwargs)
        with torch.no_grad():  # the weights may be pages of the mapped checkpoint: resident before measuring
            for tensor in engine.model.state_dict().values():
                tensor.mul_(1)
        engine.streams = []
        engine._reset()
        return engine

    def _reset(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.before_kb = _resident_kb("VmRSS")

    def finish_weight_update(self):
        self.streams.append(_resident_kb("VmHWM") - self.before_kb)
        Path(os.environ["HOST_MEMORY_OUT"], "engine_streams.json").write_text(json.dumps(self.streams))
        self._reset()


def _worker(rank, out):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.config_loading import load_config
    from megatron_dapo.rollout import SamplingParams
    from megatron_dapo.rollout.engine import ENGINES
    from megatron_dapo.rollout.engine_server import serve
    from megatron_dapo.rollout.separate import RemoteEngines, SeparatePlacement
    from megatron_dapo.rollout.worlds import split_world

    if "measured_hf" not in ENGINES:
        ENGINES.register("measured_hf")(f"{__name__}:MeasuredHFEngine")
    os.environ["HOST_MEMORY_OUT"] = out
    split = split_world(1)
    if not split.is_trainer:
        serve(split)
        return
    cfg = load_config(None, [f"model.hf_path={out}/model", "rollout.engine=measured_hf", "rollout.n=2",
                             f"rollout.weight_sync_bucket_mb={BUCKET_MB}"])
    engines = RemoteEngines(split)
    try:
        placement = SeparatePlacement(engines)
        placement.start(cfg)
        for version in (1, 2):
            torch.manual_seed(10 + version)
            trained = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
            placement.sync(iter(trained.state_dict().items()), BUCKET_MB << 20, version=version)
        params = SamplingParams(max_tokens=6, seed=3)
        _, got = placement.generate(PROMPTS, 2, params)
        want = HFEngine(trained, eos_token_ids=()).generate(PROMPTS, 2, params)
        Path(out, "generated.json").write_text(json.dumps([[[r.response_ids for r in g] for g in groups]
                                                           for groups in (got, want)]))
    finally:
        engines.shutdown()


def test_an_engine_rank_holds_about_one_bucket_of_a_weight_stream(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    model.save_pretrained(tmp_path / "model")
    model_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    assert model_mb > 80 and max(t.numel() * 4 for t in model.state_dict().values()) <= 2 << 20
    spawn(_worker, str(tmp_path), world_size=2, init=False)
    streams_mb = [kb / 1024 for kb in json.loads((tmp_path / "engine_streams.json").read_text())]
    print(f"engine rank's peak over its resident memory, per stream: {streams_mb} MiB (model {model_mb:.1f} MiB)")
    assert len(streams_mb) == 2 and max(streams_mb) < 4 * BUCKET_MB, (streams_mb, model_mb)
    got, want = json.loads((tmp_path / "generated.json").read_text())
    assert got == want
