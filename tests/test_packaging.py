"""The distribution as pip builds it and a user installs it: every package found (none listed by
hand), the hot modules compiled into the wheel where a C compiler is there and pure Python where
not, PEP 561 markers, the license and metadata; and the wheel installed into a fresh venv outside
the source tree runs the daemon, a feed, a scan and the router."""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.router import Workload, generate
from tests.harness import (
    FEED_LINE,
    HOST,
    HTTP_LINE,
    INDEXES,
    jsonl_lines,
    model,
    stop_process,
    wait_for_line,
)

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("indexer", "slab", "workers", "config")
SUFFIX = str(sysconfig.get_config_var("EXT_SUFFIX"))
MYPYC = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["indexer"]["mypyc"]


def source_copy(destination: Path) -> Path:
    """What a build reads, copied, so that a build leaves the work tree as it is. The tree's
    build/ goes along: mypyc writes a C file only when its text changes, so a build of the same
    sources finds the compiled objects of `make compiled` up to date and links no new ones."""
    destination.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, destination / name)
    for package in TOP_LEVEL:
        shutil.copytree(
            ROOT / package,
            destination / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.so"),
        )
    if (ROOT / "build").is_dir():
        shutil.copytree(ROOT / "build", destination / "build", symlinks=True)
    return destination


def build_wheel(source: Path, out: Path, **env: str) -> Path:
    """`pip wheel` of `source` into `out`, with the test tools' setuptools and mypy."""
    built = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"),
            *("-w", str(out), str(source)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = out.glob("indexer-*.whl")
    return wheel


def packages_in_tree() -> set[str]:
    """Every package of the four top-level ones, as a path: what setuptools must find."""
    return {
        str(init.parent.relative_to(ROOT))
        for package in TOP_LEVEL
        for init in (ROOT / package).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pip builds from the sources, compiled where a C compiler is there."""
    tmp = tmp_path_factory.mktemp("wheel")
    return build_wheel(source_copy(tmp / "source"), tmp / "dist")


def test_the_wheel_carries_every_package_the_compiled_modules_and_the_metadata(
    wheel: Path,
) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (info,) = {n.split("/", 1)[0] for n in names if ".dist-info/" in n}
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    packages = packages_in_tree()
    assert {"indexer/router/inputs", "indexer/router/shards", "slab", "config"} <= packages
    for package in packages:
        assert f"{package}/__init__.py" in names, package
    for package in TOP_LEVEL:
        assert f"{package}/py.typed" in names, package
    assert "config/indexer.toml" in names
    if shutil.which(os.environ.get("CC", "cc").split()[0]) or shutil.which("gcc"):
        # The hot modules as extension modules beside their sources, and their shared library.
        for source in MYPYC["modules"]:
            assert source.removesuffix(".py") + SUFFIX in names, source
            assert source in names, source  # the Python stays: the reference, and the fallback
        assert MYPYC["group"].replace(".", "/") + f"__mypyc{SUFFIX}" in names
        assert "-cp311-" in wheel.name or f"-cp3{sys.version_info.minor}-" in wheel.name
    assert metadata["License-Expression"] == "Apache-2.0"
    assert license_text == (ROOT / "LICENSE").read_text()
    assert license_text.startswith("Copyright 2026 The indexer authors\n")
    assert "END OF TERMS AND CONDITIONS" in license_text
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert metadata["Requires-Python"] == ">=3.11"
    requires = metadata.get_all("Requires-Dist") or []
    assert any(r.startswith("trio") for r in requires) and any("pyspark" in r for r in requires)


def test_without_mypyc_the_wheel_is_pure_python(tmp_path: Path) -> None:
    wheel = build_wheel(source_copy(tmp_path / "source"), tmp_path / "dist", INDEXER_MYPYC="0")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert not [n for n in names if n.endswith(".so")]
    assert {source for source in MYPYC["modules"]} <= names
    assert "indexer/router/inputs/__init__.py" in names


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv, outside the source tree, with the wheel: its bin/. The wheel goes in
    without its dependencies, which the venv finds in the test environment's site-packages
    (a path in a .pth file, after its own: the test environment's editable install of the
    sources is not loaded from there), so it is the wheel's own files that run; installing
    pyarrow, numpy and the rest again would take most of a minute and test pip. The metadata
    test checks what the wheel requires."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The venv's own python runs pip (the test environment's), so the scripts are the venv's;
    # --ignore-installed: the test environment's install of the project is left alone.
    pip = subprocess.run(
        [
            *(str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-compile"),
            *("--no-deps", "--ignore-installed", str(wheel)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    assert (site / "indexer" / "__init__.py").is_file(), sorted(p.name for p in site.iterdir())
    yield venv / "bin"


def outside(bin_dir: Path, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """A command of the installed venv, run away from the source tree with no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=bin_dir.parent,
        env=env,
        **kwargs,  # type: ignore[call-overload]
    )


def test_the_installed_wheel_serves_feeds_scans_and_routes(installed: Path) -> None:
    where = outside(
        installed,
        "python",
        "-c",
        "import indexer, indexer.keys, slab.pool; print(indexer.__file__, indexer.keys.__file__,"
        " slab.pool.__file__)",
    )
    assert where.returncode == 0, where.stderr
    files = where.stdout.split()
    assert all(f.startswith(str(installed.parent)) for f in files), files
    if shutil.which(os.environ.get("CC", "cc").split()[0]) or shutil.which("gcc"):
        assert files[1].endswith(SUFFIX) and files[2].endswith(SUFFIX), files

    helped = outside(installed, "indexer", "router", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "Usage: indexer router" in helped.stdout

    work = installed.parent.parent
    config = work / "indexer.toml"
    config.write_text(
        f'[server]\ndata_dir = "{work / "data"}"\nhost = "{HOST}"\nfeed_port = 0\nhttp_port = 0\n'
        + "".join(
            f"[indexes.{name}]\nkeys = {json.dumps(keys)}\n" for name, keys in INDEXES.items()
        )
    )
    log = work / "daemon.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log, "wb") as err:
        daemon = subprocess.Popen(
            [str(installed / "indexer"), "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=work,
            env=env,
        )
    try:
        wait_for_line(log, "listening for router feeds", daemon)
        text = log.read_text()
        feed_port, http_port = FEED_LINE.findall(text)[-1], HTTP_LINE.findall(text)[-1]
        documents = list(generate(Workload(3000, 600, 0.1, 7)))
        jsonl = work / "docs.jsonl"
        jsonl.write_text("".join(jsonl_lines(documents)))
        fed = outside(
            installed, "indexer", "feed", "--to", f"{HOST}:{feed_port}", "--jsonl", str(jsonl)
        )
        assert fed.returncode == 0, fed.stderr
        url = f"http://{HOST}:{http_port}"
        for name, paths in INDEXES.items():
            scanned = outside(
                installed,
                "indexer",
                "scan",
                name,
                "--url",
                url,
                "--all",
                "--consistency",
                "request_plus",
            )
            assert scanned.returncode == 0, scanned.stderr
            rows = [json.loads(line) for line in scanned.stdout.splitlines()]
            assert rows == model(documents, paths), name
    finally:
        code = stop_process(daemon)  # type: ignore[arg-type]
    assert code == 0, log.read_text()[-3000:]
