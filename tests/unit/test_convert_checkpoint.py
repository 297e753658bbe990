"""HF -> Megatron dist checkpoint -> HF on a random tiny Qwen2, in one process (TP = PP = 1).

Bit-exact round trips in fp32 and bf16, untied (GQA, q/k/v bias, sharded input) and tied; the
output loads with transformers; logits match; CLI errors name the problem.
"""

import json

import pytest
import torch

from megatron_dapo.mcore.hf_conversion import hf_to_megatron, megatron_to_hf  # noqa: I001  (before policy)
from megatron_dapo.convert import ConversionError, SafetensorsReader
from megatron_dapo.convert.synthetic import QWEN25_CONFIGS
from megatron_dapo.mcore.logit_check import verify
from tests.helpers.convert import save_tiny_hf
from tools.convert_ckpt import hf_to_megatron as hf_to_megatron_cli

DIVISIBLE_BY = 64  # vocab 100 -> 128 rows at TP 1 and 2 alike, so one checkpoint serves both


@pytest.fixture(scope="module", autouse=True)
def _parallel_state_torn_down():
    yield
    from megatron_dapo.mcore import destroy_parallel
    destroy_parallel()


def assert_same_checkpoint(a, b):
    with SafetensorsReader(a) as ra, SafetensorsReader(b) as rb:
        assert sorted(ra.names()) == sorted(rb.names())
        for name in ra.names():
            x, y = ra.get(name), rb.get(name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("tied,dtype", [(False, torch.float32), (False, torch.bfloat16),
                                        (True, torch.float32), (True, torch.bfloat16)],
                         ids=["untied-fp32", "untied-bf16", "tied-fp32", "tied-bf16"])
def test_roundtrip_is_bit_exact(tmp_path, tied, dtype):
    from transformers import AutoModelForCausalLM

    hf = save_tiny_hf(tmp_path / "hf", tied=tied, dtype=dtype)
    assert len(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    meta = hf_to_megatron(hf, tmp_path / "ckpt", make_vocab_size_divisible_by=DIVISIBLE_BY, progress=False)
    assert meta["dtype"] == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert (tmp_path / "ckpt" / "hf" / "tokenizer_config.json").is_file()
    files = megatron_to_hf(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=40_000, progress=False)
    assert len(files) > 1 and (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert_same_checkpoint(hf, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == dtype and loaded.config.tie_word_embeddings == tied


@pytest.mark.slow  # two spawned interpreters import megatron-core
def test_worker_processes_write_the_files_one_process_writes(tmp_path):
    """megatron_to_hf in 3 processes side by side (this one and two spawned, each writing every third
    output shard) against one process: every file byte for byte, the index and side files alike."""
    hf = save_tiny_hf(tmp_path / "hf", tied=False, dtype=torch.bfloat16)
    hf_to_megatron(hf, tmp_path / "ckpt", make_vocab_size_divisible_by=DIVISIBLE_BY, progress=False)
    one = megatron_to_hf(tmp_path / "ckpt", tmp_path / "one", max_shard_bytes=15_000, progress=False, workers=1)
    three = megatron_to_hf(tmp_path / "ckpt", tmp_path / "three", max_shard_bytes=15_000, progress=False,
                           workers=3)
    assert len(one) > 3 and [f.name for f in one] == [f.name for f in three]
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "three").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes(), name
    assert_same_checkpoint(hf, tmp_path / "three")


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_roundtrip_is_bit_exact_and_its_logits_match(tmp_path, tied):
    """Qwen3 dense (no q/k/v biases, q_norm / k_norm, head_dim 24 of its own): HF -> Megatron -> HF
    gives the same tensors, transformers loads them as Qwen3, and verify's logits match."""
    from transformers import AutoModelForCausalLM

    hf = save_tiny_hf(tmp_path / "hf", tied=tied, arch="qwen3")
    hf_to_megatron(hf, tmp_path / "ckpt", make_vocab_size_divisible_by=DIVISIBLE_BY, progress=False)
    megatron_to_hf(tmp_path / "ckpt", tmp_path / "out", max_shard_bytes=40_000, progress=False)
    assert_same_checkpoint(hf, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "Qwen3ForCausalLM" and loaded.config.head_dim == 24
    report = verify(hf, tmp_path / "ckpt")
    assert report.ok and report.max_logit_diff <= 1e-5, report.format()
    assert len(report.weight_rows) == 2 * 11 + 2 + (not tied)  # per layer: 9 HF tensors + q_norm, k_norm


def test_verify_tp1_logits_match_and_a_wrong_model_fails(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf")
    hf_to_megatron(hf, tmp_path / "ckpt", make_vocab_size_divisible_by=DIVISIBLE_BY, progress=False)
    report = verify(hf, tmp_path / "ckpt")
    assert report.ok and report.max_logit_diff <= 1e-5 and len(report.weight_rows) == 27
    other = save_tiny_hf(tmp_path / "other", seed=1)
    bad = verify(other, tmp_path / "ckpt")
    assert not bad.ok and not bad.weights_ok and bad.max_logit_diff > 1e-3
    assert "NO" in bad.format() and "FAIL" in bad.format()


def test_cli_refuses_non_empty_out_and_unsupported_architecture(tmp_path, capsys):
    hf = save_tiny_hf(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    assert hf_to_megatron_cli.main(["--hf-dir", str(hf), "--out", str(tmp_path / "out")]) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    assert hf_to_megatron_cli.main(["--hf-dir", str(hf), "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert ("unsupported architecture MistralForCausalLM; supported: "
            "['Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM']") in err


def test_misshapen_checkpoint_fails_before_writing(tmp_path):
    from safetensors.torch import save_file

    hf = save_tiny_hf(tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    file = hf / index["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    with SafetensorsReader(file) as r:
        tensors = {n: r.get(n) for n in r.names()}
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    expected = r"'model.layers.1.self_attn.k_proj.weight' has shape \(48, 64\), expected \(32, 64\)"
    with pytest.raises(ConversionError, match=expected):
        hf_to_megatron(hf, tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


def test_dry_run_32b_tp8_pp2_prints_per_rank_sizes(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_CONFIGS["32B"]))
    assert hf_to_megatron_cli.main(["--hf-dir", str(tmp_path), "--dry-run", "--tp", "8", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary 152064 padded to 152064" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 16 and {r[1] for r in rows} == {str(t) for t in range(8)}
