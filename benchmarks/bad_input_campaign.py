"""Bad input, systematically: every class of input a user hands us, broken every way
benchmarks/_bad_input_cases.py lists, each run as the real CLI in a fresh process.

The verdict per input: exit code 2, the last line of stderr is one ``megatron-dapo...: error``
line naming the bad key, file or value (``Case.names``), no traceback, the run directory and every
guarded path (data, model and checkpoint dirs) byte-for-byte unchanged, no process left behind
(found by a marker in their environment), and the error before any model is built (no "starting
weights" / "resumed from" line) within ``TIME_BOUND_S``. An input accepted by design
(``Case.valid``, with the reason) must instead run to exit 0 with its guarded paths unchanged.

    python benchmarks/bad_input_campaign.py                       # every case, writes docs/bad_input_campaign.md
    python benchmarks/bad_input_campaign.py --classes data,hf\\ dir --workers 2 --no-docs
    python benchmarks/bad_input_campaign.py --per-class 3         # a slice: 3 of each class, evenly spaced
"""

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bad_input_cases import CLASSES, ROOT, Case, Fixtures, make_fixtures  # noqa: E402

TIME_BOUND_S = 60.0  # a fresh interpreter imports torch and transformers: ~5 s of it on 2 cores
LATE = ("starting weights from", "resumed from")  # logged once the model is built (run.build_run)
MARKER = "MEGATRON_DAPO_BAD_INPUT_CASE"
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                        "MASTER_ADDR")}


@dataclasses.dataclass
class Verdict:
    cls: str
    name: str
    rc: int | None
    seconds: float
    line: str  # the last line of stderr
    problems: list[str]  # empty: clear
    valid: str = ""

    @property
    def clear(self) -> bool:
        return not self.problems


def file_hashes(path: Path) -> dict[str, str]:
    """Every file under path (or path itself) -> the digest of its bytes; {} when it does not exist."""
    if not path.exists():
        return {}
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def changes(before: dict[str, str], after: dict[str, str], *, strict: bool) -> list[str]:
    """Files changed or gone since ``before``; ``strict`` (the run dir): also any file added."""
    out = [f"{f} {'changed' if f in after else 'gone'}" for f, h in before.items() if after.get(f) != h]
    return out + ([f"{f} added" for f in after if f not in before] if strict else [])


def _run_dir(case: Case) -> Path | None:
    for a in case.args:
        if a.startswith("logging.dir="):
            return Path(a.split("=", 1)[1])
    return None


def judge(case: Case, rc: int | None, err: str, seconds: float, changed: list[str], left: int) -> Verdict:
    """The verdict on one finished command (pure: the tests feed it made-up outcomes)."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    line = lines[-1] if lines else ""
    problems = []
    if case.valid:
        if rc != 0:
            problems.append(f"accepted by design ({case.valid}) but exited {rc}")
    else:
        if rc != 2:
            problems.append(f"exit code {rc}, not 2")
        if not (line.startswith("megatron-dapo") and "error" in line):
            problems.append("the last line is not a megatron-dapo error line")
        if case.names not in line:
            problems.append(f"the error line does not name {case.names!r}")
        if any(mark in err for mark in LATE):
            problems.append("refused only after the model was built")
    if "Traceback" in err:
        problems.append("a traceback")
    if changed:
        problems.append("changed: " + ", ".join(changed))
    if left:
        problems.append(f"{left} process(es) left behind")
    if seconds > TIME_BOUND_S and not case.valid:
        problems.append(f"took {seconds:.0f} s (bound {TIME_BOUND_S:.0f} s)")
    return Verdict(case.cls, case.name, rc, round(seconds, 2), line[:400], problems, case.valid)


def _leftovers(tag: str) -> int:
    found = 0
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER) == tag:
                found += 1
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def run_case(case: Case, tag: str) -> Verdict:
    """The command in a fresh process: the run dir (refused inputs) may gain nothing, guarded
    paths may gain files (a run accepted by design saves) but lose or change none."""
    run_dir = _run_dir(case)
    watched = [(Path(g), False) for g in case.guard] + ([(run_dir, True)] if run_dir and not case.valid else [])
    before = [file_hashes(p) for p, _ in watched]
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", *case.args], cwd=case.cwd or ROOT,
                             env={**ENV, MARKER: tag}, capture_output=True, text=True, timeout=300)
        rc, err = out.returncode, out.stderr
    except subprocess.TimeoutExpired as e:
        tail = e.stderr or ""
        rc, err = None, tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    seconds = time.perf_counter() - start
    time.sleep(0.2)  # children the CLI reaped a moment ago
    left = _leftovers(tag)
    changed = [c for (p, strict), b in zip(watched, before) for c in changes(b, file_hashes(p), strict=strict)]
    return judge(case, rc, err, seconds, changed[:5], left)


def campaign(classes: list[str], *, workers: int, per_class: int = 0, root: Path | None = None,
             progress: bool = True, match: str = "") -> list[Verdict]:
    with tempfile.TemporaryDirectory(prefix="bad_input_") as tmp:
        fx: Fixtures = make_fixtures(Path(root or tmp) / "campaign")
        cases = []
        for cls in classes:
            made = CLASSES[cls](fx)
            made = [c for c in made if match in c.name]
            cases += spread(made, per_class) if per_class else made
        done: list[Verdict] = []

        def one(item):
            i, case = item
            v = run_case(case, f"{os.getpid()}-{i}")
            done.append(v)
            if progress:
                mark = "clear" if v.clear else "FINDING: " + "; ".join(v.problems)
                print(f"[{len(done)}/{len(cases)}] {v.cls}: {v.name}: {mark}", flush=True)
            return v

        with ThreadPoolExecutor(workers) as pool:
            verdicts = list(pool.map(one, enumerate(cases)))
        for mount in ("full_disk", "ro_checkout"):
            _unmount(fx.root / mount)
        return verdicts


def spread(cases: list, n: int) -> list:
    """n cases evenly spaced through the list (a slice that touches the whole class)."""
    if n >= len(cases):
        return cases
    return [cases[round(i * (len(cases) - 1) / max(n - 1, 1))] for i in range(n)]


def _unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


def summary(verdicts: list[Verdict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for v in verdicts:
        r = rows.setdefault(v.cls, {"tried": 0, "clear": 0, "accepted_by_design": 0, "findings": 0})
        r["tried"] += 1
        r["clear"] += v.clear
        r["accepted_by_design"] += bool(v.valid) and v.clear
        r["findings"] += not v.clear
    return rows


def render_markdown(verdicts: list[Verdict], seconds: float) -> str:
    rows = summary(verdicts)
    total = {k: sum(r[k] for r in rows.values()) for k in ("tried", "clear", "accepted_by_design", "findings")}
    out = ["# Bad-input campaign (generated by `python benchmarks/bad_input_campaign.py`)", "",
           f"{total['tried']} inputs in {len(rows)} classes, {total['clear']} clear, {total['findings']} findings "
           f"({seconds:.0f} s). Verdict rules: the module docstring of benchmarks/bad_input_campaign.py.", "",
           "| class | inputs | clear | of them accepted by design | findings |", "|---|---|---|---|---|"]
    out += [f"| {c} | {r['tried']} | {r['clear']} | {r['accepted_by_design']} | {r['findings']} |"
            for c, r in rows.items()]
    bad = [v for v in verdicts if not v.clear]
    if bad:
        out += ["", "## Findings", ""] + [f"- {v.cls}: {v.name}: {'; '.join(v.problems)}; last line: `{v.line}`"
                                          for v in bad]
    out += ["", "## Accepted by design", ""] + [f"- {v.cls}: {v.name}: {v.valid}" for v in verdicts if v.valid]
    out += ["", "## Every input and its answer", "", "| class | input | rc | s | the error line |",
            "|---|---|---|---|---|"]
    out += [f"| {v.cls} | {v.name} | {v.rc} | {v.seconds:.1f} | {v.line.replace('|', '/')[:300]} |" for v in verdicts]
    return "\n".join(out) + "\n"


def run(quick: bool) -> dict:
    """For benchmarks/run_all.py: the whole campaign (quick: 3 inputs per class)."""
    start = time.time()
    verdicts = campaign(list(CLASSES), workers=2, per_class=3 if quick else 0, progress=False)
    total = len(verdicts)
    clear = sum(v.clear for v in verdicts)
    fig = dict(figure="bad inputs answered as the rules say", value=float(clear), unit=f"of {total}",
               baseline_name=None, baseline=None, ratio=None, target=f"{total} of {total}", met=clear == total)
    return dict(name="bad_input_campaign", figures=[fig], markdown=render_markdown(verdicts, time.time() - start),
                details=[dataclasses.asdict(v) for v in verdicts])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of: {', '.join(CLASSES)}")
    p.add_argument("--workers", type=int, default=2, help="commands run side by side")
    p.add_argument("--per-class", type=int, default=0, help="only N inputs of each class, evenly spaced (0: all)")
    p.add_argument("--match", default="", help="only inputs whose name contains this (implies --no-docs)")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/bad_input_campaign.{md,json}")
    args = p.parse_args()
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        p.error(f"unknown class(es) {unknown}; choose from {list(CLASSES)}")
    start = time.time()
    verdicts = campaign(classes, workers=args.workers, per_class=args.per_class, match=args.match)
    text = render_markdown(verdicts, time.time() - start)
    print("\n".join(text.splitlines()[:8 + len(classes)]))
    if not (args.no_docs or args.match):
        (ROOT / "docs" / "bad_input_campaign.md").write_text(text)
        (ROOT / "docs" / "bad_input_campaign.json").write_text(
            json.dumps([dataclasses.asdict(v) for v in verdicts], indent=1) + "\n")
    return 0 if all(v.clear for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
