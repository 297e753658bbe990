"""Every benchmark has the run(quick) entry benchmarks/run_all.py calls, and each module's
result-building helpers turn hand-made measurements into figures run_all accepts, with the ratios
and pass criteria right. No benchmark is run here (they take minutes) and nothing is timed."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    """A benchmark module by path, as run_all's child loads it (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"bench_test_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


run_all = _load("run_all")


def _check(result: dict, name: str) -> dict[str, dict]:
    """run_all accepts it, and every figure's ratio is value / baseline: figures by name."""
    run_all.validate(result, name)
    assert result["markdown"].strip()
    for f in result["figures"]:
        if f["ratio"] is not None:
            assert f["ratio"] == pytest.approx(f["value"] / f["baseline"])
        assert (f["target"] is None) == (f["met"] is None)
    return {f["figure"]: f for f in result["figures"]}


@pytest.mark.parametrize("name", run_all.discover(BENCH))
def test_every_benchmark_has_run(name):
    assert run_all.has_run(BENCH / f"{name}.py"), f"{name}.py has no top-level run(quick)"


@pytest.mark.parametrize("name", ["async_rollout", "async_save", "checkpoint_save", "fault_campaign", "losses",
                                  "moe_r3", "reward_fuzz", "rollout", "rollout_corrections", "table1"])
def test_quick_is_smaller_than_full(name):
    """No size of the quick run exceeds the full run's and at least one is smaller: QUICK != FULL
    alone would pass a quick run larger than the full one. A skip_* flag counts as smaller when
    set (less work); any other flag or text must be the same in both."""
    m = _load(name)
    assert m.QUICK.keys() == m.FULL.keys()
    work = {}  # key -> (quick, full) as amounts of work
    for key, full in m.FULL.items():
        quick = m.QUICK[key]
        if isinstance(full, bool):
            assert key.startswith("skip_") or quick == full, (key, quick, full)
            work[key] = (not quick, not full) if key.startswith("skip_") else (quick, full)
        elif isinstance(full, (int, float)):
            work[key] = (quick, full)
        else:
            assert quick == full, (key, quick, full)
    assert all(q <= f for q, f in work.values()), {k: v for k, v in work.items() if v[0] > v[1]}
    assert any(q < f for q, f in work.values()), f"{name}: the quick run is the full run"


def test_checkpoint_save_figures():
    m = _load("checkpoint_save")
    result = dict(hidden=64, layers=2, saves=3,
                  manager=dict(mode="manager", times=[2.0, 0.5, 0.3], mb=10.0, manager_process=True),
                  in_process=dict(mode="in_process", times=[0.2, 0.3, 0.1], mb=10.0, manager_process=False))
    figs = list(_check(dict(name="checkpoint_save", figures=m.figures(result),
                            markdown=m.render_markdown(result)), "checkpoint_save").values())
    assert [(f["value"], f["baseline"]) for f in figs] == [(0.2, 2.0), (pytest.approx(0.2), pytest.approx(0.4))]
    assert figs[0]["ratio"] == pytest.approx(0.1) and figs[1]["ratio"] == pytest.approx(0.5)
    assert "hidden 64, 2 layers" in m.render_markdown(result)
    one = dict(result, saves=1, manager=dict(result["manager"], times=[2.0]),
               in_process=dict(result["in_process"], times=[0.2]))
    assert len(m.figures(one)) == 1 and "| - |" in m.render_markdown(one)  # no later saves to average


def test_async_save_figures():
    """Means over the steps after the first; blocked time and step time against the one-phase save's."""
    m = _load("async_save")
    run = lambda mode, steps, blocked: dict(mode=mode, steps=steps, blocked=blocked, waited=[0.0] * len(blocked),
                                            final_wait=0.5, mb=100.0, params=9e6)
    result = dict(hidden=128, layers=2, steps=3, updates=3, none=run("none", [1.0, 1.0, 1.0], []),
                  sync=run("sync", [9.0, 3.0, 5.0], [8.0, 2.0, 4.0]),
                  background=run("background", [9.0, 2.0, 2.0], [8.0, 1.0, 0.5]))
    figs = list(_check(dict(name="async_save", figures=m.figures(result), markdown=m.render_markdown(result)),
                       "async_save").values())
    assert [(f["value"], f["baseline"]) for f in figs] == [(0.75, 3.0), (2.0, 4.0)]
    assert "3 updates of 4 x 16 tokens" in m.render_markdown(result)


def _record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "time": 123.0 + step, "timing_s/step": 0.5}


def test_fault_campaign_counts_and_figures():
    m = _load("fault_campaign")
    want = [_record(s, float(s)) for s in range(4)]
    # step 1 missing, step 2 twice, step 3 differs; wall times differ everywhere and do not count
    got = [_record(0, 0.0), _record(2, 2.0), _record(2, 2.0), _record(3, 9.0)]
    for r in got:
        r["time"] += 1000
    outcomes = [("SIGKILL", dict(finished=False, rc=-9, children=2, left=1, in_save=True)),
                ("SIGKILL", dict(finished=True)),
                ("SIGTERM", dict(finished=False, rc=0, children=0, left=0, in_save=False)),
                ("SIGINT", dict(finished=False, rc=1, children=0, left=0, in_save=False))]
    c = m.summarise(dict(kills=2, signals=2, steps=3, seed=0), outcomes, 0, got, want, 12.0)
    assert (c["missing"], c["duplicated"], c["differing"], c["equal"]) == (1, 1, 1, 2)
    assert (c["landed"], c["kills_in_save"], c["leaked"], c["bad_signals"]) == (3, 1, 1, [("SIGINT", 1)])
    assert not m.passed(c)
    figs = _check(dict(name="fault_campaign", figures=m.figures(c), markdown=m.render_markdown(c)),
                  "fault_campaign")
    counts = {k.split(" (")[0]: (f["value"], f["met"]) for k, f in figs.items()}
    assert counts["child processes left 20 s after a SIGKILL to the trainer"] == (1, False)
    assert counts["SIGKILLs that landed inside a checkpoint save"] == (1, None)  # informational
    assert counts["stop signals not exiting 0"] == (1, False)
    assert counts["metric records differing from the reference"] == (1, False)

    clean_outcomes = [("SIGKILL", dict(outcomes[0][1], left=0)), outcomes[2]]
    clean = m.summarise(dict(kills=1, signals=1, steps=3, seed=0), clean_outcomes, 0, want, want, 5.0)
    assert m.passed(clean) and all(f["met"] is not False for f in m.figures(clean))


def test_reward_fuzz_figures():
    m = _load("reward_fuzz")
    report = m.Report(inputs=100, checked=90)
    report.false_positives["paper"] = [("hedged", "5", "x")] * 4
    report.seconds = {"ours": 0.5, "paper": 0.25}
    report.worst_s, report.worst_kind = 0.2, "ours/huge"
    report.pool_items, report.pool_s = 20, 1.0
    size = dict(m.QUICK, n=100)
    result = dict(name="reward_fuzz", figures=m.figures(report, 5.0), markdown=m.render_markdown(report, size, 0.1))
    figs = list(_check(result, "reward_fuzz").values())
    assert all(f["met"] is not False for f in figs)
    fp, rate = figs[0], next(f for f in figs if f["unit"] == "inputs/s")
    assert (fp["value"], fp["baseline"], fp["met"]) == (0, 4, True)
    assert (rate["value"], rate["baseline"], rate["ratio"]) == (200, 400, 0.5)

    report.false_positives["ours"].append(("list", "5", "Answer: 5, 6"))
    report.slow_calls.append(("ours", "huge", ">5.0s", "x"))  # interrupted: worst_s alone misses it
    failed = {f["figure"].split(" (")[0]: f["met"] for f in m.figures(report, 5.0)}
    assert failed["false positives of ours"] is False and failed["worst inline call"] is False
    assert m._details(report, size, 0.1)["failures"] == 2


def _engine(name: str, rate: float, sync: float, copy: float) -> dict:
    return dict(engine=name, tokens_per_s=rate, start_s=1.0, first_generate_s=0.1, generated_tokens=3072,
                sync_s_per_100mb=sync, copy_s_per_100mb=copy)


def test_rollout_figures():
    m = _load("rollout")
    result = dict(repeats=1, steps=12, runs=None,
                  engines=dict(hf=_engine("hf", 20000.0, 0.01, 0.005), vllm=_engine("vllm", 15000.0, 0.06, 0.01)))
    figs = list(_check(dict(name="rollout", figures=m.figures(result), markdown=m.render_markdown(result)),
                       "rollout").values())
    assert [f["ratio"] for f in figs] == [pytest.approx(0.75), pytest.approx(6.0), pytest.approx(2.0)]
    assert "not run" in m.render_markdown(result)
    run = dict(wall_s=30.0, step_s=0.3, rollout_s=0.1, sync_s=0.01, mismatch_max=1e-6)
    result["runs"] = dict(hf=dict(run, engine="hf"), vllm=dict(run, engine="vllm", step_s=0.45))
    figs = _check(dict(name="rollout", figures=m.figures(result), markdown=m.render_markdown(result)), "rollout")
    assert list(figs.values())[-1]["ratio"] == pytest.approx(1.5)
    assert "| vllm | 0.450 | 1.50x |" in m.render_markdown(result)


def _table1_run(row: str, seed: int, acc: float) -> dict:
    return dict(row=row, seed=seed, steps=10, generated=1280, wall_s=20.0, avg_at_k=acc, k=8, avg_at_k_value=acc,
                entropy=0.5, response_length=6.0, truncation_rate=0.1, train_truncation_rate=0.1,
                generated_per_trained=1.0, avg_at_k_by_step={0: 0.1, 10: acc})


def test_table1_figures():
    m = _load("table1")
    names = [name for name, _ in m.STEPS]
    runs = [_table1_run(name, seed, 0.2 + 0.1 * i + 0.02 * seed) for i, name in enumerate(names) for seed in (1, 2)]
    result = dict(budget=1280, jobs=2, wall_s=60.0, runs=runs)
    figs = list(_check(dict(name="table1", figures=m.figures(result), markdown=m.markdown(result)),
                       "table1").values())
    assert len(figs) == len(names)
    assert figs[0]["baseline"] is None and figs[0]["value"] == pytest.approx(0.23)  # GRPO: the baseline itself
    assert figs[-1]["baseline"] == pytest.approx(0.23) and figs[-1]["ratio"] == pytest.approx(0.73 / 0.23)
    assert "2 seed(s), 1280 responses" in figs[1]["figure"]
    assert "1.0 min" in m.markdown(result)


def test_losses_figures():
    m = _load("losses")
    runs = [dict(_table1_run(name, seed, 0.4 + 0.1 * i + 0.02 * seed), high=0.01 * i, low=0.02)
            for i, (name, _) in enumerate(m.ROWS) for seed in (1, 2)]
    result = dict(budget=1280, jobs=2, wall_s=60.0, runs=runs)
    figs = list(_check(dict(name="losses", figures=m.figures(result), markdown=m.markdown(result)), "losses").values())
    assert [f["figure"].split(":")[0] for f in figs] == ["dapo", "gspo", "cispo"]
    assert figs[0]["baseline"] is None and figs[0]["value"] == pytest.approx(0.43)  # dapo: the baseline itself
    assert figs[2]["baseline"] == pytest.approx(0.43) and figs[2]["ratio"] == pytest.approx(0.63 / 0.43)
    assert "| gspo | 0.530 ± 0.014 | 0.500 ± 0.000 | 0.010 ± 0.000 | 0.020 ± 0.000 | 10 |" in m.markdown(result)


def test_rollout_corrections_figures():
    m = _load("rollout_corrections")
    per_step = dict(kl=0.03, chi2=0.2, is_std=0.1, ess=0.9, above=0.01, below=0.02, lag=1.5)
    runs = [dict(_table1_run(name, seed, 0.6 + 0.1 * i + 0.02 * seed), **per_step)
            for i, (name, _) in enumerate(m.ROWS) for seed in (1, 2)]
    result = dict(budget=1280, piece=7, wall_s=1.0, runs=runs)
    figs = list(_check(dict(name="rollout_corrections", figures=m.figures(result), markdown=m.markdown(result)),
                       "rollout_corrections").values())
    assert [f["figure"].split(":")[0] for f in figs] == ["token TIS", "sequence IS", "IcePop"]
    assert figs[0]["baseline"] is None and figs[0]["value"] == pytest.approx(0.63)  # token TIS: the baseline
    assert figs[2]["baseline"] == pytest.approx(0.63) and figs[2]["ratio"] == pytest.approx(0.83 / 0.63)
    md = m.markdown(result)
    assert "| IcePop | 0.830 ± 0.014 | 0.500 ± 0.000 | 0.030 ± 0.000 |" in md
    assert "The runs took 2.0 min" in md  # the runs' own wall times (finished runs are reused on a rerun)



def _async_records(batches: list[int], waited: float, rollout: float, lag: float) -> list[dict]:
    """Steps of ``batches`` generation batches each, ``waited`` / ``rollout`` seconds a batch, 1 s of training."""
    return [{"step": i + 1, "dynamic_sampling/num_gen_batches": float(b), "timing_s/trainer_waited": waited * b,
             "timing_s/rollout": rollout * b, "timing_s/step": rollout * b + 1.0, "rollout/version_lag_mean": lag,
             "response_length/mean": 5.0, "response_length/max": 11.0, "eval/avg@4": 0.5}
            for i, b in enumerate(batches)]


def test_async_rollout_model_and_figures():
    m = _load("async_rollout")
    base = _async_records([1, 1, 2, 1, 1], waited=2.0, rollout=2.0, lag=0.0)
    # the k=0 run's own phases: 2 s a batch, no scoring, 1 s of training per step
    assert m.costs(base) == {"generation": 2.0, "score": 0.0, "train": 1.0}
    # at k=0 the model replays the run (steps 2..4: 3 + 5 + 3 s). At k=1 (ends at 3, 5, 9, 11):
    # step 2 waits 1 s for its batch asked ahead (done at 4), trains to 5; step 3 waits for its first
    # (asked at 4, done at 6), asks its second (6-8), trains to 9; step 4's first was asked at 8.
    assert m.predict(base, 0, m.costs(base)) == 11.0
    assert m.predict(base, 1, m.costs(base)) == 2.0 + 4.0 + 2.0
    stale = _async_records([1, 1, 2, 1, 1], waited=1.0, rollout=1.0, lag=1.0)
    runs = {mode: [{"records": stale if "k=" in mode and mode != "separate k=0" else base}]
            for mode in m.MODES}
    res = m.results(runs)
    assert res["model"][1]["predicted"] == pytest.approx(8.0 / 11.0)
    assert res["model"][1]["measured"] == pytest.approx(7.0 / 11.0)
    # partial: a batch decodes 8 steps + the prefill instead of its longest response's 11 + 1
    assert m.decode_scale(base) == pytest.approx(9.0 / 12.0)
    assert res["model"]["partial k=1"]["predicted"] == pytest.approx(m.predict(stale, 1, m.costs(base), 0.75) / 11.0)
    sys.path.insert(0, str(BENCH))
    from _async_projection import MODES as PROJECTED, SCENARIOS
    row = {"colocated": {"step_min": 10.0, "speedup": 1.0, "engines": 128, "trainers": 128},
           **{mode: {"step_min": 12.0, "speedup": 10 / 12, "engines": 96, "trainers": 32, "engines_idle": 0.1,
                     "trainer_waited": 0.1} for mode in PROJECTED}}
    proj = {"assumptions": {"world": 128},
            **{n: {"placements": row, "mean_response": 5000.0, "truncated": 0.02, "slots": 100, "slots_alone": 140,
                   "median": 4000, "sigma": 0.8, "batches_per_step": 1} for n in SCENARIOS}}
    figs = _check(dict(name="async_rollout", figures=m.figures(res, proj), markdown=m.markdown(res, proj)),
                  "async_rollout")
    model1 = figs["model / measured, k=1 vs k=0 step seconds"]
    assert model1["met"] is True and model1["ratio"] == pytest.approx(8.0 / 7.0)  # within 15%
    assert figs["step seconds, separate k=1 / colocated"]["ratio"] == pytest.approx(7.0 / 11.0)
    assert figs["32B projected step minutes, separate k=1 (modelled, base scenario)"]["ratio"] == pytest.approx(1.2)
    assert "12.0 min (0.83x, 96/32)" in m.markdown(res, proj)


def test_moe_r3_figures():
    m = _load("moe_r3")
    runs = [dict(_table1_run(f"{setting}, {name}", seed, 0.5), kl=kl * seed, chi2=0.1, truncated=0.01,
                 agreement=None if name == "trainer routes" else 0.9, lag=0.0, setting=setting)
            for setting, _, _ in m.SETTINGS for name, kl in (("trainer routes", 2e-4), ("R3", 5e-5)) for seed in (1, 2)]
    same = [dict(responses=512, tokens=4000, flipped_tokens=40, route_agreement=0.99,
                 abs_diff_mean={"trainer routes": 0.006, "R3": 0.0055},
                 abs_diff_mean_flipped={"trainer routes": 0.024, "R3": 0.006},
                 abs_diff_max={"trainer routes": 0.24, "R3": 0.24}, kl_k3={"trainer routes": 8e-5, "R3": 6e-5})] * 2
    result = dict(budget=1280, wall_s=1.0, runs=runs, same_weights=same)
    md = m.markdown(result) + "\n\n" + m.same_weights_markdown(same)
    figs = list(_check(dict(name="moe_r3", figures=m.figures(result), markdown=md), "moe_r3").values())
    assert figs[0]["ratio"] == pytest.approx(0.006 / 0.024)  # R3 over routing itself, on flipped tokens
    assert figs[1]["ratio"] == pytest.approx(6e-5 / 8e-5)
    assert [f["ratio"] for f in figs[2:]] == pytest.approx([0.25, 0.25])  # both settings' per-step KL
    assert "| bf16 engine | R3 | 7.5e-05 ± 3.5e-05 |" in md
    assert "| R3 | 0.0055 ± 0 | 0.006 ± 0 | 0.24 ± 0 | 6e-05 ± 0 |" in md
