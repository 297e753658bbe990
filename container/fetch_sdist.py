"""Download a package's source release by name and version from a package index, checked against a
pinned sha256 (the Dockerfile's vLLM build uses it; so can a person refreshing the pins).

    python container/fetch_sdist.py vllm 0.33.0 <sha256> /opt/vllm.tar.gz [--index-url URL]

The file is found through the index's simple API (PEP 691 JSON, what pip reads), so no URL path is
written down anywhere; its bytes must hash to the pinned value (and to the index's own hash). Not
`pip download`: it prepares the sdist's metadata, which for vLLM runs its setup.py and needs its
build requirements (setuptools-rust, torch) before a single byte is checked. Standard library only:
it runs in a bare build stage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ACCEPT = "application/vnd.pypi.simple.v1+json"
DEFAULT_INDEX = "https://pypi.org/simple"


class FetchError(Exception):
    """One line for the build log: what was asked, what was found, what to do."""


def find_sdist(index_url: str, name: str, version: str) -> tuple[str, str | None]:
    """(url, the index's sha256 or None) of ``<name>-<version>.tar.gz`` on the index."""
    page = f"{index_url.rstrip('/')}/{name}/"
    request = urllib.request.Request(page, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=60) as response:
        kind = response.headers.get_content_type()
        if kind != ACCEPT:  # an index that serves only PEP 503 HTML
            raise FetchError(f"{page} answered {kind}, not {ACCEPT}: use an index with PEP 691's JSON API "
                             "(PyPI, a recent devpi or Artifactory)")
        listing = json.load(response)
    filename = f"{name}-{version}.tar.gz"
    for entry in listing.get("files", []):
        if entry.get("filename") == filename:
            return urllib.parse.urljoin(page, entry["url"]), entry.get("hashes", {}).get("sha256")
    raise FetchError(f"{page} lists no {filename}: check the version, or that the index serves sdists")


def fetch(name: str, version: str, sha256: str, out: Path, index_url: str = DEFAULT_INDEX) -> Path:
    """Download to ``out`` (through ``out``.part, renamed only once the hash matches)."""
    url, listed = find_sdist(index_url, name, version)
    if listed is not None and listed != sha256:
        raise FetchError(f"the index lists sha256 {listed} for {name} {version}, the pin is {sha256}: "
                         "the pin is stale or the index is not the one it was taken from")
    part = out.with_name(out.name + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=600) as response, open(part, "wb") as f:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
    except OSError as e:  # urllib's errors included: nothing half-written stays
        part.unlink(missing_ok=True)
        raise FetchError(f"{url}: {e}") from e
    if digest.hexdigest() != sha256:
        part.unlink()
        raise FetchError(f"{url} hashes to {digest.hexdigest()}, the pin is {sha256}: not the pinned release")
    os.replace(part, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("version")
    p.add_argument("sha256")
    p.add_argument("out", type=Path)
    p.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX),
                   help="a simple-API index (default: $PIP_INDEX_URL, else PyPI)")
    args = p.parse_args(argv)
    try:
        path = fetch(args.name, args.version, args.sha256.lower(), args.out, args.index_url)
    except FetchError as e:
        print(f"fetch_sdist: {e}", file=sys.stderr)
        return 1
    print(f"fetch_sdist: {path} ({path.stat().st_size} bytes, sha256 {args.sha256})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
