"""README.md against the repository, so that it cannot drift unnoticed: the quick start's two
commands (and that .ci/run runs the second), every repository path it names, every
`megatron-dapo` command line and tool flag it shows, every number it quotes from a generated docs
file, and its length. Reads files and builds argparse parsers only (no subprocess)."""

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from megatron_dapo.cli import build_parser, parse_args

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

QUICK_START = (
    "./install.sh && .venv/bin/megatron-dapo train --config conf/cpu_tiny.yaml",
    "./install.sh test && .venv/bin/python -m pytest -q",
)
FAST_TIER = '.venv/bin/python -m pytest -q -m "not slow"'
MAX_LINES = 300

# Slash-bearing words in README that are not repository paths: hub ids, and what a run or the
# install creates.
NOT_REPO_PATHS = {"Qwen/Qwen2.5-32B", "BytedTsinghua-SIA/DAPO-Math-17k"}
OUTPUT_DIRS = {"runs", ".venv"}


# Numbers README quotes from generated docs files: (pattern with one group, source, what must fill
# it). Keep them few: each is a sentence README must keep.
QUOTES = [
    (r"the campaign's ([\d,]+) broken inputs",
     "docs/bad_input_campaign.json: the number of inputs",
     lambda: f"{len(json.loads((ROOT / 'docs' / 'bad_input_campaign.json').read_text())):,}"),
]


def _text() -> str:
    return README.read_text()


def _split(text: str) -> tuple[list[str], str]:
    """(fenced code blocks' contents, the prose with the blocks blanked out)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return blocks, prose


def _inline_code(prose: str) -> list[str]:
    """Inline code spans, a span across a line break joined into one line."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def _code_lines(blocks: list[str]) -> list[str]:
    """Logical lines of the code blocks: backslash continuations joined, comments dropped."""
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(re.split(r"\s#", line, maxsplit=1)[0])
    return lines


def _segments() -> list[str]:
    """Every piece of code README shows: inline spans and code-block lines."""
    blocks, prose = _split(_text())
    return _inline_code(prose) + _code_lines(blocks)


def _expand_braces(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    head, tail = word[:m.start()], word[m.end():]
    return [e for alt in m.group(1).split(",") for e in _expand_braces(head + alt + tail)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _placeholders(words: list[str]) -> list[str]:
    """A shown command line as argv: [optional] brackets dropped, `...` dropped, and placeholders
    (F, D, N, AIME.parquet, R.jsonl: capitals, optionally with an extension) given a value."""
    out = []
    for w in words:
        w = w.strip("[]")
        if not w or w == "...":
            continue
        out.append("1" if re.fullmatch(r"[A-Z]+(\.[a-z]+)?", w) else w)
    return out


def _argv(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in prose: split on white space
        return text.split()


def _command_after(segment: str, anchor: str) -> list[list[str]]:
    """The argv that follows each occurrence of anchor in a segment, up to a shell separator."""
    found = []
    for m in re.finditer(re.escape(anchor) + r"(?=\s|$)", segment):
        rest = re.split(r"\s(?:;|&&|\|\|?)\s|;\s*|\s\||`", segment[m.end():])[0]
        found.append(_argv(rest))
    return found


def test_quick_start_commands_are_the_two_and_ci_runs_the_second():
    section = _text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks, _ = _split(section)
    assert [b.strip() for b in blocks[:2]] == list(QUICK_START), (
        "README's quick start must show exactly the two set-up commands, each in its own block")
    assert blocks[2].strip() == FAST_TIER, "the third block of the quick start is the fast tier"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci[-1].strip() == QUICK_START[1], ".ci/run must run README's second command"
    assert f"`{FAST_TIER}`" in (ROOT / "tests" / "README.md").read_text(), (
        "tests/README.md's fast tier is another command than README's")


def test_every_repository_path_named_exists():
    blocks, prose = _split(_text())
    words = [w for seg in _inline_code(prose) + _code_lines(blocks) for w in seg.split()]
    missing = []
    for word in words:
        word = word.lstrip("([\"'`").rstrip(")],;:.\"'`")
        if ("/" not in word or word in NOT_REPO_PATHS or "://" in word or "=" in word
                or word.startswith(("/", "$", "~", "-", "<")) or any(c in word for c in "<>*")):
            continue
        for path in _expand_braces(word):
            first, last = path.split("/")[0], path.rstrip("/").split("/")[-1]
            # a path: under a top-level entry, or a dir (trailing /) or a file name with an
            # extension; not a metric name (actor/entropy) or a ratio of words (TP/PP)
            looks_like_path = (ROOT / first).exists() or path.endswith("/") or re.search(r"\.[a-z]+$", last)
            if looks_like_path and first not in OUTPUT_DIRS and not (ROOT / path).exists():
                missing.append(path)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            missing.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                missing.append(f"{target} (no such heading)")
    assert not missing, f"README names paths that do not exist: {sorted(set(missing))}"


def test_every_megatron_dapo_command_line_parses():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    shown, bad = 0, []
    for segment in _segments():
        for argv in _command_after(segment, "megatron-dapo") + _command_after(segment, "megatron_dapo.cli"):
            if not argv or argv[0].startswith("<"):  # "megatron-dapo" alone, or "<command>"
                continue
            shown += 1
            if argv[0] not in sub.choices:
                bad.append(f"{segment!r}: {argv[0]!r} is not a subcommand ({', '.join(sub.choices)})")
                continue
            options = {o for a in sub.choices[argv[0]]._actions for o in a.option_strings}
            bad += [f"{segment!r}: {argv[0]} has no option {w} (argparse would take it as an abbreviation)"
                    for w in argv if w.startswith("--") and w.split("=")[0] not in options]
            if len(argv) == 1:  # the subcommand named in prose, no command line shown
                continue
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    parse_args(_placeholders(argv))
            except SystemExit:
                bad.append(f"{segment!r}: {err.getvalue().strip().splitlines()[-1]}")
    assert shown >= 10, f"found only {shown} megatron-dapo command lines in README"
    assert not bad, "README shows megatron-dapo command lines that do not parse:\n" + "\n".join(bad)


def _convert_ckpt_parser(name: str):
    path = ROOT / "tools" / "convert_ckpt" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_readme_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def test_every_tool_command_line_shown_is_accepted():
    """Every --flag shown appears, whole, in the script (argparse would accept an abbreviation), and
    tools/convert_ckpt/*.py lines also parse with the tool's own parser."""
    bad, shown = [], 0
    for segment in _segments():
        for m in re.finditer(r"((?:tools|benchmarks)/[\w/]+\.(?:py|sh)"
                             r"|(?<![\w/])(?:hf_to_megatron|megatron_to_hf|verify)\.py)"
                             r"((?:\s+[^\s;|&#`]+)*)", segment):
            script, argv = m.group(1), _placeholders(_argv(m.group(2)))
            if "/" not in script:  # a converter named without its folder
                script = f"tools/convert_ckpt/{script}"
            shown += 1
            source = (ROOT / script).read_text()
            bad += [f"{segment!r}: {script} has no {flag}" for flag in argv if flag.startswith("--")
                    and not re.search(re.escape(flag.split("=")[0]) + r"(?![\w-])", source)]
            if script.startswith("tools/convert_ckpt/") and argv:  # (no argv: named in prose)
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err):
                        _convert_ckpt_parser(Path(script).stem)(argv)
                except SystemExit:
                    bad.append(f"{segment!r}: {err.getvalue().strip().splitlines()[-1]}")
    assert shown >= 4, f"found only {shown} tool command lines in README"
    assert not bad, "README shows tool command lines their scripts do not accept:\n" + "\n".join(bad)


@pytest.mark.parametrize("pattern, source, expected", QUOTES, ids=[q[1].split(":")[0] for q in QUOTES])
def test_quoted_numbers_equal_the_generated_files(pattern, source, expected):
    found = re.findall(pattern, " ".join(_text().split()))
    assert found, f"README no longer quotes /{pattern}/; update QUOTES in {Path(__file__).name}"
    assert set(found) == {expected()}, f"README quotes {found} where {source} says {expected()}"


def test_readme_is_short():
    lines = len(_text().splitlines())
    assert lines <= MAX_LINES, f"README has {lines} lines (at most {MAX_LINES}: move detail into docs/)"
