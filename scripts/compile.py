"""Compile the hot modules with mypyc, in place: beside each source, an extension module of the
same name, which Python imports before the source. The code stays the Python it is (typed,
checked by mypy); without the extension modules it runs as it is, slower.

    python scripts/compile.py            # build (make does this: `make compiled`)
    python scripts/compile.py --clean    # remove them: the pure-Python modules run again
    python scripts/compile.py --list     # the modules, one per line
    python scripts/compile.py --check    # exit 1 if one is older than its source

A C compiler is needed (cc, or $CC): the build stops with one line if there is none.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _setup_script() -> Any:
    """setup.py as a module: the mypyc build of the hot modules, shared with the wheel's build."""
    spec = importlib.util.spec_from_file_location("indexer_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hot_modules() -> tuple[list[str], str]:
    """The sources mypyc compiles and the name of their shared library (pyproject's
    [tool.indexer.mypyc], which setup.py reads too)."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["indexer"]["mypyc"]
    return list(table["modules"]), str(table["group"])


COMPILED, GROUP = _hot_modules()


def suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def built(source: str) -> Path:
    return ROOT / (source.removesuffix(".py") + suffix())


def shared_library() -> Path:
    return ROOT / (GROUP.replace(".", "/") + f"__mypyc{suffix()}")


def stale() -> list[str]:
    """The compiled modules older than their sources (their edits would not run)."""
    return [
        source
        for source in COMPILED
        if built(source).exists()
        and built(source).stat().st_mtime < (ROOT / source).stat().st_mtime
    ]


def clean() -> None:
    for path in [*(built(source) for source in COMPILED), shared_library()]:
        path.unlink(missing_ok=True)
    (ROOT / f"indexer_hot__mypyc{suffix()}").unlink(missing_ok=True)  # where an older build put it


def build() -> int:
    setup_script = _setup_script()
    if setup_script.compiler() is None:
        print(
            "error: no C compiler (cc) to compile the hot modules with mypyc: install one "
            "(Debian: apt-get install gcc), or run the pure-Python modules as they are",
            file=sys.stderr,
        )
        return 1
    from setuptools import setup

    os.chdir(ROOT)
    clean()  # a module left out of the group must not keep an old build
    setup(
        name="indexer-compiled",
        ext_modules=setup_script.hot_extensions(),
        script_args=["--quiet", "build_ext", "--inplace", "--build-temp", "build/mypyc"],
    )
    missing = [source for source in COMPILED if not built(source).exists()]
    if missing:
        print(f"error: mypyc built no extension for {', '.join(missing)}", file=sys.stderr)
        return 1
    # A module's own extension only imports the group's library: unchanged, build_ext copies
    # the one it built before with that build's time, which would read as older than an edit.
    for source in COMPILED:
        built(source).touch()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--clean", action="store_true")
    action.add_argument("--list", action="store_true")
    action.add_argument("--check", action="store_true")
    opts = parser.parse_args(argv)
    if opts.clean:
        clean()
        return 0
    if opts.list:
        print("\n".join(COMPILED))
        return 0
    if opts.check:
        old = stale()
        if old:
            print(
                f"error: compiled modules older than their sources ({', '.join(old)}): "
                "run make compiled (or python scripts/compile.py --clean)",
                file=sys.stderr,
            )
        return 1 if old else 0
    return build()


if __name__ == "__main__":
    raise SystemExit(main())
