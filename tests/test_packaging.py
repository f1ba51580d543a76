"""The distribution as pip builds it: PEP 561 markers in every package, the license file and
metadata (SPDX expression, classifiers, project URLs)."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("indexer", "indexer/router", "slab", "workers", "config")


def test_the_wheel_carries_py_typed_the_license_and_its_metadata(tmp_path: Path) -> None:
    # A copy of what the build reads, so that the build leaves the work tree as it is.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("indexer", "slab", "workers", "config"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("indexer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for package in PACKAGES:
            assert f"{package}/py.typed" in names, package
        assert "config/indexer.toml" in names
        (info,) = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert license_text == (ROOT / "LICENSE").read_text()
    assert license_text.startswith("Copyright 2026 The indexer authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
