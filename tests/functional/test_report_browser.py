"""megatron_dapo/observe/report.py: report.html as a real browser reads it (headless Chromium).

A hand-made run dir (metrics, two alarm events, sample dumps whose response holds
``<script>alert(1)</script>`` and ``&``) is reported, then Chromium loads the file and dumps its
DOM after parsing: what a reader sees, not what the writer meant. Chromium comes from Debian's
``chromium`` package (./install.sh test installs it where root and apt are there); without it the
browser tests skip and say so. The empty-run test needs no browser.
"""

import json
import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser

import pytest

pytest.importorskip("matplotlib")

from megatron_dapo.observe.report import write_report  # noqa: E402  (after the importorskip)
from megatron_dapo.observe.rows import SampleRow, alarm_file, step_file, write_rows  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: apt-get install chromium (./install.sh test does as root)")
EVIL = "I think <script>alert(1)</script> and 3 & 4 < 5.\nAnswer: 42\nthat's it"
TIMEOUT_S = 60  # a load takes ~3 s; a page whose script opened an alert() dialog never finishes
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find_all(self, tag=None, **attrs):
        """Every element below this one (document order) with that tag and attribute values."""
        for c in self.children:
            if isinstance(c, Node):
                if (tag is None or c.tag == tag) and all(c.attrs.get(k) == v for k, v in attrs.items()):
                    yield c
                yield from c.find_all(tag, **attrs)


class _TreeBuilder(HTMLParser):
    """The dumped DOM back into a tree (Chromium's serialisation is well formed)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_endtag(self, tag):
        node = self.cur
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.cur = node.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def _row(step, prompt_index, response, acc, pred, flags=()):
    return SampleRow(phase="train", prompt_index=prompt_index, group=0, response_index=prompt_index % 2,
                     prompt=f"Find the largest of 4 2 {prompt_index}", response=response, response_tokens=12,
                     response_chars=len(response), finish_reason="stop", ground_truth="42", scorer="toy_max",
                     acc=acc, pred=pred, audit_scorer="dapo_math", audit_acc=acc, audit_pred=pred, step=step,
                     flags=list(flags))


def _make_run(run_dir):
    records = []
    for step in range(10):
        r = {"step": step, "time": 1000.0 + step, "reward/acc_mean": step / 10,
             "response_length/mean": 12 + step, "actor/entropy": 1.0 / (step + 1),
             "timing_s/step": 2.0, "timing_s/rollout": 1.5,
             "alarm/no_answer_line": 0.6 if step == 3 else 0.1}
        if step % 3 == 0:
            r |= {"eval/avg@4": step / 12, "eval/avg@4_value": step / 13, "eval/pass@4": step / 9,
                  "eval/cons@4": 0.0}
        records.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    events = [{"step": 3, "alarm": "no_answer_line", "value": 0.6, "threshold": 0.5,
               "message": "60% of responses have no 'Answer:' line"},
              {"step": 8, "alarm": "entropy_min", "value": 0.011, "threshold": 0.02,
               "message": "actor/entropy < 0.02: <collapse> & more"}]
    (run_dir / "alarms.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    write_rows(step_file(run_dir, 5), [_row(5, 7, "old dump\nAnswer: 1", False, "1")])
    write_rows(step_file(run_dir, 9), [_row(9, 0, EVIL, True, "42"),
                                       _row(9, 1, "no label here, 41", False, "", ["no_answer_line"]),
                                       _row(9, 2, "Answer: Answer: 42", True, "42",
                                            ["repeated_answer_label"])])
    write_rows(alarm_file(run_dir, 3, "no_answer_line"),
               [_row(3, 5, "nothing", False, "", ["no_answer_line"])])


def _chromium(*args, profile):
    """Chromium's stdout; its own process group, so that a hung browser goes whole."""
    cmd = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"Chromium did not finish in {TIMEOUT_S} s: something in the page blocks it, as a "
                    "script's alert() dialog does (was model output written unescaped?)")
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    _make_run(run_dir)
    path = write_report(run_dir)
    assert path == run_dir / "report.html"
    return path


def _tree(text: str) -> Node:
    builder = _TreeBuilder()
    builder.feed(text)
    return builder.root


@pytest.fixture(scope="module")
def dom(report, tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no chromium")
    return _tree(_chromium("--dump-dom", report.as_uri(), profile=tmp_path_factory.mktemp("profile")))


def _section(dom, ident):
    (section,) = dom.find_all("section", id=ident)
    return section


@needs_chromium
def test_sections_and_curves(dom):
    for ident in ("curves", "numbers", "alarms", "samples"):
        _section(dom, ident)
    (img,) = _section(dom, "curves").find_all("img")
    assert img.attrs["src"].startswith("data:image/png;base64,iVBOR")  # a PNG's magic, base64
    numbers = {next(tr.find_all("th")).text(): [td.text() for td in tr.find_all("td")]
               for tr in _section(dom, "numbers").find_all("tr")}
    assert numbers["step"][0] == "9"
    assert numbers["eval/avg@4"] == ["0.75", "step 9"] and numbers["eval/avg@4_value"][1] == "step 9"
    assert numbers["actor/entropy"] == ["0.1", "step 9"]


@needs_chromium
def test_alarms_newest_first_and_escaped(dom):
    rows = list(_section(dom, "alarms").find_all("tr", **{"class": "alarm"}))
    cells = [[td.text() for td in tr.find_all("td")] for tr in rows]
    assert [c[:2] for c in cells] == [["8", "entropy_min"], ["3", "no_answer_line"]]
    assert cells[0][4] == "actor/entropy < 0.02: <collapse> & more"  # text, not a <collapse> element
    assert not list(dom.find_all("collapse"))


@needs_chromium
def test_latest_samples_with_marked_answer_and_no_script(dom):
    samples = _section(dom, "samples")
    divs = list(samples.find_all("div", **{"class": "sample"}))
    assert len(divs) == 3 and all("train step 9" in d.text() for d in divs)  # the latest regular dump only
    assert "old dump" not in samples.text()
    evil = [pre for pre in samples.find_all("pre") if "alert(1)" in pre.text()]
    assert len(evil) == 1 and evil[0].text() == EVIL  # the response shown as it was written
    assert [m.text() for m in evil[0].find_all("mark")] == ["Answer: 42"]
    assert not list(dom.find_all("script"))  # escaped: no element came of it
    assert "flags: no_answer_line" in divs[1].text() and not list(divs[1].find_all("mark"))
    assert [m.text() for m in divs[2].find_all("mark")] == ["Answer: Answer: 42"]
    (link,) = samples.find_all("a")
    assert link.attrs["href"] == "samples/alarm_00000003_no_answer_line.jsonl"


@needs_chromium
def test_screenshot_is_not_blank(report, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    shot = tmp_path / "report.png"
    _chromium(f"--screenshot={shot}", "--window-size=1280,2000", report.as_uri(),
              profile=tmp_path / "profile")
    with Image.open(shot) as image:
        assert image.size == (1280, 2000)
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is None or len(colors) > 50  # text, tables and the curves: far more than a blank page


def test_file_parses_without_script(report):
    """The same escaping check on the file itself (Python's HTML parser, no browser): it runs where
    Chromium is absent, and fails on an assertion where the browser would hang on the alert."""
    page = _tree(report.read_text(encoding="utf-8"))
    assert not list(page.find_all("script"))
    assert [pre.text() for pre in page.find_all("pre") if "alert(1)" in pre.text()] == [EVIL]


def test_report_of_an_empty_run_dir(tmp_path):
    """Nothing but the dir: every section says what is missing, nothing raises."""
    page = write_report(tmp_path).read_text()
    for ident in ("curves", "numbers", "alarms", "samples"):
        assert f'id="{ident}"' in page
    assert "no curves" in page and "no alarms" in page and "no sample dumps" in page
    assert write_report(tmp_path / "not" / "there") is None
