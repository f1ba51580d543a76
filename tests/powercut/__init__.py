"""The power-loss layer: a process runs with `powercut.c` preloaded, which journals what it
makes durable under one directory; after the test kills it (SIGKILL), `PowerLoss.cut` undoes
everything else, as a power cut would: file data past each file's last fsync, and the creates,
renames and unlinks that no later fsync committed (ext4's ordered journal: any fsync commits
the metadata before it). Kept apart from the page cache of a SIGKILL alone, which loses
nothing.

Assumptions, true of LevelDB and of the project's own files: files are written by appending
(an overwrite inside the synced part is not undone), and directories are not created or removed
while the process runs (their creation counts as durable).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).with_name("powercut.c")
KEPT_JOURNALS = 5


class PowerCutError(RuntimeError):
    """The layer cannot be built or used; one line."""


def build_library(out_dir: Path) -> Path:
    """Compile the recorder (a C compiler is needed, as for the rest of `make test`)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise PowerCutError("the power-loss tests need a C compiler (cc or gcc) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / "libpowercut.so"
    done = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Wno-format-truncation",
         "-o", str(library), str(SOURCE), "-ldl"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise PowerCutError(f"cannot compile {SOURCE.name}: {done.stderr.strip()[-500:]}")
    return library


@dataclass
class CutReport:
    """What a cut took away."""

    bytes_lost: int = 0  # file data past the last fsync
    files_truncated: list[str] = field(default_factory=list)
    creates_undone: list[str] = field(default_factory=list)
    renames_undone: list[str] = field(default_factory=list)
    unlinks_undone: list[str] = field(default_factory=list)


class PowerLoss:
    """The layer for one directory (`root`); its journal and kept files in `work`, a directory
    on the same filesystem outside `root`."""

    def __init__(self, library: Path, root: Path, work: Path) -> None:
        self.library = library
        self.root = root.resolve()
        self.work = work.resolve()
        self.journal = self.work / "journal"
        self.grave = self.work / "grave"
        self._baseline: dict[int, int] = {}
        self.arm()

    def env(
        self, base: dict[str, str] | None = None, slow_sync: tuple[str, int] | None = None
    ) -> dict[str, str]:
        """The environment of a process under the layer. `slow_sync` (a file-name suffix and
        milliseconds) makes each sync of such a file that much slower, as a slow disk."""
        env = dict(os.environ if base is None else base)
        env.update(
            LD_PRELOAD=str(self.library),
            POWERCUT_DIR=str(self.root),
            POWERCUT_JOURNAL=str(self.journal),
            POWERCUT_GRAVE=str(self.grave),
        )
        if slow_sync is not None:
            env["POWERCUT_SLOW_SYNC"] = f"{slow_sync[0]}:{slow_sync[1]}"
        return env

    def arm(self) -> None:
        """Start a new journal: what is on disk now counts as durable. The last journals are
        kept beside it (journal.1 the one before, ...) for a failure's post-mortem."""
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.grave, ignore_errors=True)
        self.grave.mkdir(parents=True)
        if self.journal.exists():
            for n in range(KEPT_JOURNALS - 1, 0, -1):
                older = self.journal.with_name(f"journal.{n}")
                if older.exists():
                    older.replace(self.journal.with_name(f"journal.{n + 1}"))
            self.journal.replace(self.journal.with_name("journal.1"))
        self.journal.write_bytes(b"")
        self._baseline = {st.st_ino: st.st_size for st in self._files().values()}

    def _files(self) -> dict[Path, os.stat_result]:
        out = {}
        for folder, _, names in os.walk(self.root):
            for name in names:
                path = Path(folder) / name
                st = path.lstat()
                if path.is_file() and not path.is_symlink():
                    out[path] = st
        return out

    def cut(self, drop: bool = True) -> CutReport:
        """The power goes (the process must be dead): undo what was not durable, then arm
        again. With `drop=False` (pass-through) nothing is undone; the report still says what
        a cut would have taken."""
        events = [line.split("\t") for line in self.journal.read_text().splitlines() if line]
        committed = max((i for i, e in enumerate(events) if e[0] == "sync"), default=-1)
        synced: dict[int, int] = {}
        for kind, *rest in events:
            if kind == "sync" and rest[1] != "-1":
                synced[int(rest[0])] = int(rest[1])
        # A file the layer never saw made is one a process wrote outside it (started without
        # `env()`): its syncs are unknown, so a cut would take what was durable. Refused. An
        # empty one is the kill landing between the real open and its journal line (nothing
        # can write to it before the open returns): no fsync is known to follow its create,
        # so the cut undoes it.
        made = {int(rest[0]) for kind, *rest in events if kind == "create"}
        unknown = {
            path: st
            for path, st in self._files().items()
            if st.st_ino not in made and st.st_ino not in self._baseline
        }
        stray = sorted(str(path) for path, st in unknown.items() if st.st_size > 0)
        if stray:
            raise PowerCutError(
                f"files written outside the power-loss layer (a process without its env()): "
                f"{', '.join(stray[:5])}"
            )
        report = CutReport()
        for path in unknown:
            report.creates_undone.append(str(path))
            if drop:
                path.unlink()
        for kind, *rest in reversed(events[committed + 1 :]):
            if kind == "create":
                path = Path(rest[1])
                if _is_inode(path, int(rest[0])):
                    report.creates_undone.append(str(path))
                    if drop:
                        path.unlink()
            elif kind == "rename":
                ino, old, new, replaced = int(rest[0]), Path(rest[1]), Path(rest[2]), int(rest[3])
                if _is_inode(new, ino) and not old.exists():
                    report.renames_undone.append(f"{old} -> {new}")
                    if drop:
                        new.rename(old)
                        if replaced:
                            os.link(self.grave / str(replaced), new)
            elif kind == "unlink":
                path = Path(rest[1])
                kept = self.grave / rest[0]
                if not path.exists() and kept.exists():
                    report.unlinks_undone.append(str(path))
                    if drop:
                        os.link(kept, path)
        for path, st in self._files().items():
            durable = synced.get(st.st_ino, self._baseline.get(st.st_ino, 0))
            if st.st_size > durable:
                report.bytes_lost += st.st_size - durable
                report.files_truncated.append(str(path))
                if drop:
                    os.truncate(path, durable)
        with open(self.work / "cuts", "a") as cuts:  # what each cut took, for a post-mortem
            cuts.write(f"{report}\n")
        self.arm()
        return report


def _is_inode(path: Path, ino: int) -> bool:
    try:
        return path.lstat().st_ino == ino
    except FileNotFoundError:
        return False
