"""The atheris target fuzz/frame_decoder.py, run for a bounded time as CI runs it: from its seed
corpus, it must run many inputs and find nothing (exit status 0, no crash file)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.budget import seconds

TARGET = Path(__file__).resolve().parents[2] / "fuzz" / "frame_decoder.py"
# From the seeds, the target reaches all the coverage it gets within its first few thousand
# inputs (about 2 s); longer runs, more mutated inputs, are the soak's (tests/budget.py).
FUZZ_SECONDS = max(1, round(seconds(5)))


def test_the_frame_decoder_target_finds_nothing_in_a_bounded_run(tmp_path: Path) -> None:
    """FUZZ_SECONDS of fuzzing from the seeds: no crash, and enough inputs to mean it."""
    corpus = tmp_path / "corpus"
    seeded = subprocess.run(
        [sys.executable, str(TARGET), "--write-seeds", str(corpus)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert len(list(corpus.iterdir())) >= 20
    run = subprocess.run(
        [
            sys.executable,
            str(TARGET),
            f"-max_total_time={FUZZ_SECONDS}",
            f"-artifact_prefix={tmp_path}/",
            "-print_final_stats=1",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS + 120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
    done = re.search(r"Done (\d+) runs", run.stderr)
    assert done is not None, run.stderr[-3000:]
    assert int(done.group(1)) > 1000, "the fuzzer hardly ran"
