"""container/fetch_sdist.py: a source release found by name and version through a simple-API index
(a real HTTP server on localhost serving PEP 691 JSON), kept only when its bytes hash to the pin.
That PyPI lists the Dockerfile's pin for vLLM is tests/functional/test_container_resolve.py."""

import hashlib
import http.server
import importlib.util
import json
import threading

import pytest

from tests.helpers.container import ROOT

spec = importlib.util.spec_from_file_location("fetch_sdist", ROOT / "container" / "fetch_sdist.py")
fetch_sdist = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_sdist)

PAYLOAD = b"not really a tarball, but bytes with a hash" * 1000
PIN = hashlib.sha256(PAYLOAD).hexdigest()


@pytest.fixture
def index():
    """A one-package index: {'listed': the hash the index shows (None: none), 'body': the file's bytes,
    'listing_type': the Content-Type of its listing}."""
    state = {"listed": PIN, "body": PAYLOAD, "listing_type": fetch_sdist.ACCEPT}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/simple/pkg/":
                entry = {"filename": "pkg-1.0.tar.gz", "url": "../../files/pkg-1.0.tar.gz",
                         "hashes": {"sha256": state["listed"]} if state["listed"] else {}}
                body, kind = json.dumps({"files": [entry]}).encode(), state["listing_type"]
            elif self.path == "/files/pkg-1.0.tar.gz":
                body, kind = state["body"], "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/simple"
    yield state
    server.shutdown()


def test_the_pinned_release_is_fetched_by_name_and_version(index, tmp_path):
    out = tmp_path / "pkg.tar.gz"
    assert fetch_sdist.main(["pkg", "1.0", PIN.upper(), str(out), "--index-url", index["url"]]) == 0
    assert out.read_bytes() == PAYLOAD and not (tmp_path / "pkg.tar.gz.part").exists()


def test_other_bytes_are_refused_and_nothing_is_left(index, tmp_path, capsys):
    index["listed"], index["body"] = None, PAYLOAD[:-1] + b"!"  # an index without hashes, a changed file
    out = tmp_path / "pkg.tar.gz"
    assert fetch_sdist.main(["pkg", "1.0", PIN, str(out), "--index-url", index["url"]]) == 1
    assert f"the pin is {PIN}: not the pinned release" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_stale_pin_is_refused_before_downloading(index, tmp_path, capsys):
    index["listed"] = "0" * 64
    assert fetch_sdist.main(["pkg", "1.0", PIN, str(tmp_path / "x"), "--index-url", index["url"]]) == 1
    assert "the pin is stale" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_a_version_the_index_lacks_is_one_line(index, tmp_path, capsys):
    assert fetch_sdist.main(["pkg", "2.0", PIN, str(tmp_path / "x"), "--index-url", index["url"]]) == 1
    assert "lists no pkg-2.0.tar.gz" in capsys.readouterr().err


def test_an_html_only_index_is_one_line(index, tmp_path, capsys):
    index["listing_type"] = "text/html"  # PEP 503 only: no JSON to read
    assert fetch_sdist.main(["pkg", "1.0", PIN, str(tmp_path / "x"), "--index-url", index["url"]]) == 1
    assert "answered text/html, not application/vnd.pypi.simple.v1+json" in capsys.readouterr().err
