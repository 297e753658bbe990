"""benchmarks/run_all.py on fake benchmark modules (no real benchmark runs, nothing timed): the figure
table has each baseline beside its figure and met / not met, a failing, timed-out or malformed
benchmark becomes an error row without stopping the others, a module without run() is listed as
not available, and --only picks benchmarks or names the choices."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"
_spec = importlib.util.spec_from_file_location("run_all", _PATH)
run_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_all)

FIGURES = [
    dict(figure="peak, 16384 tokens", value=250.0, unit="MB", baseline_name="naive (modelled)",
         baseline=28600.0, ratio=250 / 28600, target=None, met=None),
    dict(figure="round trip", value=3.0, unit="s", baseline_name="plain read + write", baseline=1.0,
         ratio=3.0, target="<= 1.5x baseline", met=False),
    dict(figure="model error", value=1.6, unit="%", baseline_name=None, baseline=None, ratio=None,
         target="<= 5%", met=True),
    dict(figure="bit-exact", value=1.0, unit="bool", baseline_name=None, baseline=None, ratio=None,
         target="bit-exact", met=True),
]
MODULES = {
    "alpha_bad": "def run(quick):\n    raise RuntimeError('boom | at size ' + str(quick))\n",
    "beta_good": ("import json\nFIGURES = json.loads({figures!r})\n"
                  "def run(quick):\n    print('progress line')\n"
                  "    return dict(name='beta_good', figures=FIGURES,\n"
                  "                markdown='own table, quick=%s' % quick)\n"),
    "gamma_norun": "def main():\n    pass\n",
    "delta_malformed": "def run(quick):\n    return dict(figures=[dict(figure='f')], markdown='')\n",
    "epsilon_slow": "import time\ndef run(quick):\n    time.sleep(60)\n",
}


@pytest.fixture()
def bench_dir(tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    for name, source in MODULES.items():
        (d / f"{name}.py").write_text(source.format(figures=json.dumps(FIGURES)))
    return d


def _main(bench_dir, tmp_path, *extra):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    code = run_all.main(["--quick", "--bench-dir", str(bench_dir), "--out", str(out),
                         "--markdown", str(md), "--timeout", "5", *extra])
    return code, json.loads(out.read_text()), md.read_text()


def test_every_status_and_the_figure_table(bench_dir, tmp_path):
    code, report, md = _main(bench_dir, tmp_path)
    assert code == 1  # a benchmark failed
    status = {e["name"]: e["status"] for e in report["benchmarks"]}
    assert status == {"alpha_bad": "error", "beta_good": "ok", "gamma_norun": "not available",
                      "delta_malformed": "error", "epsilon_slow": "timeout"}
    by_name = {e["name"]: e for e in report["benchmarks"]}
    assert "boom" in by_name["alpha_bad"]["error"] and "lacks" in by_name["delta_malformed"]["error"]
    assert by_name["beta_good"]["result"]["figures"] == FIGURES  # after the failure: not stopped
    assert report["quick"] and report["machine"]["cores"] >= 1
    assert len(by_name["beta_good"]["load_before"]) == len(by_name["beta_good"]["load_after"]) == 3
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| beta_good | ")}
    assert "| 250 MB | naive (modelled) | 28,600 MB | 0.00874x | - | - |" in rows["peak, 16384 tokens"]
    assert "| 3 s | plain read + write | 1 s | 3.00x | <= 1.5x baseline | **not met** |" in rows["round trip"]
    assert rows["model error"].endswith("| 1.6 % | - | - | - | <= 5% | met |")
    assert "| yes |" in rows["bit-exact"]
    assert "| alpha_bad | error: exit 1: RuntimeError: boom \\| at size True |" in md  # the pipe escaped
    assert "| gamma_norun | not available: gamma_norun.py has no run(quick) function |" in md
    assert "| epsilon_slow | timeout: no result within 5 s |" in md
    assert "### beta_good\n\nown table, quick=True" in md and "### alpha_bad" not in md


def test_only_runs_the_named_benchmarks(bench_dir, tmp_path):
    code, report, md = _main(bench_dir, tmp_path, "--only", "beta_good,gamma_norun")
    assert code == 0
    assert [e["name"] for e in report["benchmarks"]] == ["beta_good", "gamma_norun"]
    assert "--only beta_good,gamma_norun" in md


def test_unknown_name_is_an_error_that_lists_the_choices(bench_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _main(bench_dir, tmp_path, "--only", "beta_good,nope")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown benchmark(s): nope" in err and "alpha_bad, beta_good" in err


def test_real_benchmarks_are_discovered_in_order():
    names = run_all.discover(_PATH.parent)
    assert names[:2] == ["logprobs", "convert"] and "run_all" not in names
    assert run_all.has_run(_PATH.parent / "logprobs.py") and run_all.has_run(_PATH.parent / "convert.py")
