"""Conversion tables registered by HF architecture, and whole-state-dict conversion on top of them.

A table is a function ``ModelDims -> list[ParamMapping]`` (see decoder.py). ``conversion_table(config)``
looks it up by ``config["architectures"][0]`` (or ``model_type`` when a config has no architectures)
and resolves it for that config into a ``ConversionTable``: every concrete (layer-expanded) mapping,
indexed by HF name and by Megatron name under both layer specs.

The state-dict functions here hold whole models in memory; they are meant for small models and
tests. The streaming paths (checkpoint.py, export.py) use the same ``Task`` objects one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from torch import Tensor

from megatron_dapo.convert.mapping import ConversionError, ModelDims, ParamMapping, hf_sizes

TableFn = Callable[[ModelDims], list[ParamMapping]]
ConfigCheck = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Architecture:
    """A registered HF architecture: its table, the config settings it refuses (``check``: raises
    ConversionError), and the attention features the Megatron model must be built with to match it."""

    name: str
    model_type: str
    table: TableFn
    check: ConfigCheck | None
    qkv_bias: bool  # biases on the q/k/v projections (Qwen2) or none (Qwen3)
    qk_layernorm: bool  # RMSNorm over each head's query and key before RoPE (Qwen3)
    moe: bool = False  # MLPs of routed experts (Qwen3-MoE): a dense architecture's config reads as 0 experts


_ARCHITECTURES: dict[str, Architecture] = {}
_MODEL_TYPES: dict[str, str] = {}


def register_architecture(architecture: str, *, model_type: str, check_config: ConfigCheck | None = None,
                          qkv_bias: bool, qk_layernorm: bool, moe: bool = False):
    """Decorator registering a mapping-table function for an HF architecture (``Qwen2ForCausalLM``)."""

    def wrap(fn: TableFn) -> TableFn:
        if architecture in _ARCHITECTURES:
            raise ValueError(f"architecture {architecture} is already registered")
        _ARCHITECTURES[architecture] = Architecture(architecture, model_type, fn, check_config, qkv_bias,
                                                    qk_layernorm, moe)
        _MODEL_TYPES[model_type] = architecture
        return fn

    return wrap


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def architecture(config: Any) -> Architecture:
    """The registered architecture of an HF config (dict or PretrainedConfig), its settings checked:
    a ConversionError names what the model does not implement."""
    config = config_dict(config)
    name = architecture_of(config)
    if name not in _ARCHITECTURES:
        raise ConversionError(f"unsupported architecture {name}; supported: {supported_architectures()}")
    found = _ARCHITECTURES[name]
    if config.get("model_type", found.model_type) != found.model_type:
        raise ConversionError(f"architectures {name} with model_type {config['model_type']!r}; "
                              f"{name} is model_type {found.model_type!r}")
    if found.check is not None:
        found.check(config)
    return found


def config_dict(config: Any) -> dict[str, Any]:
    """An HF config as a plain dict: accepts a dict or a transformers ``PretrainedConfig``."""
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def architecture_of(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs:
        return archs[0]
    return _MODEL_TYPES.get(config.get("model_type", ""), f"<model_type {config.get('model_type')!r}>")


@dataclass(frozen=True)
class Task:
    """One concrete conversion: a mapping with its layer (and, for an expert's weight, its global
    expert index) filled in."""

    mapping: ParamMapping
    layer: int | None
    expert: int | None = None

    @property
    def hf_names(self) -> list[str]:
        return self.mapping.hf_names(self.layer, self.expert)

    def megatron_name(self, spec: str = "local") -> str:
        return self.mapping.megatron_name(self.layer, spec, self.expert)


class ConversionTable:
    """The mapping table of one architecture, resolved for one config's dims."""

    def __init__(self, architecture: str, dims: ModelDims, mappings: list[ParamMapping]):
        self.architecture, self.dims = architecture, dims
        # Layer-major order (embedding, layer 0 .. L-1, final norm, output): the order of a model's
        # parameters and of HF shards, so a streaming pass reads and writes files sequentially.
        self.tasks: list[Task] = []
        run: list[ParamMapping] = []
        for m in mappings + [None]:
            if m is not None and m.per_layer:
                run.append(m)
                continue
            self.tasks += [task for layer in range(dims.num_layers) for r in run
                           for task in _expand_experts(r, layer, dims.num_experts)]
            run = []
            if m is not None:
                self.tasks.append(Task(m, None))
        self._by_hf = {name: t for t in self.tasks for name in t.hf_names}
        if len(self._by_hf) != sum(len(t.hf_names) for t in self.tasks):
            raise ValueError(f"{architecture}: an HF name is mapped twice")
        self._by_megatron = {t.megatron_name(spec): t for t in self.tasks for spec in ("local", "te")}

    def hf_names(self) -> list[str]:
        return [n for t in self.tasks for n in t.hf_names]

    def task_for_hf(self, name: str) -> Task:
        if name not in self._by_hf:
            raise ConversionError(f"unexpected HF tensor {name!r}: no {self.architecture} mapping for it")
        return self._by_hf[name]

    def task_for_megatron(self, name: str) -> Task:
        if name not in self._by_megatron:
            raise ConversionError(f"unexpected Megatron parameter {name!r}: no {self.architecture} "
                                  "mapping for it")
        return self._by_megatron[name]

    def check_hf_shape(self, name: str, shape: Iterable[int]) -> None:
        task = self.task_for_hf(name)
        expected = task.mapping.hf_shapes(self.dims)[task.hf_names.index(name)]
        if tuple(shape) != tuple(expected):
            raise ConversionError(f"HF tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)} "
                                  f"for this {self.architecture} config")

    def check_names(self, names: Iterable[str]) -> None:
        """Exactly the table's HF names: report missing and unexpected ones together."""
        names = set(names)
        expected = set(self.hf_names())
        missing, unexpected = sorted(expected - names), sorted(names - expected)
        if missing or unexpected:
            raise ConversionError(f"{self.architecture} checkpoint does not match its config: "
                                  f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                                  f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")

    def check_parallel(self, tp_size: int, pp_size: int = 1, ep_size: int = 1) -> None:
        """Sizes Megatron must be able to split evenly at this TP / PP / EP (experts are split over TP
        as the dense MLP is: megatron's expert TP size defaults to TP)."""
        d = self.dims
        sizes = {"num_attention_heads": d.num_attention_heads, "intermediate_size": d.ffn_hidden_size,
                 "padded vocab size": d.padded_vocab_size}
        if d.num_experts:
            sizes["moe_intermediate_size"] = d.moe_ffn_hidden_size
        if ep_size > 1 and d.num_experts % ep_size:
            raise ConversionError(f"EP={ep_size} does not divide num_experts={d.num_experts}")
        if ep_size > 1 and not d.num_experts:
            raise ConversionError(f"EP={ep_size} for a dense {self.architecture} (no experts to split); use EP=1")
        bad = {k: v for k, v in sizes.items() if v % tp_size}
        # megatron-core 0.19.2 splits KV groups over TP, or (TP a multiple of the groups) splits the
        # fused QKV rows contiguously and all-gathers them in attention: either layout is a plain dim-0
        # split of linear_qkv, which is what the mapping does.
        if d.num_query_groups % tp_size and tp_size % d.num_query_groups:
            bad["num_key_value_heads"] = d.num_query_groups
        if bad:
            raise ConversionError(f"TP={tp_size} does not divide {bad}")
        if d.num_layers % pp_size:
            raise ConversionError(f"PP={pp_size} does not divide num_hidden_layers={d.num_layers}")


def _expand_experts(mapping: ParamMapping, layer: int, num_experts: int) -> list[Task]:
    """One task per expert for an expert's weight (global index order), else the layer's one task."""
    if not mapping.per_expert:
        return [Task(mapping, layer)]
    return [Task(mapping, layer, expert) for expert in range(num_experts)]


def model_sizes(config: Any) -> dict[str, Any]:
    """``hf_sizes`` of a config whose architecture is checked (``architecture``): a dense one has no
    experts whatever its config.json says. What the table, the model and the planner read."""
    config = config_dict(config)
    return hf_sizes(config, experts=architecture(config).moe)


def conversion_table(config: Any, *, padded_vocab_size: int | None = None) -> ConversionTable:
    """Resolve the registered table for an HF config (dict or PretrainedConfig)."""
    config = config_dict(config)
    found = architecture(config)
    dims = ModelDims.from_sizes(model_sizes(config), padded_vocab_size=padded_vocab_size)
    return ConversionTable(found.name, dims, found.table(dims))


# -- whole state dicts (small models, tests) ------------------------------------------------------
def hf_to_megatron_state_dict(table: ConversionTable, hf: Mapping[str, Tensor], *,
                              spec: str = "local") -> dict[str, Tensor]:
    """HF state dict -> full (TP=1) Megatron state dict, after checking names and shapes."""
    table.check_names(hf)
    for name, t in hf.items():
        table.check_hf_shape(name, t.shape)
    return {t.megatron_name(spec): t.mapping.to_megatron([hf[n] for n in t.hf_names], table.dims)
            for t in table.tasks}


def megatron_to_hf_state_dict(table: ConversionTable, megatron: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Full (TP=1) Megatron state dict (either spec's names) -> HF state dict."""
    out: dict[str, Tensor] = {}
    for name, full in megatron.items():
        task = table.task_for_megatron(name)
        out.update(zip(task.hf_names, task.mapping.to_hf(full, table.dims)))
    table.check_names(out)
    return out


def split_tp(table: ConversionTable, megatron: Mapping[str, Tensor], tp_size: int) -> list[dict[str, Tensor]]:
    """Full Megatron state dict -> one state dict per TP rank, in Megatron's TP layouts."""
    table.check_parallel(tp_size)
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]
    for name, full in megatron.items():
        for rank, piece in enumerate(table.task_for_megatron(name).mapping.tp_split(full, tp_size)):
            shards[rank][name] = piece
    return shards


def merge_tp(table: ConversionTable, shards: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Inverse of ``split_tp``."""
    return {name: table.task_for_megatron(name).mapping.tp_merge([s[name] for s in shards])
            for name in shards[0]}
