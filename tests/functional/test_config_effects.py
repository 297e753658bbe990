"""Every config key has an effect: each non-default value changes something observable in a one-step
run of the real trainer, or is refused up front (tests/unit/test_config_keys.py only checks that each
leaf key is read somewhere).

Every leaf of ``DAPOConfig`` (``leaves``) is in exactly one table (``test_every_key_is_classified``,
so a new key fails until someone classifies it):

(a) ``CASES``: ``megatron-dapo train --config conf/cpu_tiny.yaml`` with ``BASE`` (one step, tiny
    batches) and the key at one non-default value, against a reference run made the same way that
    differs from it in that key alone: the baseline, or the baseline plus a context the key needs to
    matter (``Case.context``: e.g. dynamic sampling on for data.gen_prompts_per_batch; both runs have
    it). An effect is a difference in what the run leaves behind: metrics.jsonl (values, the set of
    keys, the number of records; ``time`` and ``timing_s/*`` never count), the files of the run dir
    (TensorBoard events, checkpoints, checkpoint.json / trainer_state.json fields), stdout, stderr
    and the run's log lines, its exit code, or the process's torch thread count (num_threads).
    Echoes of the value (config.yaml, toy/.complete, W&B's config) never count.
(b) ``REFUSED``: the value is refused before anything is written: exit 2, one line
    ``megatron-dapo: config error: ...`` (``error:`` for the input checks) naming the key; the run dir
    is unchanged.
(c) ``GPU_ONLY``: values this CPU machine cannot run and the code accepts here, with the reason and
    the GPU-marked test (tests/gpu, tools/gpu_smoke.sh) that covers them.
    ``NO_EFFECT_ON_CPU``: keys whose non-default values are accepted and change nothing a one-step
    run on this machine shows, with why they are not refused and what covers them elsewhere.

How it runs (about 3 minutes on 2 cores): the toy base is made once (``base``, warm-up 40 steps: the format, not the
task; the heads of conf/cpu_tiny_vllm.yaml so the vLLM run can reuse it) and copied into each run dir. Runs
are in-process through ``cli.main`` (~1 s each; megatron's parallel state is destroyed after
each, and curves.png, a plot of metrics.jsonl that no key configures, is skipped); toy.* and seed
runs make their own base with a 1-step warm-up. The 2-process cases (parallel sizes, rollout TP,
the vLLM engine) run in one torchrun job driving several runs (``dist``), and the signal case
(checkpoint.stop_grace_s) in one subprocess (its abandoned step ends the process); the runners live in
tests/helpers/config_effects_runs.py, this module holds the cases.
"""

import dataclasses
import importlib.util
import time
from typing import Callable

import pytest

from megatron_dapo.config import DAPOConfig
from tests.helpers.config_effects_runs import Result, Runs, make_runs, run_dist, signalled, train_in_process
from tests.helpers.config_effects_tables import GPU_ONLY, NO_EFFECT_ON_CPU, REFUSED
from tests.helpers.config_fields import leaves
from tests.helpers.planted import RUN_OVERRIDES
from tests.helpers.records import timed
from tests.helpers.planted import registered as planted_registered

pytestmark = [pytest.mark.slow]
TOY = {"toy.warmup_steps": "1"}  # runs that make their own base
MOE = {**TOY, "toy.architecture": "qwen3_moe"}  # a base of its own, every MLP a router over experts
TWO = {"train.total_steps": "2"}
FILTER = {"algorithm.filter_groups.enable": "true"}
KV = {"rollout.kv_cache_memory_mb": "64"}  # 2-process runs: vLLM on CPU needs it, the hf engine ignores it
REAL = {"toy.enable": "false", "model.hf_path": "{base}/toy_base", "data.train_files": "[{data}]",
        "data.val_files": "[{base}/toy_data/val.parquet]"}  # a real model dir and data files, no demo
# ... whose answers are written "4.0": the value scorer (dapo_math) takes "Answer: 4", the paper's rule does not
DECIMAL = REAL | {"data.train_files": "[{root}/decimal_train.jsonl]", "data.val_files": "[{root}/decimal_val.jsonl]"}
END_TIME = str(int(time.time()) + 36_000)  # a job end 10 h away (time_limit.py)
# The planted hack (tests/helpers/planted.py): a quarter of the responses "Answer: Answer: <digit>".
PLANT = RUN_OVERRIDES
ALL_CORRECT = {"reward.fn": "planted_all"}
SHORT = {"rollout.max_response_length": "1", "eval.max_response_length": "1",
         "reward.overlong_buffer.len": "1"}  # no answer line fits


# -- checks: (run with the value, reference) -> whether they differ the way the key says -----------
def metric(*names: str) -> Callable:
    return lambda a, b: any(a.last.get(n) != b.last.get(n) for n in names)


def prefix(p: str) -> Callable:  # any value of metrics under this prefix
    return lambda a, b: {k: v for k, v in a.last.items() if k.startswith(p)} != \
        {k: v for k, v in b.last.items() if k.startswith(p)}


def records(a, b) -> bool:
    return a.records != b.records


def ckpt(*path: str, file: str = "checkpoint.json") -> Callable:
    def get(r):
        d = r.ckpt(file)
        for p in path:
            d = d.get(p, {}) if isinstance(d, dict) else d
        return d
    return lambda a, b: get(a) != get(b) and get(a) != {}


def text(where: str, s: str) -> Callable:  # the line is in this run's output and not the reference's
    return lambda a, b: s in getattr(a, where) and s not in getattr(b, where)


def alarm(name: str, raised_by_value: bool = True) -> Callable:  # raised with the value, not without (or reverse)
    line = f"alarm {name} at step 1"
    return lambda a, b: (line in a.logs, line in b.logs) == (raised_by_value, not raised_by_value)


def dump_rows(r, name: str = "samples/step_00000001.jsonl") -> int:
    path = r.dir / name
    return len(path.read_text().splitlines()) if path.exists() else 0


def trace_bytes(r) -> int:
    return sum(p.stat().st_size for p in (r.dir / "profile").glob("*.json"))


def ok(a, b) -> bool:
    return a.rc == 0 and not a.error


@dataclasses.dataclass(frozen=True)
class Case:
    value: str
    check: Callable
    context: dict = dataclasses.field(default_factory=dict)
    via: str = "local"  # local (in-process), dist (the torchrun job), grace (the signal subprocess)
    env: tuple = ()


C = Case
CASES: dict[str, Case] = {
    "seed": C("2", records, TOY),
    "num_threads": C("2", lambda a, b: (a.threads, b.threads) == (2, 1)),
    "model.checkpoint": C("{base}/checkpoints",
                          lambda a, b: text("logs", "from " + str(a.dir.parent / "base/checkpoints"))(a, b)
                          and metric("actor/pg_loss")(a, b)),
    "model.dtype": C("bf16", prefix("actor/")),
    "model.make_vocab_size_divisible_by": C("1000", ckpt("padded_vocab_size")),
    "parallel.tensor_model_parallel_size": C("2", ckpt("layout", "tp"), KV, via="dist"),
    "parallel.pipeline_model_parallel_size": C("2", ckpt("layout", "pp"), KV, via="dist"),
    "parallel.context_parallel_size": C("2", ckpt("layout", "cp"), KV, via="dist"),
    "parallel.use_distributed_optimizer": C("true", ckpt("distributed_optimizer")),
    "parallel.expert_model_parallel_size": C("2", ckpt("layout", "ep"), {**MOE, **KV}, via="dist"),
    "data.dedup": C("false", ckpt("sampler", "num_items", file="trainer_state.json"),
                    REAL | {"data.on_bad_row": "skip"}),
    "data.on_bad_row": C("skip", lambda a, b: ok(a, b) and b.rc == 2 and "line 3" in b.err, REAL),
    "data.max_prompt_length": C("100", ckpt("sampler", "num_items", file="trainer_state.json"),
                                REAL | {"data.on_bad_row": "skip"}),
    "data.shuffle": C("false", metric("rollout/token_prob_mean")),  # other prompts
    "data.prompts_per_step": C("2", metric("actor/num_updates")),
    "data.gen_prompts_per_batch": C("16", metric("dynamic_sampling/num_groups_generated"), FILTER),
    "rollout.engine": C("vllm", lambda a, b: text("logs", "(vllm engine")(a, b) and records(a, b), KV, via="dist"),
    "rollout.n": C("4", metric("actor/num_seqs")),
    "rollout.temperature": C("0.5", metric("rollout/token_prob_mean")),
    "rollout.top_p": C("0.5", metric("rollout/token_prob_mean")),
    "rollout.top_k": C("2", metric("rollout/token_prob_mean")),
    "rollout.max_response_length": C("24", metric("reward/overlong_penalty_mean")),
    "rollout.tensor_parallel_size": C("2", text("logs", "rollout: 1 replica(s) of rollout TP 2 (hf engine)"), KV,
                                      via="dist"),
    "rollout.kv_cache_memory_mb": C("64", lambda a, b: ok(a, b) and b.rc == 2 and "rollout.kv_cache_memory_mb" in b.err,
                                    {"rollout.engine": "vllm", "rollout.kv_cache_memory_mb": "0"}, via="dist"),
    # responses longer than a piece are carried: the step's groups differ; 8 tokens cut fewer than 4
    "rollout.partial": C("true", metric("rollout/version_lag_max", "response_length/mean"),
                         {"train.old_log_probs": "trainer"}),
    "rollout.partial_tokens": C("8", metric("rollout/partial_responses"),
                                {"train.old_log_probs": "trainer", "rollout.partial": "true"}),
    "rollout.partial_unfinished": C("abort", lambda a, b: max(r.get("rollout/aborted_tokens", 0) for r in a.records) > 0
                                    and max(r["rollout/carried_groups"] for r in a.records) == 0
                                    and max(r["rollout/carried_groups"] for r in b.records) > 0,
                                    FILTER | {"train.old_log_probs": "trainer", "rollout.partial": "true",
                                              "data.gen_prompts_per_batch": "16", "rollout.partial_tokens": "4"}),
    "rollout.check_logprob_mismatch": C("false",
                                        lambda a, b: "rollout/logprob_mismatch" in b.last.keys() - a.last.keys()),
    "algorithm.adv_estimator": C("grpo_mean_only", metric("actor/pg_loss")),
    "algorithm.adv_eps": C("0.5", metric("actor/pg_loss")),
    "algorithm.norm_adv_by_std_in_grpo": C("false", metric("actor/pg_loss")),
    "algorithm.filter_groups.enable": C("true", metric("dynamic_sampling/num_groups_generated")),
    "algorithm.filter_groups.max_num_gen_batches": C("1", lambda a, b: "max_num_gen_batches=1" in a.error and ok(b, a),
                                                     FILTER | {"data.gen_prompts_per_batch": "4",
                                                               "algorithm.filter_groups.on_exhausted": "error"}),
    # one batch of 4 prompts keeps too few mixed groups: the default fills the step, "error" stops
    "algorithm.filter_groups.on_exhausted": C("error", lambda a, b: "max_num_gen_batches=1" in a.error
                                              and b.last.get("dynamic_sampling/num_filled", 0) > 0,
                                              FILTER | {"algorithm.filter_groups.max_num_gen_batches": "1",
                                                        "data.gen_prompts_per_batch": "4"}),
    # the second step's first batch is sized by step 1's keep rate: other prompts, other records
    "algorithm.filter_groups.adaptive": C("true", records, FILTER | TWO),
    "algorithm.filter_groups.max_gen_prompts": C("4", records,
                                                 FILTER | TWO | {"algorithm.filter_groups.adaptive": "true"}),
    "algorithm.filter_groups.surplus": C("carry", lambda a, b: "dynamic_sampling/num_surplus_carried" in a.last
                                         and "dynamic_sampling/num_surplus_carried" not in b.last),
    "loss.policy_loss": C("cispo", lambda a, b: "actor/is_weight_mean" in a.last
                          and "actor/is_weight_mean" not in b.last),
    "loss.clip_ratio_low": C("0.01", metric("actor/pg_clipfrac_low")),
    "loss.clip_ratio_high": C("0.01", metric("actor/pg_clipfrac_high")),
    "loss.clip_ratio_c": C("1.3", metric("actor/pg_clipfrac_dual"), {"optim.lr": "0.05"}),
    "loss.loss_agg_mode": C("seq-mean-token-mean", metric("actor/pg_loss")),
    "loss.loss_scale_factor": C("7", metric("actor/pg_loss"), {"loss.loss_agg_mode": "seq-mean-token-sum-norm"}),
    # rollout correction weighs a recomputed pi_old against the engine's log-probs
    "algorithm.rollout_correction.rollout_is": C("token", lambda a, b: "rollout_corr/is_mean" in a.last
                                                 and "rollout_corr/is_mean" not in b.last,
                                                 {"train.old_log_probs": "trainer"}),
    "algorithm.rollout_correction.rollout_rs": C("token_k2", lambda a, b: "rollout_corr/token_masked_frac" in a.last
                                                 and "rollout_corr/token_masked_frac" not in b.last,
                                                 {"train.old_log_probs": "trainer",
                                                  "algorithm.rollout_correction.rollout_rs_threshold": "0.1"}),
    "reward.fn": C("dapo_math", metric("reward/acc_mean"), DECIMAL),
    "reward.overlong_buffer.enable": C("false", metric("reward/overlong_penalty_mean")),
    "reward.overlong_buffer.len": C("8", metric("reward/overlong_penalty_mean")),
    "reward.overlong_buffer.penalty_factor": C("0.5", metric("reward/overlong_penalty_mean")),
    "reward.overlong_filter": C("true", metric("actor/pg_loss")),
    "optim.lr": C("0.01", metric("actor/lr")),
    "optim.lr_warmup_steps": C("0", metric("actor/lr")),
    "optim.weight_decay": C("0.1", metric("actor/ratio_mean")),
    # The first Adam step is the same for any betas (bias correction): the third update's ratio shows them.
    "optim.adam_beta1": C("0.5", metric("actor/ratio_mean"), {"train.mini_batch_prompts": "1"}),
    "optim.adam_beta2": C("0.9", metric("actor/ratio_mean"), {"train.mini_batch_prompts": "1"}),
    "optim.adam_eps": C("0.001", metric("actor/ratio_mean")),
    "optim.clip_grad": C("0.01", metric("actor/ratio_mean")),  # the toy's norms are below the 1.0 of cpu_tiny
    "train.total_steps": C("2", lambda a, b: [r["step"] for r in a.records] == [1, 2]
                           != [r["step"] for r in b.records]),
    "train.mini_batch_prompts": C("4", metric("actor/num_updates")),
    "train.ppo_epochs": C("2", metric("actor/num_updates")),
    "train.micro_batch_size": C("4", metric("actor/num_micro_batches")),
    "train.max_tokens_per_micro_batch": C("200", metric("actor/num_micro_batches")),
    # the demo's samples are too alike in length for packing to save a micro-batch at any budget it allows;
    # the same budget packed sums the loss in other micro-batches (the padded run is the case above's, cached)
    "train.pack_sequences": C("true", metric("actor/pg_loss", "actor/grad_norm"),
                              {"train.max_tokens_per_micro_batch": "200"}),
    "train.old_log_probs": C("trainer", lambda a, b: timed(a.dir, "old_log_probs")
                             and not timed(b.dir, "old_log_probs")),
    "actor.offload_during_rollout": C("true", lambda a, b: "actor/offloaded_gb" in a.last.keys() - b.last.keys()),
    "actor.offload_weights": C("true", metric("actor/offloaded_gb"), {"actor.offload_during_rollout": "true"}),
    "train.generation_budget": C("1", lambda a, b: (len(a.records), len(b.records)) == (1, 2), TWO),
    "eval.every": C("1", lambda a, b: "eval/avg@1" in a.records[0] and "eval/avg@1" not in b.records[0], TWO),
    "eval.before_train": C("true", lambda a, b: a.records[0]["step"] == 0 != b.records[0]["step"]),
    "eval.n": C("2", lambda a, b: "eval/avg@2" in a.last and "eval/avg@2" not in b.last),
    "eval.temperature": C("0.1", prefix("eval/"), {"eval.n": "4"}),
    "eval.top_p": C("0.2", prefix("eval/")),
    "eval.max_response_length": C("8", metric("eval/truncation_rate")),
    "eval.reward_fn": C("dapo_math", metric("eval/avg@4"), DECIMAL | {"eval.n": "4"}),
    "checkpoint.dir": C("{run}/elsewhere", lambda a, b: any(f.startswith("elsewhere/step_00000001/") for f in a.files)
                        and not any(f.startswith("checkpoints/") for f in a.files)),
    "checkpoint.save_every": C("1", lambda a, b: "checkpoints/step_00000001/checkpoint.json" in a.files - b.files, TWO),
    "checkpoint.keep_last": C("1", lambda a, b: "checkpoints/step_00000001/checkpoint.json" in b.files - a.files,
                              TWO | {"checkpoint.save_every": "1"}),
    "checkpoint.memory_efficient_save": C("false", ckpt("memory_efficient_save"),
                                          {"parallel.use_distributed_optimizer": "true"}),
    "checkpoint.async_save": C("true", text("logs", "written in the background")),
    "checkpoint.resume": C("never", text("out", "final evaluation"), {"_copy": "all"}),
    "checkpoint.stop_grace_s": C("0", lambda a, b: "abandoning the step" in a.err and "stopped by SIGTERM" in b.out,
                                 {"train.total_steps": "20"}, via="grace"),
    "checkpoint.time_limit_margin_s": C("1e6", text("out", "stopped by the job's time limit after step 0"),
                                        env=(("MEGATRON_DAPO_END_TIME", END_TIME),)),
    "logging.dir": C("{run}", lambda a, b: "metrics.jsonl" in a.files and "checkpoints/latest" in a.files),
    "logging.tensorboard": C("true", lambda a, b: any("tfevents" in f for f in a.files - b.files)),
    "logging.wandb": C("true", lambda a, b: any(f.startswith("wandb/") for f in a.files - b.files),
                       env=(("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"))),
    "logging.samples_every": C("0", lambda a, b: dump_rows(b) > 0 == dump_rows(a)),
    "logging.samples_per_step": C("8", lambda a, b: 0 < dump_rows(a) < dump_rows(b)),
    "alarms.enable": C("false", lambda a, b: "alarm/no_answer_line" in b.last.keys() - a.last.keys()),
    "alarms.audit_fn": C("none", alarm("scorer_disagreement", False), PLANT),
    "alarms.scorer_disagreement": C("0.9", alarm("scorer_disagreement", False), PLANT),
    "alarms.repeated_answer_label": C("0.9", alarm("repeated_answer_label", False), PLANT),
    "alarms.no_answer_line": C("1.0", alarm("no_answer_line", False), SHORT),
    "alarms.identical_groups": C("1.0", alarm("identical_groups", False), {"rollout.temperature": "0.01"}),
    "alarms.entropy_min": C("10", alarm("entropy_collapse")),
    "alarms.mismatch_max": C("1.0", alarm("mismatch_spike")),  # fp32 engine and trainer: 1 + ~1e-7
    "alarms.all_correct": C("1.0", alarm("all_correct", False), ALL_CORRECT | {"alarms.all_correct_steps": "1"}),
    "alarms.all_correct_steps": C("1", alarm("all_correct"), ALL_CORRECT),
    "alarms.max_samples": C("1", lambda a, b: dump_rows(a, "samples/alarm_00000001_repeated_answer_label.jsonl") == 1
                            < dump_rows(b, "samples/alarm_00000001_repeated_answer_label.jsonl"), PLANT),
    "profile.steps": C("[1,1]", lambda a, b: trace_bytes(a) > 0 == trace_bytes(b)),
    "profile.with_stack": C("true", lambda a, b: trace_bytes(a) > trace_bytes(b) > 0, {"profile.steps": "[1,1]"}),
    "data.skip_solved_after": C("1", metric("ledger/retired"), ALL_CORRECT),
    "logging.progress": C("false", lambda a, b: "step 1/1 |" in b.out and "step 1/1 |" not in a.out),
    "logging.progress_every_s": C("0", lambda a, b: "  step 1/1 updating | update " in a.out
                                  and "  step 1/1 " not in b.out),
    "toy.num_digits": C("4", records, TOY),
    "toy.min_digits": C("4", records, TOY),
    "toy.num_train": C("100", ckpt("sampler", "num_items", file="trainer_state.json"), TOY),
    "toy.num_val": C("4", text("logs", "val.parquet: 4 prompts"), TOY),
    "toy.architecture": C("qwen3", ckpt("model_shape", "qk_layernorm"), TOY),
    "toy.hidden_size": C("32", ckpt("model_shape", "hidden_size"), TOY),
    "toy.head_dim": C("16", ckpt("model_shape", "kv_channels"), {**TOY, "toy.architecture": "qwen3"}),  # 0: 64 / 2
    "toy.intermediate_size": C("96", ckpt("model_shape", "ffn_hidden_size"), TOY),
    "toy.num_experts": C("4", ckpt("model_shape", "num_moe_experts"), MOE),
    "toy.num_experts_per_tok": C("3", prefix("actor/"), MOE),
    "toy.moe_intermediate_size": C("32", ckpt("model_shape", "moe_ffn_hidden_size"), MOE),
    "moe.load_balancing": C("none", prefix("moe/"), MOE),  # its loss leaves the metrics
    "moe.aux_loss_coeff": C("0.5", metric("actor/grad_norm"), MOE),
    "moe.z_loss_coeff": C("0.01", prefix("moe/"), MOE),  # moe/z_loss appears
    "moe.router_replay": C("R3", prefix("moe/"), MOE),  # moe/route_agreement appears
    "rollout.dtype": C("bf16", metric("rollout/logprob_abs_diff_max")),
    "toy.num_layers": C("1", ckpt("model_shape", "num_layers"), TOY),
    "toy.num_attention_heads": C("4", ckpt("model_shape", "num_attention_heads"), TOY),
    "toy.num_key_value_heads": C("2", ckpt("model_shape", "num_query_groups"), TOY),
    "toy.tie_word_embeddings": C("false", ckpt("files", "__0_0.distcp"), TOY),
    "toy.warmup_steps": C("1", records),  # its own base vs the module's 20-step one
    "toy.warmup_batch_size": C("8", records, TOY),
    "toy.warmup_lr": C("0.01", records, TOY),
    "toy.reasoning_prob": C("0.0", records, TOY),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    with planted_registered():  # the PLANT cases' engine and scorers, for this module's runs only
        yield make_runs(tmp_path_factory.mktemp("effects"))


@pytest.fixture(scope="module")
def dist(runs) -> dict:
    """Every 2-process run the cases need (with and without the value), in one torchrun job; vLLM last."""
    wanted = {}
    for key, case in CASES.items():
        if case.via == "dist" and (importlib.util.find_spec("vllm") is not None
                                   or "rollout.engine" not in case.context | {key: 1}):
            for s in (case.context | {key: case.value}, case.context):
                wanted[frozenset(s.items())] = s
    return run_dist(runs, list(wanted.values()))


def _pair(runs, dist, key: str, case: Case) -> tuple[Result, Result]:
    settings = case.context | {key: case.value}
    if case.via == "dist":
        if "rollout.engine" in settings:
            pytest.importorskip("vllm", reason="vLLM is not installed (./install.sh vllm)")
        return dist[frozenset(settings.items())], dist[frozenset(case.context.items())]
    if case.via == "grace":
        return tuple(signalled(runs, settings, case.context))
    return runs(settings, case.env), runs(case.context, case.env)


@pytest.mark.parametrize("key", list(CASES))
def test_a_non_default_value_changes_the_run(runs, request, key):
    case = CASES[key]
    dist = request.getfixturevalue("dist") if case.via == "dist" else None
    a, b = _pair(runs, dist, key, case)
    for r in (a, b):
        if key not in ("data.on_bad_row", "algorithm.filter_groups.max_num_gen_batches",
                       "algorithm.filter_groups.on_exhausted", "rollout.kv_cache_memory_mb"):  # one run errs
            assert r.rc == 0 and not r.error, f"{key}: a run failed:\n{r.err[-3000:]}{r.error}"
    assert case.check(a, b), (f"{key}={case.value} (context {case.context}) changed nothing this case observes;\n"
                              f"with it: {a.last}\nwithout: {b.last}\n{a.err[-1500:]}{a.error}")


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_refused_value_is_one_line_and_touches_nothing(runs, key):
    value, context = REFUSED[key]
    run_dir = runs.root / f"refused_{key}"
    runs.prepare(context, run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    r = train_in_process(run_dir, runs.args(context | {key: value}, run_dir), {})
    line = r.err.strip().splitlines()[-1] if r.err.strip() else ""
    assert r.rc == 2, f"{key}={value} was not refused: rc={r.rc}\n{r.err[-2000:]}{r.error}"
    assert line.startswith(("megatron-dapo: config error: ", "megatron-dapo: error: ")) and key in line, r.err
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err, r.err
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before, "the refused run wrote to its dir"


def test_every_key_is_classified():
    keys = [k for k, _, _ in leaves(DAPOConfig)]
    tables = {"CASES": CASES, "REFUSED": REFUSED, "GPU_ONLY": GPU_ONLY, "NO_EFFECT_ON_CPU": NO_EFFECT_ON_CPU}
    seen = [k for t in tables.values() for k in t]
    assert not [k for k in seen if k not in keys], "classified keys that are not in the schema"
    assert sorted(seen) == sorted(set(seen)), "a key in two tables"
    missing = [k for k in keys if k not in seen]
    assert not missing, f"unclassified keys: give each a case, a refusal, or a reason: {missing}"


def test_the_baseline_is_deterministic(runs):
    """Runs later in the process than the base (after ~80 others) record the same numbers, so a
    difference above is the key's, not the order's."""
    again = runs({"_again": "1"})
    assert again.records == runs({}).records
