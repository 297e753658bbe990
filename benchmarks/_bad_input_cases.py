"""The bad inputs of benchmarks/bad_input_campaign.py, generated class by class.

A ``Case`` is one real ``megatron-dapo`` command line with one thing wrong, the text its error line
must contain (the bad key, file or value), and the paths that must be byte-for-byte the same after
it. ``Fixtures`` makes the good inputs once: a tiny HF model dir, data files, a finished run with
two checkpoints, a converted start checkpoint, and the same model at another width. Each class
breaks one kind of input every way listed in the issue; ``config_cases`` is generated from the
schema (every leaf key: a wrong type, a value out of range, a typo of its name), so a new key is
tried without anyone writing a case.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "conf" / "cpu_tiny.yaml")
TINY = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
            warmup_steps=1, num_train=40, num_val=8)
# A one-step run on the tiny model: a value the trainer accepts costs seconds, not the demo's minute.
SMALL = ["train.total_steps=1", "eval.every=0", "eval.before_train=false", "logging.tensorboard=false",
         "reward.num_workers=0", "data.prompts_per_step=4", "data.gen_prompts_per_batch=4",
         "train.mini_batch_prompts=2", "rollout.n=4", "algorithm.filter_groups.enable=false",
         "checkpoint.save_every=0"]


@dataclasses.dataclass(frozen=True)
class Case:
    cls: str  # the class of input (the table's row)
    name: str
    args: tuple[str, ...]  # after `megatron-dapo`
    names: str  # the error line must contain this (the bad key, file or value)
    guard: tuple[str, ...] = ()  # paths that must be unchanged (the run dir is always guarded)
    valid: str = ""  # accepted by design: why (then the run must succeed instead)
    cwd: str = ""


@dataclasses.dataclass
class Fixtures:
    root: Path
    hf: Path
    hf_wide: Path
    train: Path
    val: Path
    run: Path  # a finished 2-step run with checkpoints at steps 1 and 2
    converted: Path  # tools/convert_ckpt/hf_to_megatron.py of hf

    def train_args(self, run_dir: Path, *extra: str, hf: Path | None = None, train: Path | str | None = None,
                   val: Path | str | None = None) -> tuple[str, ...]:
        return ("train", "--config", CONFIG, "toy.enable=false", f"model.hf_path={hf or self.hf}",
                f"data.train_files=[{train or self.train}]", f"data.val_files=[{val or self.val}]",
                f"logging.dir={run_dir}", *SMALL, *extra)

    def fresh(self, name: str) -> Path:
        """A new, not yet existing run dir under the campaign root."""
        path = self.root / "runs" / name.replace("/", "_").replace(" ", "_")
        assert not path.exists(), path
        return path

    def copy(self, src: Path, name: str) -> Path:
        dst = self.root / "copies" / name.replace("/", "_").replace(" ", "_")
        shutil.copytree(src, dst)
        return dst


def make_fixtures(root: Path) -> Fixtures:
    """The good inputs (about 40 s on 2 cores: two tiny bases, one 2-step run, one conversion)."""
    from megatron_dapo.config import ToyConfig
    from megatron_dapo.toy import task
    from megatron_dapo.toy.base import make_toy_base

    root.mkdir(parents=True, exist_ok=True)
    hf = make_toy_base(root / "hf", seed=0, cfg=ToyConfig(**TINY))
    hf_wide = make_toy_base(root / "hf_wide", seed=0, cfg=ToyConfig(**{**TINY, "hidden_size": 48}))
    train, val = task.make_splits(seed=0, num_train=40, num_val=8, num_digits=5)
    fx = Fixtures(root, hf, hf_wide, task.write_parquet(train, root / "train.parquet"),
                  task.write_parquet(val, root / "val.parquet"), root / "run", root / "converted")
    _cli(fx.train_args(fx.run, "train.total_steps=2", "checkpoint.save_every=1"))
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt" / "hf_to_megatron.py"), "--hf-dir", str(hf),
                    "--out", str(fx.converted), "--no-progress"], cwd=ROOT, check=True, capture_output=True)
    return fx


def _cli(args: tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fixture command failed: {' '.join(args)}\n{out.stderr[-3000:]}")


# -- config: every leaf key of the schema ------------------------------------------------------------
def _leaves(cls: type, path: tuple[str, ...] = ()) -> list[tuple[str, typing.Any]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaves(hints[f.name], (*path, f.name))
        else:
            out.append((".".join((*path, f.name)), hints[f.name]))
    return out


def _kinds(tp) -> set[type | str]:
    """The value kinds an annotation admits: int, float, bool, str, tuple, 'literal', None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return {"literal"}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return set().union(*(_kinds(a) for a in args))
    if tp is type(None):
        return {None}
    return {origin or tp}


# Out-of-range values the schema accepts on purpose, with why (the run then has to succeed); none
# today: seed=-1 was one until the campaign showed it failing in the first generation.
IN_RANGE_BY_DESIGN: dict[str, str] = {}


def config_cases(fx: Fixtures) -> list[Case]:
    from megatron_dapo.config import DAPOConfig

    cases = []
    for key, tp in _leaves(DAPOConfig):
        kinds = _kinds(tp)
        leaf = key.rsplit(".", 1)[-1]
        typo = key[:-len(leaf)] + (leaf[:-1] if len(leaf) > 3 else leaf + "x")
        wrong = {bool: "maybe", int: "abc", float: "abc", tuple: "5", "literal": "nonsense"}
        bad_type = next((wrong[k] for k in (bool, int, float, tuple, "literal") if k in kinds), None)
        if bad_type is None and str in kinds:
            bad_type = "[1, 2]"  # a list where a string goes
        for name, override, names in (("wrong type", f"{key}={bad_type}", key), ("typo", f"{typo}=1", typo)):
            if override.endswith("=None"):
                continue
            cases.append(Case("config", f"{key}: {name}", fx.train_args(fx.fresh(f"cfg_{key}_{name}"), override),
                              names))
        if kinds & {int, float} and bool not in kinds:
            value = "-2" if key == "rollout.top_k" else "-1"
            cases.append(Case("config", f"{key}: out of range ({value})",
                              fx.train_args(fx.fresh(f"cfg_{key}_range"), f"{key}={value}"), key,
                              valid=IN_RANGE_BY_DESIGN.get(key, "")))
    for name, overrides, names in CROSS_FIELD:
        cases.append(Case("config", f"cross-field: {name}", fx.train_args(fx.fresh(f"cross_{name}"), *overrides),
                          names))
    cases.append(Case("config", "cross-field: clip-high under clip-low", fx.train_args(
        fx.fresh("cross_clip"), "loss.clip_ratio_low=0.3", "loss.clip_ratio_high=0.2"), "", valid="an asymmetric "
        "clip either way is a valid PPO objective; Clip-Higher is a choice of values, not a rule"))
    cases.append(Case("config", "missing --config file", ("train", "--config", str(fx.root / "nope.yaml")),
                      "nope.yaml"))
    bad_yaml = fx.root / "bad.yaml"
    bad_yaml.write_text("train:\n  total_steps: [1\n")
    cases.append(Case("config", "unparseable YAML", ("train", "--config", str(bad_yaml)), "bad.yaml"))
    return cases


# The smallest inconsistent pair of each cross-field rule (config_rules.validate_cross_section, setup's checks).
CROSS_FIELD = [
    ("mini-batch above the step", ["data.prompts_per_step=4", "train.mini_batch_prompts=8"],
     "train.mini_batch_prompts"),
    ("step not a multiple of the mini-batch", ["data.prompts_per_step=3", "train.mini_batch_prompts=2"],
     "mini_batch_prompts"),
    ("overlong buffer past the response", ["rollout.max_response_length=16", "reward.overlong_buffer.len=32"],
     "overlong_buffer"),
    ("micro-batch tokens under one sequence", ["train.max_tokens_per_micro_batch=10"], "max_tokens_per_micro_batch"),
    ("eval longer than the engine", ["rollout.max_response_length=16", "eval.max_response_length=32"],
     "eval.max_response_length"),
    ("TP above the world", ["parallel.tensor_model_parallel_size=2"], "tensor"),
    ("rollout TP above the world", ["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size"),
]


# -- data files ---------------------------------------------------------------------------------------
def data_cases(fx: Fixtures) -> list[Case]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = fx.root / "data"
    d.mkdir(exist_ok=True)
    rows = pq.read_table(fx.train).to_pylist()
    good = rows[0]

    def jsonl(name: str, lines: list[str]) -> Path:
        (d / name).write_text("".join(x + "\n" for x in lines))
        return d / name

    def row(**change) -> str:
        r = json.loads(json.dumps(good))
        for k, v in change.items():
            if v is _DROP:
                r.pop(k)
            else:
                r[k] = v
        return json.dumps(r)

    files: dict[str, tuple[Path, str]] = {}  # name -> (file, what the error names)
    files["missing file"] = (d / "absent.parquet", "absent.parquet")
    (d / "empty.parquet").write_bytes(b"")
    files["0-byte parquet"] = (d / "empty.parquet", "empty.parquet")
    pq.write_table(pa.Table.from_pylist(rows), d / "full.parquet")
    blob = (d / "full.parquet").read_bytes()
    (d / "truncated.parquet").write_bytes(blob[: len(blob) // 2])
    files["truncated parquet"] = (d / "truncated.parquet", "truncated.parquet")
    pq.write_table(pa.table({"question": ["1+1?"], "label": [2]}), d / "schema.parquet")
    files["wrong schema"] = (d / "schema.parquet", "schema.parquet")
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), d / "zero_rows.parquet")
    files["0-row parquet"] = (d / "zero_rows.parquet", "zero_rows.parquet")
    (d / "data.csv").write_text("prompt,answer\n1+1,2\n")
    files["unknown extension"] = (d / "data.csv", "data.csv")
    files["empty JSONL"] = (jsonl("empty.jsonl", []), "empty.jsonl")
    files["blank lines only"] = (jsonl("blank.jsonl", ["", "  "]), "blank.jsonl")
    for name, line in (("invalid JSON line", "{not json"), ("a JSON list line", "[1, 2]"),
                       ("a JSON string line", '"text"'), ("prompt missing", row(prompt=_DROP)),
                       ("prompt not a list", row(prompt="What is 2?")), ("prompt empty list", row(prompt=[])),
                       ("message without role", row(prompt=[{"content": "2?"}])),
                       ("message content empty", row(prompt=[{"role": "user", "content": ""}])),
                       ("message content a number", row(prompt=[{"role": "user", "content": 5}])),
                       ("ground truth missing", row(reward_model={"style": "rule"})),
                       ("ground truth a list", row(reward_model={"ground_truth": [1], "style": "rule"})),
                       ("ground truth empty", row(reward_model={"ground_truth": "", "style": "rule"})),
                       ("reward_model a string", row(reward_model="4")),
                       ("extra_info a list", row(extra_info=[1]))):
        key = name.replace(" ", "_")
        files[name] = (jsonl(f"{key}.jsonl", [json.dumps(good), line]), "line 2")
    (d / "latin1.jsonl").write_bytes(json.dumps(good).encode() + b"\n" +  # a Latin-1 byte, not UTF-8
                                     b'{"prompt": [{"role": "user", "content": "caf\xe9?"}], '
                                     b'"reward_model": {"ground_truth": "4"}}\n')
    files["non-UTF-8 text"] = (d / "latin1.jsonl", "latin1.jsonl")
    files["duplicates only, after dedup nothing new"] = (jsonl("dups.jsonl", [json.dumps(good)] * 3), "")
    huge = json.loads(json.dumps(good))
    huge["prompt"][0]["content"] = "What is the largest digit of " + "7" * 5000 + "?"
    files["every prompt too long"] = (jsonl("huge.jsonl", [json.dumps(huge)] * 2), "huge.jsonl")
    cases = []
    for name, (path, names) in files.items():
        for split in ("train", "val"):
            if split == "val" and name not in ("missing file", "0-row parquet", "invalid JSON line",
                                               "every prompt too long"):
                continue
            args = fx.train_args(fx.fresh(f"data_{split}_{name}"), **{split: path})
            valid = "a file of one distinct prompt is a small data set, not a bad one" if name.startswith("dup") else ""
            cases.append(Case("data", f"{split}: {name}", args, names or path.name, guard=(str(d),), valid=valid))
    return cases


_DROP = object()


# -- HF model dirs ------------------------------------------------------------------------------------
def hf_cases(fx: Fixtures) -> list[Case]:
    import torch

    cases = []

    def broken(name: str, change) -> Path:
        path = fx.copy(fx.hf, f"hf_{name}")
        change(path)
        return path

    def edit_config(**change):
        def go(path: Path):
            cfg = json.loads((path / "config.json").read_text())
            cfg.update(change)
            (path / "config.json").write_text(json.dumps(cfg))
        return go

    def rm(*names):
        return lambda path: [(path / n).unlink() for n in names]

    def write(name: str, text: str):
        return lambda path: (path / name).write_text(text)

    def index_absent(path: Path):
        (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
        weights = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                   "lm_head.weight": "model-00002-of-00002.safetensors"}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))

    def truncate(path: Path):
        blob = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(blob[: len(blob) // 2])

    def int8(path: Path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        save_file({k: v.to(torch.int8) for k, v in tensors.items()}, path / "model.safetensors")

    def vocab(path: Path):
        tok = json.loads((path / "tokenizer.json").read_text())
        tok["model"]["vocab"] = {f"t{i}": i for i in range(3)}
        (path / "tokenizer.json").write_text(json.dumps(tok))

    for name, change, names in (
            ("config.json missing", rm("config.json"), "config.json"),
            ("config.json not JSON", write("config.json", "{ not json"), "config.json"),
            ("config.json a list", write("config.json", "[1]"), "config.json"),
            ("unsupported architecture", edit_config(model_type="llama4", architectures=["Llama4ForCausalLM"]),
             "llama4"),
            ("a shape field missing", lambda p: _drop_config_key(p, "hidden_size"), "hidden_size"),
            ("quantised (int8) weights", int8, "I8"),
            ("weights missing", rm("model.safetensors"), "safetensors"),
            ("weights truncated", truncate, "model.safetensors"),
            ("index naming absent shards", index_absent, "model-00002-of-00002.safetensors"),
            ("tokenizer missing", rm("tokenizer.json", "tokenizer_config.json"), "tokenizer"),
            ("tokenizer not JSON", write("tokenizer.json", "{ not json"), "tokenizer.json"),
            ("tokenizer of another vocabulary", vocab, "vocab"),
            ("vocab_size smaller than the tokenizer's", edit_config(vocab_size=8), "vocab_size")):
        path = broken(name, change)
        cases.append(Case("hf dir", name, fx.train_args(fx.fresh(f"hf_{name}"), hf=path), names, guard=(str(path),)))
    path = broken("torch_dtype int8", edit_config(torch_dtype="int8"))
    cases.append(Case("hf dir", "config.json's torch_dtype int8 (fp32 weights)",
                      fx.train_args(fx.fresh("hf_dtype"), hf=path),
                      "", guard=(str(path),), valid="torch_dtype only says how the weights were stored: the "
                      "trainer reads the safetensors' own dtypes (checked) and trains in model.dtype"))
    cases.append(Case("hf dir", "a file, not a dir", fx.train_args(fx.fresh("hf_file"), hf=fx.train), "model.hf_path"))
    return cases


def _drop_config_key(path: Path, key: str) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop(key)
    (path / "config.json").write_text(json.dumps(cfg))


# -- checkpoints (resume and model.checkpoint) --------------------------------------------------------
def checkpoint_cases(fx: Fixtures) -> list[Case]:
    cases = []
    step2 = "checkpoints/step_00000002"

    def run_copy(name: str, change=None) -> Path:
        path = fx.copy(fx.run, f"run_{name}")
        if change:
            change(path)
        return path

    def both_broken(fn):
        def go(path: Path):
            for step in ("step_00000001", "step_00000002"):
                fn(path / "checkpoints" / step)
        return go

    def truncate_distcp(ck: Path):
        f = next(ck.glob("*.distcp"))
        f.write_bytes(f.read_bytes()[:100])

    def old_version(ck: Path):
        meta = json.loads((ck / "checkpoint.json").read_text())
        meta["format_version"] = meta.get("format_version", 1) + 100
        (ck / "checkpoint.json").write_text(json.dumps(meta))

    extra = ("train.total_steps=3",)
    for name, change, names, valid in (
            ("resume: latest missing a file", lambda p: next((p / step2).glob("*.distcp")).unlink(), "", "falls back "
             "to the intact step 1 (docs/reliability.md), with a warning"),
            ("resume: every checkpoint truncated", both_broken(truncate_distcp), "step_00000002", ""),
            ("resume: every checkpoint.json missing", both_broken(lambda c: (c / "checkpoint.json").unlink()),
             "step_00000002", ""),
            ("resume: checkpoint.json of another version", both_broken(old_version), "checkpoint.json", "")):
        path = run_copy(name.split(": ")[1], change)
        guard = () if valid else (str(path),)  # a fallback resumes, saves and prunes: its files change
        cases.append(Case("checkpoint", name, fx.train_args(path, *extra), names, guard=guard, valid=valid))
    path = run_copy("another shape")
    cases.append(Case("checkpoint", "resume: another model shape", fx.train_args(path, *extra, hf=fx.hf_wide),
                      "hidden_size", guard=(str(path),)))
    wide = fx.root / "converted_wide"
    if not wide.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt" / "hf_to_megatron.py"), "--hf-dir",
                        str(fx.hf_wide), "--out", str(wide), "--no-progress"], cwd=ROOT, check=True,
                       capture_output=True)
    for name, ckpt, hf, names in (
            ("model.checkpoint: another shape (converted)", wide, fx.hf, "hidden_size"),
            ("model.checkpoint: another shape (a run's checkpoints)", fx.run / "checkpoints", fx.hf_wide,
             "hidden_size"),
            ("model.checkpoint: a run dir, not its checkpoints", fx.run, fx.hf, "model.checkpoint"),
            ("model.checkpoint: an HF dir", fx.hf, fx.hf, "model.checkpoint"),
            ("model.checkpoint: missing", fx.root / "absent_ckpt", fx.hf, "absent_ckpt")):
        cases.append(Case("checkpoint", name, fx.train_args(fx.fresh(f"ckpt_{name}"), f"model.checkpoint={ckpt}",
                                                            hf=hf), names, guard=(str(ckpt),)))
    conv = fx.copy(fx.converted, "converted_as_run")
    cases.append(Case("checkpoint", "a converted checkpoint as checkpoint.dir",
                      fx.train_args(fx.fresh("conv_as_resume"), f"checkpoint.dir={conv}"), "checkpoint.dir",
                      guard=(str(conv),), valid="checkpoint.dir is where a run saves: a dir without step_* "
                      "checkpoints is a fresh run's, the converted files are left alone"))
    return cases


# -- the CLI's own flags ------------------------------------------------------------------------------
def cli_cases(fx: Fixtures) -> list[Case]:
    out = fx.root / "cli_out"
    run = ("--config", CONFIG, "toy.enable=false", f"model.hf_path={fx.hf}", f"data.train_files=[{fx.train}]",
           f"data.val_files=[{fx.val}]", "eval.n=1")  # the fixture run's own settings
    args = {
        "no subcommand": ((), "megatron-dapo"),
        "unknown subcommand": (("trian",), "trian"),
        "train: unknown flag": (("train", "--confg", CONFIG), "--confg"),
        "train: override without =": (("train", "--config", CONFIG, "train.total_steps"), "train.total_steps"),
        "train: override value not YAML": (("train", "--config", CONFIG, "train.total_steps=[1"), "train.total_steps"),
        "config: --world-size not a number": (("config", "--config", CONFIG, "--world-size", "two"), "two"),
        "config: --shape unknown": (("config", "--config", CONFIG, "--world-size", "8", "--shape", "9B"), "9B"),
        "plan: --gpu-memory-gb negative": (("plan", "--config", CONFIG, "--world-size", "8", "--shape", "7B",
                                            "--gpu-memory-gb", "-1"), "gpu-memory-gb"),
        "plan: --mfu above 1": (("plan", "--config", CONFIG, "--world-size", "8", "--shape", "7B", "--mfu", "3"),
                                "mfu"),
        "export: --out missing": (("export", *run, f"logging.dir={fx.run}"), "--out"),
        "export: --step not saved": (("export", *run, f"logging.dir={fx.run}", "--out", str(out), "--step", "7"), "7"),
        "export: --out not empty": (("export", *run, f"logging.dir={fx.run}", "--out", str(fx.hf)), str(fx.hf)),
        "export: a run dir without checkpoints": (("export", *run, f"logging.dir={fx.root / 'nothing'}", "--out",
                                                   str(out)), "nothing"),
        "eval: --step not saved, the run named by its directory": (("eval", str(fx.run), "--step", "7"), "7"),
        "eval: a run directory and --config": (("eval", str(fx.run), "--config", CONFIG), "--config"),
        "eval: an HF dir given as the run directory": (("eval", str(fx.hf)), str(fx.hf)),
        "export: a run directory and --config": (("export", str(fx.run), "--config", CONFIG, "--out", str(out)),
                                                 "--config"),
        "train: data.train_files empty": (fx.train_args(fx.fresh("no train files"), "data.train_files=[]"),
                                          "data.train_files"),
        "prepare-data: --train missing": (("prepare-data", "--out", str(out)), "--train"),
        "prepare-data: --train absent": (("prepare-data", "--train", str(fx.root / "absent.parquet"), "--out",
                                          str(out)), "absent.parquet"),
        "prepare-data: --out is a file": (("prepare-data", "--train", str(fx.train), "--out", str(fx.train)),
                                          str(fx.train)),
        "score: --responses absent": (("score", "--responses", str(fx.root / "absent.jsonl")), "absent.jsonl"),
    }
    cases = [Case("cli", name, a, names, guard=(str(fx.run), str(fx.hf))) for name, (a, names) in args.items()]
    cases.append(Case("cli", "eval: a run dir without checkpoints", ("eval", *run, f"logging.dir={fx.root / 'fresh'}"),
                      "", guard=(str(fx.hf),), valid="evaluates the starting weights (model.hf_path), as "
                      "`megatron-dapo eval` documents: how a base model is scored"))
    cases.append(Case("cli", "eval: a base model without training data", ("eval", *run, "data.train_files=[]",
                                                                         f"logging.dir={fx.root / 'base_eval'}"),
                      "", guard=(str(fx.hf),), valid="a model is scored on held-out data alone"))
    return cases


# -- the environment ----------------------------------------------------------------------------------
def env_cases(fx: Fixtures) -> list[Case]:
    cases = [Case("environment", "logging.dir under a file", fx.train_args(fx.train / "run"), "logging.dir"),
             Case("environment", "logging.dir in /proc", fx.train_args(Path("/proc/megatron_dapo_run")),
                  "/proc/megatron_dapo_run")]
    full = fx.root / "full_disk"
    if _small_fs(full, "256k"):
        cases.append(Case("environment", "a small disk (logging.dir on a 256 KiB tmpfs)",
                          fx.train_args(full / "run", "checkpoint.save_every=1"), "free on its file system"))
    ro = fx.root / "ro_checkout"
    if _read_only_copy(ro):
        cases.append(Case("environment", "a read-only checkout (the default logging.dir in it)",
                          ("train", "--config", "conf/cpu_tiny.yaml"), "logging.dir=runs/cpu_tiny", cwd=str(ro)))
    return cases


def _read_only_copy(path: Path) -> bool:
    """The package and conf/ copied onto a tmpfs at path, remounted read-only: a checkout on a
    read-only file system (a copy, so that nothing can touch the real one)."""
    if not _small_fs(path, "64m"):
        return False
    for name in ("megatron_dapo", "conf"):
        shutil.copytree(ROOT / name, path / name, ignore=shutil.ignore_patterns("__pycache__"))
    return subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode == 0


def _small_fs(path: Path, size: str) -> bool:
    """A tmpfs of ``size`` at path, where this machine lets us mount one (root in a privileged container)."""
    path.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


CLASSES = {"config": config_cases, "data": data_cases, "hf dir": hf_cases, "checkpoint": checkpoint_cases,
           "cli": cli_cases, "environment": env_cases}
