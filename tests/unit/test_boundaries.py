"""The package's import rules, enforced (docs/DESIGN.md "Layout"):

* a fresh interpreter that imports the megatron-free parts has neither megatron nor vllm loaded;
* megatron is imported only under mcore/, vllm only by the vLLM engine's two modules;
* no import cycle between the package's units (its subpackages and top-level modules), counting
  imports inside functions too (a lazy import is still a dependency);
* benchmarks/ and the package import nothing from tests/;
* the CPU demo (toy/) is off the main path: only run.py imports it, and importing the main path's
  modules does not load it.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_dapo"
FREE = ["algo", "reward", "data", "groups", "trainer_state", "batching", "off_policy", "rollout", "rollout.engine",
        "rollout.placement", "rollout.hf_engine", "rollout.vllm_engine", "rollout.weight_sync", "rollout.pipeline",
        "rollout.separate", "rollout.engine_server", "rollout.channel", "rollout.protocol", "rollout.weight_stream",
        "step_model", "convert", "eval", "eval_metrics", "config", "config_loading", "metrics_log", "config_rules",
        "errors", "run_lock", "preemption", "quiet", "plotting", "toy", "memory_plan", "gpu_models", "generation_model",
        "plan_report", "layout", "ranks", "gpu_binding", "worked_example",
        "data.prepare", "mcore.run_export", "observe", "observe.observer", "observe.samples_cli", "observe.report",
        "observe.profiler",
        "toy.task", "toy.tokenizer", "toy.base", "toy.bootstrap"]
MAIN_PATH = ["cli", "run", "train", "eval", "groups", "mcore.actor", "mcore.checkpoint", "rollout.placement"]
DEMO_GATES = {"run.py"}  # the one module that reaches the demo (under toy.enable)
VLLM_HOMES = {"rollout/vllm_engine.py", "rollout/vllm_colocation.py"}


def _imports(path: Path):
    """(line, imported module) of every import statement, at any depth; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module


def _unit(module: str) -> str:
    """megatron_dapo.mcore.actor -> mcore; megatron_dapo.train -> train."""
    return module.split(".")[1]


def _loaded_after_importing(units: list[str], which: str) -> str:
    """A fresh interpreter imports megatron_dapo.<unit> for each unit and prints ``which``, an
    expression over the names in ``sys.modules`` (``mods``)."""
    code = ("import sys; " + "; ".join(f"import megatron_dapo.{m}" for m in units)
            + f"; mods = list(sys.modules); print({which})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_megatron_free_parts_load_neither_megatron_nor_vllm():
    assert _loaded_after_importing(FREE, "sorted({m.split('.')[0] for m in mods} & {'megatron', 'vllm'})") == "[]"


def test_megatron_only_under_mcore_and_vllm_only_in_its_engine():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top == "megatron" and not rel.startswith("mcore/"):
                bad.append(f"{rel}:{line} imports {module} (megatron belongs under mcore/)")
            if top == "vllm" and rel not in VLLM_HOMES:
                bad.append(f"{rel}:{line} imports {module} (vllm belongs in {sorted(VLLM_HOMES)})")
            if top == "tests":
                bad.append(f"{rel}:{line} imports {module} (the package imports nothing from tests/)")
    for path in sorted((PKG.parent / "benchmarks").glob("*.py")):
        bad += [f"benchmarks/{path.name}:{line} imports {m}" for line, m in _imports(path)
                if m.split(".")[0] == "tests"]
    assert not bad, "\n".join(bad)


def _graph() -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: where}."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        unit = rel.parts[0].removesuffix(".py")
        for line, module in _imports(path):
            if module.startswith("megatron_dapo.") and _unit(module) != unit:
                edges.setdefault(unit, {}).setdefault(_unit(module), f"{rel.as_posix()}:{line}")
    return edges


def test_no_import_cycle_between_units():
    edges, cycles = _graph(), []

    def visit(unit, stack):
        for nxt in edges.get(unit, {}):
            if nxt in stack:
                cycle = stack[stack.index(nxt):] + [nxt]
                cycles.append(" -> ".join(f"{a} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:])))
            elif nxt not in done:
                visit(nxt, stack + [nxt])
        done.add(unit)

    done: set[str] = set()
    for unit in sorted(edges):
        if unit not in done:
            visit(unit, [unit])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_the_demo_is_off_the_main_path():
    bad = [f"{path.relative_to(PKG).as_posix()}:{line} imports {module}"
           for path in sorted(PKG.rglob("*.py")) if path.relative_to(PKG).parts[0] != "toy"
           and path.relative_to(PKG).as_posix() not in DEMO_GATES
           for line, module in _imports(path) if module.startswith("megatron_dapo.toy")]
    assert not bad, "demo code imported outside toy/ and " + str(sorted(DEMO_GATES)) + ":\n" + "\n".join(bad)
    assert _loaded_after_importing(MAIN_PATH, "sorted(m for m in mods if m.startswith('megatron_dapo.toy'))") == "[]"


def test_documents_the_code_cites_are_in_the_repository():
    """Comments point at docs/ inside the repository, and every cited file exists."""
    root, cited, bad = PKG.parent, re.compile(r"docs/[\w/.-]+\.md"), []
    for path in sorted(p for d in ("megatron_dapo", "tools", "benchmarks", "tests") for p in (root / d).rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(root).as_posix()
        if path == Path(__file__).resolve():
            continue  # the patterns below
        bad += [f"{rel}: cites {m} (missing)" for m in cited.findall(text) if not (root / m).is_file()]
        bad += [f"{rel}: points outside the repository ({m})"
                for m in re.findall(r"\.\./shared\S*|shared/reference\S*", text)]
    assert not bad, "\n".join(bad)
