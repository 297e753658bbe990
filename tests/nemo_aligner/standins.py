"""CPU stand-ins that let the real NeMo-Aligner 0.7.0 stack train on a CPU over gloo.

Runs inside ``.venv-nemo`` only (``./install.sh nemo``). Each stand-in gets past one place where
the pinned stack stops on a CPU (a CUDA-only or apex-only call, or torch 2.13 against code written
for torch 2.4), replacing one or a few names there, and names the upstream line of that stop;
``check_pins()`` reads every such line in the installed sources and fails, naming the stand-in, when
the text there is not what the stand-in was written against (a pinned version moved).
``install(drop=...)`` applies all of them but the dropped ones (``prepare`` + ``apply``);
probe_removal.py drops each in turn and expects the stop it prevents.

Why they are safe at the pinned versions: none changes arithmetic. They move a CUDA tensor or RNG
state to its CPU twin, take torch's path where apex's exists only as a CUDA kernel, skip an import
whose only user (TRT-LLM generation, BERT, apex Adam) the tests never reach, or call torch 2.13 the
way megatron-core 0.10 called the image's torch 2.4. Each entry's ``why`` says which.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Distributions whose source the stand-ins were written against (from nemo-aligner v0.7.0's
# Dockerfile: NeMo 633cb60 = v2.1.0, Megatron-LM d15cec5 = core_r0.10.0; lightning within NeMo's
# <=2.4.0 cap). A different version fails check_pins() before anything runs.
PINS = {"nemo-aligner": "0.7.0", "nemo-toolkit": "2.1.0", "megatron-core": "0.10.0",
        "lightning": "2.4.0", "pytorch-lightning": "2.4.0", "torch": "2.13.0+cpu"}


@dataclass(frozen=True)
class StandIn:
    name: str
    where: str        # upstream "module/path.py:line" (inside site-packages) of the replaced call
    expect: str       # text that line holds at the pinned version
    stop: str         # what happens on a CPU without the stand-in (the removal test's expectation)
    why: str          # why replacing it is safe here
    apply: Callable[[], None]
    before_import: bool = False  # must be in place before nemo_aligner is imported


def _site() -> Path:
    return Path(md.distribution("nemo-aligner").locate_file(""))


def _module(name: str):
    return importlib.import_module(name)


# -- the stand-ins, in the order a run meets them ---------------------------------------------------

def _no_trt_llm():
    mod = types.ModuleType("nemo_aligner.utils.trt_llm")

    class GPTGenerateTRTLLM:  # only built when model.ppo.trt_llm.enable, which the tests never set
        def __init__(self, *args, **kwargs):
            raise RuntimeError("TRT-LLM generation does not run on a CPU (stand-in, tests/nemo_aligner)")

    mod.GPTGenerateTRTLLM = GPTGenerateTRTLLM
    sys.modules["nemo_aligner.utils.trt_llm"] = mod


def _nvidia_version():
    os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")  # the base image of NeMo-Aligner 0.7.0


def _torch_load_default():
    # torch >= 2.6 reads with weights_only=True unless told; this restores the image's torch 2.4
    # default for the one process that reads back the checkpoint it wrote itself.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"


def _no_bert_models():
    _module("nemo.collections.nlp.models.nlp_model").get_megatron_pretrained_bert_models = lambda: []


def _apex_flag():
    overrides = _module("nemo.collections.nlp.parts.nlp_overrides")
    overrides.HAVE_APEX = True
    # The flag's try block also binds the two optimizer classes that the checkpoint code tests with
    # isinstance (nlp_overrides.py:325, :332): megatron's distributed optimizer (imports without
    # apex) and apex's distributed fused Adam, which nothing here is an instance of.
    overrides.McoreDistributedOptimizer = _module("nemo.core.optim.mcore_optim").McoreDistributedOptimizer
    overrides.MegatronDistributedFusedAdam = type("MegatronDistributedFusedAdam", (), {})


def _local_spec():
    gpt = _module("nemo.collections.nlp.models.language_modeling.megatron_gpt_model")
    local = _module("megatron.core.models.gpt.gpt_layer_specs").get_gpt_layer_local_spec
    original = gpt.get_specs

    def get_specs(spec_name, transformer_config=None, use_te=True, hyena_cfg=None, fp8=False):
        if use_te or spec_name:
            return original(spec_name, transformer_config, use_te, hyena_cfg, fp8)
        return local(transformer_config.num_moe_experts if transformer_config else None,
                     transformer_config.moe_grouped_gemm if transformer_config else False)

    gpt.get_specs = get_specs


def _apex_tp_defaults():
    build_model = _module("nemo.collections.nlp.modules.common.megatron.build_model")
    tp = _module("megatron.core.tensor_parallel.layers")
    build_model.set_defaults_if_not_set_tensor_model_parallel_attributes = (
        tp.set_defaults_if_not_set_tensor_model_parallel_attributes)


def _apex_listify():
    utils = _module("nemo.collections.nlp.modules.common.megatron.utils")
    utils.listify_model = lambda model: model if isinstance(model, list) else [model]


def _norm_classes():
    utils = _module("nemo.collections.nlp.modules.common.megatron.utils")
    # megatron-core's local spec without apex builds torch's own norms (transformer/torch_norm.py)
    utils.FusedLayerNorm = utils.FastLayerNorm = torch.nn.LayerNorm
    utils.MixedFusedRMSNorm = torch.nn.RMSNorm


def _adam_step_common():
    overrides = _module("nemo.collections.nlp.parts.nlp_overrides")
    original = overrides.optim_state_to_sharding_state

    def optim_state_to_sharding_state(optim_state_dict, id_to_sharded_param_map, exclude_keys=()):
        # torch's Adam keeps a 0-d `step` per parameter (apex FusedAdam, NeMo's GPU optimizer, keeps
        # it in param_groups): it cannot be sharded like its [*param.shape] parameter, so it stays
        # a plain tensor, which dist_checkpointing saves and loads as common state.
        steps = {pid: st["step"] for pid, st in optim_state_dict["state"].items() if "step" in st}
        original(optim_state_dict, id_to_sharded_param_map, exclude_keys=(*exclude_keys, "step"))
        for pid, step in steps.items():
            optim_state_dict["state"][pid]["step"] = step

    overrides.optim_state_to_sharding_state = optim_state_to_sharding_state


def _torch_write_item():
    fs_async = _module("megatron.core.dist_checkpointing.strategies.filesystem_async")
    fs = _module("torch.distributed.checkpoint.filesystem")

    def _write_item(stream, data, write_item, storage_key):
        # torch 2.4's form (what megatron-core 0.10 calls): default transforms, torch.save format
        return fs._write_item(fs._StorageWriterTransforms(), stream, data, write_item, storage_key,
                              fs.SerializationFormat.TORCH_SAVE)

    fs_async._write_item = _write_item


def _torch_clip():
    train_utils = _module("nemo_aligner.utils.train_utils")

    def clip_grad_norm_fp32(parameters, max_norm, use_fsdp=False):
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)

    train_utils.clip_grad_norm_fp32 = clip_grad_norm_fp32


class _CpuDevices(torch.overrides.TorchFunctionMode):
    """Every ``device=`` that names CUDA (a string, an index, a torch.device) becomes the CPU."""

    @staticmethod
    def _cpu(device):
        if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
            return torch.device("cpu")
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        return device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._cpu(kwargs["device"])
        if func is torch.Tensor.to:  # .to(device, ...): a positional device (bools are flags)
            args = (args[0], *[a if isinstance(a, bool) else self._cpu(a) for a in args[1:]])
        return func(*args, **kwargs)


_MODE = _CpuDevices()


def _cuda_literals():
    _MODE.__enter__()  # for the whole process: the harness runs nothing else


def _cuda_moves():
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: 0  # an index; _CpuDevices maps device=0 to the CPU
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.FloatTensor = lambda *args: torch.FloatTensor(*args)
    torch.cuda.LongTensor = lambda *args: torch.LongTensor(*args)
    torch.cuda.ByteTensor = lambda *args: torch.ByteTensor(*args)
    _module("nemo.core.classes.modelPT").ModelPT.cuda = lambda self, *args, **kwargs: self


def _no_cp_stream():
    torch.cuda.Stream = lambda *args, **kwargs: None


def _cpu_rng_fork():
    random = _module("megatron.core.tensor_parallel.random")

    @contextlib.contextmanager
    def fork(self, name=random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        state = self.states_.setdefault(name, torch.get_rng_state())
        outer = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    random.CudaRNGStatesTracker.fork = fork


def _gloo_scalar_gather():
    original = torch.distributed.all_gather_into_tensor

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        return original(output, input.reshape(-1) if input.dim() == 0 else input, group=group,
                        async_op=async_op)

    torch.distributed.all_gather_into_tensor = all_gather_into_tensor


STANDINS: tuple[StandIn, ...] = (
    StandIn("no_trt_llm", "nemo_aligner/utils/trt_llm.py:15", "import tensorrt_llm",
            "No module named 'tensorrt_llm'",
            "imported unguarded by the PPO actor for TRT-LLM generation, which is off (ppo.trt_llm.enable)",
            _no_trt_llm, before_import=True),
    StandIn("nvidia_version", "nemo/collections/nlp/models/language_modeling/megatron_base_model.py:387",
            "os.getenv('NVIDIA_PYTORCH_VERSION', None)", "expected string or bytes-like object",
            "outside an NGC container the check runs re.fullmatch on None; 24.07 is the pinned image's",
            _nvidia_version),
    StandIn("torch_load_default", "megatron/core/dist_checkpointing/strategies/common.py:72",
            "return torch.load(load_path, map_location='cpu')", "Weights only load failed",
            "not a CPU stop: torch 2.13 loads weights_only by default, megatron-core 0.10 pickles its common "
            "state (written for torch 2.4)", _torch_load_default),
    StandIn("no_bert_models", "nemo/collections/nlp/models/nlp_model.py:79",
            "get_megatron_pretrained_bert_models()", "ApexGuardDefaults",
            "a NeMo 2.1 bug without apex (bert_spec.py:36); the list only names downloadable BERTs",
            _no_bert_models),
    StandIn("apex_flag", "nemo/collections/nlp/parts/nlp_overrides.py:210", "if not HAVE_APEX:",
            "Apex was not found",
            "the flag means 'apex distributed fused Adam imports'; the tests use torch's Adam",
            _apex_flag),
    StandIn("local_spec", "nemo/collections/nlp/models/language_modeling/megatron_gpt_model.py:167",
            '"te_gpt": get_gpt_layer_with_transformer_engine_spec(', "No module named 'transformer_engine'",
            "every spec is built eagerly, TE's too; with transformer_engine off the local spec is used",
            _local_spec),
    StandIn("apex_tp_defaults", "nemo/collections/nlp/modules/common/megatron/build_model.py:134",
            "set_defaults_if_not_set_tensor_model_parallel_attributes(param)",
            "set_defaults_if_not_set_tensor_model_parallel_attributes",
            "apex's copy of a megatron-core function (the same body)", _apex_tp_defaults),
    StandIn("apex_listify", "nemo/collections/nlp/modules/common/megatron/utils.py:366",
            "modules = listify_model(model)", "name 'listify_model' is not defined",
            "apex's helper wraps a module in a list (a list stays as it is)", _apex_listify),
    StandIn("norm_classes", "nemo/collections/nlp/modules/common/megatron/utils.py:375",
            "if isinstance(module_, (FusedLayerNorm, FastLayerNorm, MixedFusedRMSNorm)):",
            "name 'FusedLayerNorm' is not defined",
            "the weight-decay split looks for apex's norm classes; the local spec's norms are torch's "
            "LayerNorm / RMSNorm, so those keep upstream's rule (no decay on norms)", _norm_classes),
    StandIn("adam_step_common", "nemo/collections/nlp/parts/nlp_overrides.py:342",
            "optim_state_to_sharding_state(optimizer_state_dict, id_to_sharded_param_map)",
            "Optimizer shape (() does not match model shape",
            "torch Adam's 0-d per-parameter step is saved whole (common state) instead of sharded; "
            "its value and the sharded exp_avg / exp_avg_sq are unchanged", _adam_step_common),
    StandIn("torch_write_item", "megatron/core/dist_checkpointing/strategies/filesystem_async.py:281",
            "local_results.append(_write_item(stream, data, write_item, storage_key))",
            "missing 2 required positional arguments: 'storage_key' and 'serialization_format'",
            "not a CPU stop: torch 2.13's private _write_item gained transforms and a format; megatron-core "
            "0.10 was written for the image's torch 2.4, whose behaviour is the defaults passed here",
            _torch_write_item),
    StandIn("torch_clip", "nemo_aligner/utils/train_utils.py:211",
            "grad_norm = clip_grad_norm_fp32(parameters=parameters, max_norm=clip_val",
            "in clip_grad_norm_fp32", "NeMo's clip needs CUDA and apex amp_C; torch's clip_grad_norm_ "
            "computes the same global 2-norm and scale on one model-parallel rank", _torch_clip),
    StandIn("cuda_literals", "megatron/core/pipeline_parallel/schedules.py:449",
            'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")',
            "Cannot access accelerator device when none is available",
            "device='cuda' literals (also transformer/utils.py:32, the causal mask, and NeMo's generate, "
            "text_generation_utils.py:508) become the CPU",
            _cuda_literals),
    StandIn("cuda_moves", "nemo_aligner/utils/distributed.py:46",
            "device=torch.cuda.current_device()", "Torch not compiled with CUDA enabled",
            "Tensor/Module/ModelPT.cuda, current_device, synchronize and torch.cuda.*Tensor keep "
            "tensors where they are (on the CPU)", _cuda_moves),
    StandIn("no_cp_stream", "nemo/collections/nlp/models/language_modeling/megatron_base_model.py:267",
            "cp_stream = torch.cuda.Stream()", "torch.cuda.Stream requires CUDA support",
            "the stream is handed only to TE modules (set_context_parallel_group); the local spec has none",
            _no_cp_stream),
    StandIn("cpu_rng_fork", "megatron/core/tensor_parallel/random.py:142",
            "raise Exception('cuda rng state {} is not added'.format(name))", "is not added",
            "the model-parallel stream is forked from the CPU generator; it starts from that generator's "
            "state, so the two are correlated: harmless here, where dropout is 0 and nothing that "
            "changes a result is drawn inside it",
            _cpu_rng_fork),
    StandIn("gloo_scalar_gather", "nemo_aligner/utils/distributed.py:50",
            "torch.distributed.all_gather_into_tensor(batch_num_per_rank, num_samples, group=group)",
            "invalid tensor size", "gloo's all-gather refuses a 0-d input; the same value as shape [1]",
            _gloo_scalar_gather),
)
BY_NAME = {s.name: s for s in STANDINS}


def check_pins() -> None:
    """Versions and the replaced lines, as the stand-ins were written against; one error naming all."""
    problems = []
    for dist, want in PINS.items():
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            have = None
        if have != want:
            problems.append(f"{dist} is {have}, the stand-ins are written against {want}")
    site = _site()
    for s in STANDINS:
        path, line = s.where.rsplit(":", 1)
        lines = (site / path).read_text().splitlines()
        text = lines[int(line) - 1] if int(line) <= len(lines) else ""
        if s.expect not in text:
            problems.append(f"stand-in {s.name}: {s.where} reads {text.strip()!r}, expected {s.expect!r}")
    if problems:
        raise RuntimeError("NeMo-Aligner CPU stand-ins do not match the installed stack (re-check each "
                           "against the new source):\n  " + "\n  ".join(problems))


def prepare(drop: tuple[str, ...] = ()) -> None:
    """Checks the pins, applies the import-time stand-ins not in ``drop``, imports the stack."""
    check_pins()
    for s in STANDINS:
        if s.before_import and s.name not in drop:
            s.apply()
    _module("nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor")
    _module("nemo_aligner.algorithms.reinforce")


def apply(drop: tuple[str, ...] = ()) -> None:
    """The run-time stand-ins, but those in ``drop`` (after prepare())."""
    unknown = sorted(set(drop) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown stand-ins {unknown}; known: {sorted(BY_NAME)}")
    for s in STANDINS:
        if not s.before_import and s.name not in drop:
            s.apply()


def install(drop: tuple[str, ...] = ()) -> None:
    """All stand-ins but those in ``drop``, and the stack imported."""
    prepare(drop)
    apply(drop)
