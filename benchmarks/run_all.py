"""Run every benchmark at one size and write its figures as JSON and as the markdown tables of docs/performance.md.

A benchmark is a module in benchmarks/ with a ``run(quick: bool) -> dict`` returning
    {"name": str, "markdown": str, "details": any (optional),
     "figures": [{"figure": str, "value": float, "unit": str, "baseline_name": str | None,
                  "baseline": float | None, "ratio": float | None, "target": str | None,
                  "met": bool | None}, ...]}
Each runs in its own process (its own session: one crash or memory peak does not touch the others,
and a timeout ends it with everything it started). Modules without ``run`` are listed as not
available. The JSON records the machine (CPU, cores, memory, Python and torch versions, git commit,
date) and the load average before and after each benchmark; the markdown has one table of every
figure with its baseline, ratio, target and met / not met, then each benchmark's own markdown.

    python benchmarks/run_all.py --quick                 # small sizes: a few minutes on 2 cores
    python benchmarks/run_all.py                         # full sizes: the numbers docs/performance.md shows
    python benchmarks/run_all.py --quick --only logprobs,convert --out /tmp/r.json --markdown /tmp/r.md

Exit status 1 if any benchmark failed or timed out (the others still run and are written).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ORDER = ("logprobs", "convert", "reward_throughput", "train_step")  # first in the tables, in this order
FIGURE_KEYS = ("figure", "value", "unit", "baseline_name", "baseline", "ratio", "target", "met")
TIMEOUT_S = {True: 900, False: 3600}  # per benchmark, by quick
LOG_TAIL_LINES = 20


def discover(bench_dir: Path) -> list[str]:
    """Benchmark names: every module in bench_dir but this one, ORDER first."""
    names = sorted(p.stem for p in bench_dir.glob("*.py") if p.stem != Path(__file__).stem
                   and not p.stem.startswith("_"))
    return [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]


def has_run(path: Path) -> bool:
    """Whether the module defines a top-level run() (read from its source: nothing is imported)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(node, ast.FunctionDef) and node.name == "run" for node in tree.body)


def select(names: list[str], only: str | None) -> list[str]:
    if not only:
        return names
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise ValueError(f"unknown benchmark(s): {', '.join(unknown)}; choose from: {', '.join(names)}")
    return wanted


def validate(result: object, name: str) -> dict:
    """Raise ValueError unless result has the shape in the module docstring."""
    if not isinstance(result, dict) or not isinstance(result.get("figures"), list) \
            or not isinstance(result.get("markdown"), str):
        raise ValueError(f"{name}.run() must return a dict with 'figures' (list) and 'markdown' (str)")
    for fig in result["figures"]:
        missing = [k for k in FIGURE_KEYS if k not in fig] if isinstance(fig, dict) else list(FIGURE_KEYS)
        if missing:
            raise ValueError(f"{name}: figure {fig!r} lacks {', '.join(missing)}")
    return result


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = avail = None
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        mem, avail = (int(info[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable"))  # GiB
    except (OSError, KeyError, ValueError):
        pass

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*args):
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    return dict(cpu=cpu, cores=os.cpu_count(), memory_gib=mem, available_gib=avail, os=platform.platform(),
                python=platform.python_version(), torch=version("torch"),
                megatron_core=version("megatron-core"), git_commit=git("rev-parse", "--short", "HEAD"),
                git_dirty=bool(git("--no-optional-locks", "status", "--porcelain")),
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                load_average=list(os.getloadavg()))


def run_one(name: str, quick: bool, bench_dir: Path, timeout_s: float) -> dict:
    """One benchmark in its own process: an entry with status ok / error / timeout / not available."""
    entry = dict(name=name, status="ok", load_before=list(os.getloadavg()))
    path = bench_dir / f"{name}.py"
    if not has_run(path):
        return dict(entry, status="not available", error=f"{path.name} has no run(quick) function",
                    load_after=entry["load_before"], wall_s=0.0)
    with tempfile.TemporaryDirectory(prefix=f"run_all-{name}-") as tmp:
        result_file, log_file = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, __file__, "--child", name, "--bench-dir", str(bench_dir),
               "--result", str(result_file)] + (["--quick"] if quick else [])
        start = time.perf_counter()
        with open(log_file, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the benchmark and its children
                proc.wait()
                entry.update(status="timeout", error=f"no result within {timeout_s:.0f} s")
        entry.update(wall_s=time.perf_counter() - start, load_after=list(os.getloadavg()))
        tail = log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        if entry["status"] == "ok" and proc.returncode == 0 and result_file.exists():
            entry["result"] = json.loads(result_file.read_text())
        elif entry["status"] == "ok":
            last = next((line for line in reversed(tail) if line.strip()), "no output")
            entry.update(status="error", error=f"exit {proc.returncode}: {last.strip()}")
        if entry["status"] != "ok":
            entry["log_tail"] = tail
    return entry


def _child(name: str, bench_dir: Path, quick: bool, result_file: Path) -> None:
    sys.path[:0] = [str(bench_dir), str(ROOT)]  # sibling modules, and the package from a checkout
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", bench_dir / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look their module up by name
    spec.loader.exec_module(module)
    result = validate(module.run(quick), name)
    result_file.write_text(json.dumps(result, indent=1, default=str))


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(x: float | None, unit: str) -> str:
    if unit == "bool":
        return "-" if x is None else ("yes" if x else "no")
    return _num(x) + (f" {unit}" if unit and x is not None else "")


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if 0.1 <= abs(x) < 100 else f"{x:.3g}x"


def _met(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "**not met**")


def _load(entry: dict) -> str:
    return f"{entry['load_before'][0]:.1f} / {entry['load_after'][0]:.1f}"


def render_markdown(report: dict) -> str:
    m = report["machine"]
    mem = f"{m['memory_gib']:.1f} GiB memory ({m['available_gib']:.1f} GiB available at start)" \
        if m.get("memory_gib") else "memory unknown"
    dirty = " + uncommitted changes" if m.get("git_dirty") else ""
    lines = [f"`{report['command']}`, {m['date']}: {m['cpu']}, {m['cores']} cores, {mem}; "
             f"Python {m['python']}, torch {m['torch']}, git {m['git_commit']}{dirty}. Load average (1 min) "
             f"at start {m['load_average'][0]:.1f}; {report['wall_s'] / 60:.1f} min in all.", "",
             "| benchmark | status | wall s | load average before / after |", "|---|---|---|---|"]
    for e in report["benchmarks"]:
        lines.append(f"| {e['name']} | {e['status']} | {_num(e['wall_s'])} | {_load(e)} |")
    lines += ["", "| benchmark | figure | value | baseline | baseline value | ratio | target | met |",
              "|---|---|---|---|---|---|---|---|"]
    for e in report["benchmarks"]:
        if e["status"] != "ok":
            lines.append(f"| {e['name']} | {e['status']}: {_cell(e['error'])} | - | - | - | - | - | - |")
            continue
        for f in e["result"]["figures"]:
            lines.append(f"| {e['name']} | {_cell(f['figure'])} | {_value(f['value'], f['unit'])} "
                         f"| {_cell(f['baseline_name'] or '-')} | {_value(f['baseline'], f['unit'])} "
                         f"| {_ratio(f['ratio'])} | {_cell(f['target'] or '-')} | {_met(f['met'])} |")
    for e in report["benchmarks"]:
        if e["status"] == "ok":
            lines += ["", f"### {e['name']}", "", e["result"]["markdown"].rstrip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a few minutes on 2 cores")
    p.add_argument("--only", help="comma-separated benchmark names (default: all)")
    p.add_argument("--out", default=str(HERE / "results.json"), help="the JSON file of figures")
    p.add_argument("--markdown", default=str(HERE / "results.md"), help="the markdown file")
    p.add_argument("--timeout", type=float, help="seconds per benchmark (default: 900 quick, 3600 full)")
    p.add_argument("--bench-dir", default=str(HERE), help="where the benchmark modules are")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bench_dir = Path(args.bench_dir).resolve()
    if args.child:
        _child(args.child, bench_dir, args.quick, Path(args.result))
        return 0
    try:
        names = select(discover(bench_dir), args.only)
    except ValueError as e:
        p.error(str(e))
    timeout_s = args.timeout or TIMEOUT_S[args.quick]
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "") + \
        (f" --only {args.only}" if args.only else "")
    report = dict(command=command, quick=args.quick, machine=machine(), benchmarks=[])
    start = time.perf_counter()
    for name in names:
        print(f"{name} ...", flush=True)
        entry = run_one(name, args.quick, bench_dir, timeout_s)
        report["benchmarks"].append(entry)
        print(f"{name}: {entry['status']} in {entry['wall_s']:.0f} s"
              + (f" ({entry['error']})" if entry["status"] != "ok" else ""), flush=True)
    report["wall_s"] = time.perf_counter() - start
    report["load_average_end"] = list(os.getloadavg())
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(report)
    Path(args.markdown).write_text(markdown)
    print(f"wrote {args.out} and {args.markdown}")
    return 1 if any(e["status"] in ("error", "timeout") for e in report["benchmarks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
