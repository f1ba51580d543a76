"""The wheel's extension modules: the hot modules (pyproject's [tool.indexer.mypyc]) compiled
with mypyc where a C compiler is there, and the same modules as pure Python where none is.

Everything else about the distribution is in pyproject.toml. `INDEXER_MYPYC=0` builds pure Python
on purpose: the Makefile's editable install does, and compiles in place with scripts/compile.py,
again whenever a hot module changes.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent


def hot_modules() -> tuple[list[str], str]:
    """The sources mypyc compiles, and the name of their shared library."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["indexer"]["mypyc"]
    return list(table["modules"]), str(table["group"])


def compiler() -> str | None:
    name = os.environ.get("CC", "cc").split()[0]
    return shutil.which(name) or shutil.which("gcc")


def hot_extensions() -> list[Any]:
    """mypyc's extensions of the hot modules (from ROOT: mypyc writes its C under build/)."""
    from mypyc.build import mypycify

    modules, group = hot_modules()
    # The build environment may lack the runtime dependencies (pip's isolated build has only
    # setuptools and mypy): their types are then Any, which the code's strict typing must allow.
    return list(
        mypycify(
            ["--ignore-missing-imports", "--no-warn-return-any", *modules],
            opt_level="3",
            group_name=group,
        )
    )


def compiling() -> bool:
    """Whether this build compiles the hot modules; where not, says why on stderr."""
    if os.environ.get("INDEXER_MYPYC", "1") == "0":
        return False
    if compiler() is None:
        print(
            "indexer: no C compiler (cc): the hot modules go into the wheel as pure Python",
            file=sys.stderr,
        )
        return False
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        print("indexer: mypyc is not installed: the hot modules stay pure Python", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    from setuptools import Distribution, setup
    from setuptools.command.build_ext import build_ext

    COMPILING = compiling()

    class HotModulesDistribution(Distribution):
        def has_ext_modules(self) -> bool:
            return COMPILING  # a platform wheel, and build_ext runs

    # Commands that only describe the distribution: pip's metadata step (dist_info) finalizes
    # build_ext too, to list the extensions' sources, and mypyc's type check there would be
    # paid twice.
    DESCRIBING = {"dist_info", "egg_info", "sdist"}

    class BuildHotModules(build_ext):
        """Asks mypyc for the extensions only when they are built."""

        def finalize_options(self) -> None:
            describing = set(self.distribution.commands) <= DESCRIBING
            if not self.distribution.ext_modules and not describing:
                os.chdir(ROOT)  # mypyc writes its C under build/
                self.distribution.ext_modules = hot_extensions()
            super().finalize_options()

    setup(distclass=HotModulesDistribution, cmdclass={"build_ext": BuildHotModules})
