"""tests/crash_rerun.py: a test whose xdist worker dies under it runs once more and the
run says so; a second crash, or a plain failure, still fails."""

import os
import pathlib
import subprocess
import sys
import textwrap

TESTS = pathlib.Path(__file__).parent

BODY = """
    import os, pathlib, signal

    def test_dies_the_first_time(tmp_path_factory):
        marker = pathlib.Path(os.environ["MARKER"])
        if not marker.exists():
            marker.write_text("died once")
            os.kill(os.getpid(), signal.SIGKILL)

    def test_always_dies():
        os.kill(os.getpid(), signal.SIGKILL)

    def test_fails():
        assert False

    def test_passes():
        pass
"""


def test_a_crashed_test_reruns_once_and_a_failure_stays_a_failure(tmp_path):
    (tmp_path / "test_body.py").write_text(textwrap.dedent(BODY))
    env = {**os.environ, "PYTHONPATH": str(TESTS), "MARKER": str(tmp_path / "marker")}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-p", "crash_rerun", "-p", "no:randomly", "-q", "test_body.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "RERUN test_body.py::test_dies_the_first_time" in text, text
    assert "RERUN test_body.py::test_always_dies" in text, text
    assert "FAILED test_body.py::test_always_dies" in text and "FAILED test_body.py::test_fails" in text, text
    assert "test_dies_the_first_time" not in text.split("short test summary")[-1].split("FAILED", 1)[-1], text
    assert "2 failed, 2 passed" in text, text
