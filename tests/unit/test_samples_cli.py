"""``megatron-dapo samples`` (observe/samples_cli.py) on dump files written by hand in tmp_path: each
filter selects exactly the rows this file expects (named below, independently of the code), the step
choice, the errors, the --n cap and count line, the answer-line highlight, and the CLI end to end."""

import sys
import types

import pytest

from megatron_dapo import cli
from megatron_dapo.errors import InputError
from megatron_dapo.observe.rows import SampleRow, alarm_file, step_file, write_rows
from megatron_dapo.observe.samples_cli import format_row, select_rows


def _row(name: int, **kw) -> SampleRow:
    """A training row of step 5 whose prompt_index is its name, overridden by ``kw``."""
    base = dict(phase="train", prompt_index=name, group=0, response_index=name, prompt=f"Problem {name}?",
                response="Let me think.\nAnswer: 42", response_tokens=30, response_chars=24, finish_reason="stop",
                ground_truth="42", scorer="math_verify", acc=True, pred="42", audit_scorer="dapo_math",
                audit_acc=True, audit_pred="42", score=1.0, reward=1.0, advantage=0.5, kept=True,
                weight_version=4, step=5, flags=[])
    return SampleRow(**{**base, **kw})


# The rows' names (prompt_index) and what each is.
CORRECT, WRONG, TRUNCATED, DISAGREE, DROPPED_A, DROPPED_B, EVAL = range(7)
ROWS = [
    _row(CORRECT, response_tokens=9),
    _row(WRONG, acc=False, audit_acc=False, pred="41", audit_pred="41", score=-1.0, reward=-1.0, advantage=-0.5),
    _row(TRUNCATED, acc=False, audit_acc=False, finish_reason="length", response_tokens=512, response="so so so",
         pred="", audit_pred="", score=-1.0, reward=-1.5, advantage=-0.7, flags=["no_answer_line"]),
    _row(DISAGREE, acc=False, audit_acc=True, pred="42.0", score=-1.0, reward=-1.0, advantage=-0.5,
         flags=["scorer_disagreement"]),
    _row(DROPPED_A, group=1, audit_scorer=None, audit_acc=None, audit_pred=None, advantage=None, kept=False),
    _row(DROPPED_B, group=1, audit_scorer=None, audit_acc=None, audit_pred=None, advantage=None, kept=False),
    _row(EVAL, phase="eval", scorer="dapo_math", score=None, reward=None, advantage=None, kept=None),
]
TRAIN = {CORRECT, WRONG, TRUNCATED, DISAGREE, DROPPED_A, DROPPED_B}
EARLY = [_row(100, step=2, weight_version=1), _row(101, step=2, weight_version=1, acc=False)]


@pytest.fixture
def run(tmp_path):
    """A run dir with dumps of steps 2 and 5 and one alarm dump at step 5."""
    write_rows(step_file(tmp_path, 2), EARLY)
    write_rows(step_file(tmp_path, 5), ROWS)
    write_rows(alarm_file(tmp_path, 5, "scorer_disagreement"), [ROWS[DISAGREE]])
    return tmp_path


def _names(rows) -> set[int]:
    return {row.prompt_index for _, row in rows}


@pytest.mark.parametrize("where, expected", [
    ("wrong", {WRONG, TRUNCATED, DISAGREE}),
    ("correct", {CORRECT, DROPPED_A, DROPPED_B, EVAL}),
    ("truncated", {TRUNCATED}),
    ("kept", {CORRECT, WRONG, TRUNCATED, DISAGREE}),
    ("dropped", {DROPPED_A, DROPPED_B}),
    ("flagged", {TRUNCATED, DISAGREE}),
    ("eval", {EVAL}),
    ("train", TRAIN),
    ("disagree", {DISAGREE}),
    # negation, and terms combined (all must hold)
    ("!kept", {DROPPED_A, DROPPED_B, EVAL}),
    ("!flagged,train", {CORRECT, WRONG, DROPPED_A, DROPPED_B}),
    ("wrong, kept, !truncated", {WRONG, DISAGREE}),
    # comparisons: numbers as numbers (9 < 20, though "9" > "20" as text), booleans, None, flags
    ("response_tokens>20", {WRONG, TRUNCATED, DISAGREE, DROPPED_A, DROPPED_B, EVAL}),
    ("response_tokens<20", {CORRECT}),
    ("reward<0", {WRONG, TRUNCATED, DISAGREE}),
    ("reward>0", {CORRECT, DROPPED_A, DROPPED_B}),
    ("advantage=0.5", {CORRECT}),
    ("weight_version=4", TRAIN | {EVAL}),
    ("audit_acc=true", {CORRECT, DISAGREE, EVAL}),
    ("audit_acc=none", {DROPPED_A, DROPPED_B}),
    ("kept=false", {DROPPED_A, DROPPED_B}),
    ("finish_reason=length", {TRUNCATED}),
    ("scorer!=math_verify", {EVAL}),
    ("pred=", {TRUNCATED}),
    ("flags=no_answer_line", {TRUNCATED}),
    ("flags!=scorer_disagreement", TRAIN - {DISAGREE} | {EVAL}),
])
def test_where_selects_exactly_the_expected_rows(run, where, expected):
    assert _names(select_rows(run, where=where)) == expected


def test_disagree_phase_and_n(run):
    assert _names(select_rows(run, disagree=True)) == {DISAGREE}
    assert _names(select_rows(run, phase="eval")) == {EVAL}
    assert _names(select_rows(run, where="correct", phase="train")) == {CORRECT, DROPPED_A, DROPPED_B}
    assert [r.prompt_index for _, r in select_rows(run, n=2)] == [CORRECT, WRONG]  # file order


@pytest.mark.parametrize("where, named", [
    ("bogus", ["'bogus'", "wrong", "disagree", "response_tokens", "weight_version"]),
    ("!nope", ["'!nope'", "truncated"]),
    ("nope=3", ["'nope'", "fields:", "prompt_index", "flags"]),
    ("flags=no_such_flag", ["'no_such_flag'", "repeated_answer_label", "scorer_disagreement"]),
    ("acc=maybe", ["acc", "true or false", "'maybe'"]),
    ("reward>high", ["reward", "number", "'high'"]),
    ("scorer>a", ["compares numbers", "scorer"]),
])
def test_bad_where_is_one_line_naming_the_term(run, where, named):
    with pytest.raises(InputError) as e:
        select_rows(run, where=where)
    message = str(e.value)
    assert "\n" not in message
    for text in named:
        assert text in message


def test_step_choice(run):
    assert {r.step for _, r in select_rows(run)} == {5}  # default: the latest step dumped
    assert _names(select_rows(run, step=2)) == {100, 101}
    assert _names(select_rows(run, step="2", where="wrong")) == {101}
    assert len(select_rows(run, step="all")) == len(EARLY) + len(ROWS)
    with pytest.raises(InputError, match=r"no dump for step 3; steps with dumps: 2, 5"):
        select_rows(run, step=3)
    with pytest.raises(InputError, match="step number or 'all'"):
        select_rows(run, step="latest")


def test_alarm_dumps(run):
    assert _names(select_rows(run, alarm="scorer_disagreement")) == {DISAGREE}
    with pytest.raises(InputError, match="alarms with dumps: scorer_disagreement"):
        select_rows(run, alarm="identical_groups")


def test_no_dumps_says_where_it_looked(tmp_path):
    for run_dir in (tmp_path, tmp_path / "missing"):
        with pytest.raises(InputError) as e:
            select_rows(run_dir)
        assert str(run_dir / "samples") in str(e.value) and "logging.samples_every" in str(e.value)
    write_rows(alarm_file(tmp_path, 3, "no_answer_line"), [ROWS[TRUNCATED]])  # alarm dumps only
    with pytest.raises(InputError, match="step_"):
        select_rows(tmp_path)


def test_answer_line_highlight():
    row = _row(0, response="First try.\nanswer: 41\nNo, wait.\nAnswer: 42\nDone.")
    plain = format_row(row, color=False).splitlines()
    assert [line for line in plain if line.startswith("  >> ")] == ["  >> Answer: 42"]  # the last one only
    assert "    answer: 41" in plain and "\x1b[" not in "\n".join(plain)
    colored = format_row(row, color=True)
    assert "\x1b[1;33mAnswer: 42\x1b[0m" in colored and ">> " not in colored
    assert ">> " not in format_row(_row(0, response="no label here"), color=False)


def test_header_and_prompt_tail():
    row = _row(0, prompt="x" * 1000 + "THE END", flags=["scorer_disagreement"], acc=False, pred="7")
    text = format_row(row)
    head = text.splitlines()[0]
    for part in ["step 5 train", "prompt 0", "group 0 response 0", "math_verify wrong pred '7'",
                 "dapo_math correct pred '42'", "truth '42'", "kept", "finish stop", "30 tokens", "weights v4",
                 "flags scorer_disagreement"]:
        assert part in head
    prompt_line = text.splitlines()[2]
    assert prompt_line.endswith("THE END") and len(prompt_line) < 320


def test_cli_end_to_end(run, capsys):
    assert cli.main(["samples", str(run), "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 5 train") == 2 and ">> Answer: 42" in out
    assert out.rstrip().splitlines()[-1] == f"{len(ROWS)} matched in step 5, 2 shown; --n {len(ROWS)} shows all"

    assert cli.main(["samples", str(run), "--step", "all", "--where", "wrong,train", "--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[1m" in out and out.rstrip().splitlines()[-1] == "4 matched in steps 2-5 (2 files), 4 shown"

    assert cli.main(["samples", str(run), "--disagree", "--phase", "train"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("1 matched in step 5, 1 shown")


def test_cli_errors_are_one_line(run, capsys):
    assert cli.main(["samples", str(run), "--where", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-dapo: error: unknown --where term 'bogus'") and err.count("\n") == 1
    assert cli.main(["samples", str(run / "nowhere")]) == 2
    assert "logging.samples_every" in capsys.readouterr().err


def test_cli_report(tmp_path, capsys, monkeypatch):
    """The report subcommand prints write_report's path (observe/report.py stubbed: another module's job)."""
    written = tmp_path / "report.html"
    fake = types.ModuleType("megatron_dapo.observe.report")
    fake.write_report = lambda run_dir: written if run_dir == tmp_path else None
    monkeypatch.setitem(sys.modules, "megatron_dapo.observe.report", fake)
    assert cli.main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(written)
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    (tmp_path / "unwritable").mkdir()
    assert cli.main(["report", str(tmp_path / "unwritable")]) == 1  # write_report's None


def test_a_reader_that_stops_early_ends_the_listing_quietly(tmp_path):
    """`megatron-dapo samples RUN | head`: once the reader is gone, exit 141 (SIGPIPE's, as a shell
    reports it) without a BrokenPipeError traceback. The listing is far over a pipe's buffer."""
    import subprocess
    import sys

    many = ROWS * 200
    write_rows(step_file(tmp_path, 5), many)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_dapo.cli", "samples", str(tmp_path), "--n",
                             str(len(many))], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"step 5 train")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and err == "", err


def test_a_config_file_given_as_an_override_says_where_it_goes(capsys):
    assert cli.main(["train", "conf/cpu_tiny.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == ("megatron-dapo: config error: override 'conf/cpu_tiny.yaml' is not of the form key.path=value; "
                   "a config file goes after --config (--config conf/cpu_tiny.yaml)\n")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == "megatron-dapo 0.1.0\n"


def test_overrides_may_follow_a_flag():
    """`eval RUN --step 3 eval.n=8`: argparse alone stops taking positionals at --step and refuses
    `eval.n=8` as an unrecognized argument; an unknown flag is still refused."""
    from megatron_dapo.cli import parse_args

    args = parse_args(["eval", "runs/x", "--step", "3", "eval.n=8"])
    assert (args.overrides, args.step) == (["runs/x", "eval.n=8"], 3)
    with pytest.raises(SystemExit):
        parse_args(["eval", "runs/x", "--step", "3", "--stpe", "4"])
