"""Everything a training run needs before its first step, in one place, in two calls:
``prepare_run`` (steps 1 to 3, and the trainer state of the checkpoint the run resumes from:
enough for the caller to decide whether anything is left to do) and ``build_run`` (steps 4, 5).

Order matters. (1) Cheap checks first, so that bad input fails in seconds as one line
(errors.InputError) and leaves the run directory untouched: the rollout layout and engine, the HF
dir, the data files (loaded and tokenised: every rank, so the sampler state is the same everywhere)
and the shape of the checkpoint the run would resume from. (2) Rank 0 locks the run directory
(run_lock.py) before anything is written there. (3) With ``toy.enable``, the CPU demo's task and
base model are made inside the run directory by one call (toy/bootstrap.py), before any
collective; nothing else here knows about the demo. (4) The
actor starts torch.distributed and Megatron's parallel state and loads the latest intact checkpoint
of the run (resume), else ``model.checkpoint``, else the HF weights of ``model.hf_path`` directly
(each rank reads its own shard: no conversion step). (5) Every rank builds its rollout engine (its
share of a replica, rollout/placement.py) and, on replica leaders, a reward pool.
"""

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo import ranks
from megatron_dapo.config import DAPOConfig, DataConfig, EvalConfig, RewardConfig, RolloutConfig
from megatron_dapo.config_derived import Derived, derive, derive_for_model
from megatron_dapo.errors import InputError
from megatron_dapo.launch_checks import (
    check_against_model, check_checkpoint_shape, check_checkpoints, check_settings, check_start_checkpoint,
)
from megatron_dapo.trainer_state import TrainerState

if TYPE_CHECKING:  # the placements import torch: set-up's checks run before it loads
    from megatron_dapo.rollout.placements import Placement

logger = logging.getLogger("megatron_dapo.run")


@dataclass
class Inputs:
    """What a run reads from the user's files, checked before anything is built."""

    hf_config: dict  # model.hf_path's config.json
    resume_from: Path | None  # the latest intact checkpoint of the run (checkpoint.resume=auto), or eval's step
    tokenizer: Any
    stops: list[int]
    train_ids: list[list[int]]
    train_truths: list[str]
    val_ids: list[list[int]]
    val_truths: list[str]


@dataclass(frozen=True)
class EvalOnly:
    """A job that evaluates the run (``megatron-dapo eval``): it reads no training data, takes no
    lock (a live run may be read) and evaluates the checkpoint of ``step`` (None: the newest intact
    one, else the starting weights)."""

    step: int | None = None


@dataclass
class Prepared:
    """A run whose inputs are checked and whose directory is held, before anything is built:
    enough to decide whether there is anything left to do."""

    cfg: DAPOConfig  # as resolved: with toy.enable, the demo's data files and base filled in
    rank: int
    world_size: int
    dir: Path
    ckpt_dir: Path
    inputs: Inputs
    resume: TrainerState | None  # the state of the checkpoint resumed from (or evaluated); None: a fresh start
    lock: Any = None  # run_lock.RunDirLock on rank 0 of a trainer
    engines: Any = None  # rollout.separate.RemoteEngines with rollout.placement=separate, else None
    derived: tuple[Derived, ...] = ()  # the settings set-up derived (config_derived.py), in order
    eval_only: EvalOnly | None = None  # an evaluation job, not a training run

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@dataclass(kw_only=True)
class Run(Prepared):
    """A prepared run with what build_run made for it."""

    actor: Any
    placement: "Placement"  # this rank's rollout engines (rollout/placements.py)
    pool: Any  # replica leaders only (None elsewhere)
    sampler: Any

    def close(self) -> None:
        """Ends the reward workers and this rank's engine (before cli tears the process group down:
        an in-process vLLM tears its own groups down first) and releases the run directory. Remote
        engines (separate placement) are train()'s to stop: it knows whether the run failed."""
        try:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            self.placement.shutdown()
        finally:  # a failing engine teardown must not keep the run directory locked
            self.release()


def prepare_run(cfg: DAPOConfig, *, lock: bool = True, engines=None, eval_only: EvalOnly | None = None) -> Prepared:
    """Steps (1) to (3) of the module docstring, and the resume point's trainer state. ``lock``:
    take the run directory (training); a worked example reads a live run without it. ``engines``:
    the remote engines of a separate placement (this process is then a trainer of its own world).
    ``eval_only``: an evaluation job (no lock, no training data, the checkpoint it names)."""
    import torch

    rank, world = ranks.rank(), ranks.world_size()
    lock = lock and eval_only is None
    cfg, derived = derive(cfg, on_gpu=torch.cuda.is_available())  # every derived setting, resolved once
    _log_derived(rank, derived)
    check_settings(cfg, world if engines is None else engines.split.num_engines)
    if cfg.num_threads:
        # Tiny CPU matmuls gain nothing from threads, and several processes on few cores spend
        # their time in OpenMP barriers (docs/cpu_compat.md).
        torch.set_num_threads(cfg.num_threads)
    run_dir = Path(cfg.logging.dir)
    ckpt_dir = cfg.checkpoint_root
    if cfg.toy.enable:  # fail fast: its inputs are made below, after the lock
        from megatron_dapo.toy import bootstrap as toy

        toy.check(cfg, run_dir)
    if cfg.checkpoint.resume == "auto" and not (eval_only and eval_only.step is not None):
        check_checkpoints(ckpt_dir)
    # the demo's model is made below; its layout is checked then. Training saves, evaluation does not.
    inputs = None if cfg.toy.enable else _load_inputs(cfg, ckpt_dir, world, saves=lock, eval_only=eval_only)
    run_lock = None
    if lock and rank == 0:
        from megatron_dapo.run_lock import RunDirLock

        run_lock = RunDirLock(run_dir).acquire()
    try:
        if cfg.toy.enable:
            cfg = toy.materialise(cfg, run_dir, rank)
        if inputs is None:
            inputs = _load_inputs(cfg, ckpt_dir, world, saves=lock, eval_only=eval_only)
        by_model = derive_for_model(cfg, inputs.hf_config, on_gpu=torch.cuda.is_available())
        _log_derived(rank, by_model)
        derived += by_model
        resume = None
        if inputs.resume_from is not None:
            from megatron_dapo.mcore.checkpoint import TRAINER_STATE, read_trainer_state

            resume = TrainerState.from_json(read_trainer_state(inputs.resume_from),
                                            str(inputs.resume_from / TRAINER_STATE))
    except BaseException:
        if run_lock is not None:
            run_lock.release()
        raise
    return Prepared(cfg=cfg, rank=rank, world_size=world, dir=run_dir, ckpt_dir=ckpt_dir, inputs=inputs,
                    resume=resume, lock=run_lock, engines=engines, derived=tuple(derived), eval_only=eval_only)


def _log_derived(rank: int, derived: list[Derived]) -> None:
    """One ``derived`` line per derived setting, from rank 0."""
    if rank == 0:
        for d in derived:
            logger.info("derived %s", d.line())


def build_run(prep: Prepared) -> Run:
    """Steps (4) and (5): the actor (from the resume point, model.checkpoint or the HF weights),
    this rank's engine and, on replica leaders, the reward pool. The run directory's lock passes
    to the Run (released on failure)."""
    try:
        return _build(prep)
    except BaseException:
        prep.release()
        raise


def _log_replicas(rollout: RolloutConfig, placement) -> None:
    """One line from rank 0: which ranks hold which rollout replica, and which rank scores for it
    (each rank's own line was the same news from every rank); at most six replicas named. Collective
    over the placement."""
    seats = placement.gather_all((placement.replica, placement.is_leader))
    if placement.rank != 0:
        return
    held: dict[int, list[int]] = {}
    for rank, (replica, _) in enumerate(seats):
        held.setdefault(replica, []).append(rank)
    scorer = {replica: rank for rank, (replica, leads) in enumerate(seats) if leads}
    parts = [f"replica {r}: " + (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}")
             + f", scoring on {scorer.get(r)}" for r, ranks in sorted(held.items())]
    if len(parts) > 6:
        parts = parts[:3] + ["..."] + parts[-1:]
    logger.info("rollout: %d replica(s) of rollout TP %d (%s engine) over %d trainer rank(s): %s",
                placement.num_replicas, rollout.tensor_parallel_size, rollout.engine, len(seats),
                "; ".join(parts))


def _load_inputs(cfg: DAPOConfig, ckpt_dir: Path, world: int, *, saves: bool,
                 eval_only: EvalOnly | None = None) -> Inputs:
    """Everything read from the user's files, checked; InputError on the first problem. The layout
    (``world`` ranks) and, when the run ``saves``, the disk are checked against the model's config
    before any data is read: a launch that cannot run fails in seconds, not after tokenizing. An
    evaluation job reads no training data, and the checkpoint of its step when it names one."""
    from megatron_dapo.hf_dir import check_weights, read_hf_dir
    from megatron_dapo.rollout.engine import get_engine_cls

    if not cfg.model.hf_path:
        raise InputError("model.hf_path is empty: point it at an HF model dir (config.json, tokenizer), "
                         "or set toy.enable=true for the CPU demo")
    hf = read_hf_dir(cfg.model.hf_path, weights=False)
    check_against_model(cfg, hf.config, world, saves=saves)
    if eval_only is not None and eval_only.step is not None:
        from megatron_dapo.mcore.checkpoint_files import checkpoint_of_step, read_meta

        resume_from = checkpoint_of_step(ckpt_dir, eval_only.step, use="evaluate")
        check_checkpoint_shape(resume_from, read_meta(resume_from), hf.config,
                               "evaluate it with the model it was trained with (model.hf_path)")
    else:
        resume_from = _resume_point(ckpt_dir, hf.config) if cfg.checkpoint.resume == "auto" else None
    train_ids, train_truths = [], []
    if eval_only is None:
        train_ids, train_truths = _prompts("data.train_files", cfg.data.train_files, hf.tokenizer, cfg.data,
                                           dedup=cfg.data.dedup)
    # Always merged: eval.n draws the samples, and copies would skew pass@n and cons@n.
    val_ids, val_truths = _prompts("data.val_files", cfg.data.val_files, hf.tokenizer, cfg.data, dedup=True)
    if cfg.model.checkpoint and resume_from is None:
        check_start_checkpoint(Path(cfg.model.checkpoint), hf.config)
    if (resume_from is None and not cfg.model.checkpoint) or get_engine_cls(cfg.rollout.engine).reads_hf_weights:
        check_weights(hf.path, f"model.hf_path={hf.path}")
    return Inputs(hf.config, resume_from, hf.tokenizer, hf.stops, train_ids, train_truths, val_ids, val_truths)


def _resume_point(ckpt_dir: Path, hf_config: dict) -> Path | None:
    """The run's latest intact checkpoint (found once: the actor loads this one), refused before
    any model is built when it holds another architecture."""
    from megatron_dapo.mcore.checkpoint import latest_checkpoint, read_meta

    path = latest_checkpoint(ckpt_dir)
    if path is not None:
        check_checkpoint_shape(path, read_meta(path), hf_config,
                               "resume with the model it was trained with, or start a new logging.dir")
    return path


def _build(prep: Prepared) -> Run:
    from megatron_dapo.mcore.cpu_compat import apply_cpu_compat

    apply_cpu_compat()  # on a CPU machine, before anything imports megatron.core
    from megatron_dapo.data import PromptSampler
    from megatron_dapo.mcore.actor import MegatronActor
    from megatron_dapo.rollout.placements import make_placement

    cfg, inputs = prep.cfg, prep.inputs
    hf_path = Path(cfg.model.hf_path)
    actor = MegatronActor(cfg, inputs.hf_config)
    if inputs.resume_from is not None:  # its trainer state was read by prepare_run
        actor.load_checkpoint(str(inputs.resume_from))
        if prep.eval_only is None:
            logger.info("resumed from %s at step %d", prep.ckpt_dir, prep.resume.step)
        else:
            logger.info("evaluating the checkpoint of step %d (%s)", prep.resume.step, inputs.resume_from)
    elif cfg.model.checkpoint:
        actor.load_checkpoint(cfg.model.checkpoint)
        logger.info("starting weights from %s", cfg.model.checkpoint)
    else:
        actor.load_hf_weights(str(hf_path))
        logger.info("starting weights from %s (HF, each rank reading its shard)", hf_path)
    loss = actor.settings  # what the loss runs with, explicit or derived (config_derived.py), in one line
    logger.info("policy loss %s: clip %g / %g, dual clip %s, %s%s", loss.policy_loss, loss.clip_ratio_low,
                loss.clip_ratio_high, loss.clip_ratio_c, loss.loss_agg_mode,
                f" / {loss.loss_scale_factor:g}" if loss.loss_scale_factor else "")

    sampler = None if prep.eval_only else PromptSampler(len(inputs.train_ids), seed=cfg.seed, shuffle=cfg.data.shuffle)
    # Every rank builds its engine at the same point: vLLM's external launcher forms its groups
    # over the whole world. Weights arrive with the loop's first sync.
    # The engine's own checks of the settings (memory, head size) raise ConfigError before it
    # builds anything; any other error from building it is a bug and keeps its traceback.
    # With offload, vLLM's start-up check (its share must be free) and its first allocation see the
    # trainer's state off the device, as every generation later will; the engine then sleeps, so the
    # state can come back for the first weight sync.
    actor.offload_for_rollout()
    placement = make_placement(cfg, prep.engines)  # separate engines build theirs from this config
    if cfg.actor.offload_during_rollout:
        placement.sleep()
        actor.onload_after_rollout()
    pool = make_reward_pool(cfg.reward, cfg.eval) if placement.is_leader else None
    _log_replicas(cfg.rollout, placement)
    run = Run(**{f.name: getattr(prep, f.name) for f in dataclasses.fields(Prepared)}, actor=actor,
              placement=placement, pool=pool, sampler=sampler)
    prep.lock = None  # the Run holds it now
    return run


def make_reward_pool(reward: RewardConfig, eval: EvalConfig):
    """One RewardPool for every scorer the run uses: reward.fn (the default, for training),
    eval.reward_fn and our value scorer (both for evaluation), picked per call by name. One set of
    reward.num_workers processes serves them all (no pool per scorer on small machines). What a
    scorer's quick companion decides is scored in this process (reward.QUICK_FNS)."""
    from megatron_dapo.reward import QUICK_FNS, VALUE_REWARD_FN, RewardPool, get_reward_fn

    names = {reward.fn, eval.reward_fn, VALUE_REWARD_FN}
    quick = {n: QUICK_FNS.get(n) for n in names}
    return RewardPool(num_workers=reward.num_workers, timeout_s=reward.timeout_s,
                      score_fn=get_reward_fn(reward.fn), score_fns={n: get_reward_fn(n) for n in names},
                      quick_fns={None: quick[reward.fn], **quick})


def _prompts(key: str, files, tokenizer, data: DataConfig, *, dedup: bool) -> tuple[list[list[int]], list[str]]:
    from megatron_dapo.data import apply_chat_template, filter_by_prompt_length, load_prompts, no_prompts_message
    from megatron_dapo.data.schema import DAPO_FILE

    if not files:
        raise InputError(f"{key} is empty: give it {DAPO_FILE} (megatron-dapo prepare-data makes them), or set "
                         "toy.enable=true for the CPU demo's task")
    loaded = load_prompts(list(files), dedup=dedup, on_bad_row=data.on_bad_row)
    all_ids = [apply_chat_template(tokenizer, r.chat()) for r in loaded.records]
    records, ids, dropped = filter_by_prompt_length(loaded.records, all_ids, data.max_prompt_length)
    logger.info("%s: %d prompts (%d rows, %d duplicates, %d too long)", ",".join(files), len(records),
                loaded.num_rows, loaded.num_duplicates, dropped)
    if not records:
        raise InputError(no_prompts_message(key, files, loaded, [len(i) for i in all_ids], data.max_prompt_length))
    return ids, [r.ground_truth for r in records]
