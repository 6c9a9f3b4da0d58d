"""A pytest plugin (loaded by conftest.py): a test whose xdist worker died under it (a
signal, not a failure) runs once more on a fresh worker, and the run says so at the end.

Why: under Python 3.12 with jax 0.12, two full runs each lost one worker to a fatal signal
inside XLA's CPU compiler or the persistent compilation cache's serialisation (a
different test each time, after 30+ minutes in a long-lived worker; neither test crashed
alone or with its file). A second crash of the same test fails it, as before; a failure
that is not a crash is never rerun.
"""

import pytest

_RERUN: list[str] = []  # the crashed tests given their second run, in order


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without -n there is nothing to rerun
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem in _RERUN:
        return  # crashed on its second run too: the failure report stands
    _RERUN.append(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _RERUN:
        terminalreporter.section("tests rerun after their worker crashed", sep="-", yellow=True)
        for nodeid in _RERUN:
            terminalreporter.line(f"RERUN {nodeid} (its first worker died under it; see the crash above)")
