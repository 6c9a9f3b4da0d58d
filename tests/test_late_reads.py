"""A damaged checkpoint's restore fails while other reads are in flight; each then ends
into orbax's closed asyncio loop and Python prints a "RuntimeError: Event loop is closed"
traceback for it from tensorstore's threads, with no Python hook called (up to 116 in one
restore, cut and interleaved). `checkpoint._late_reads_unprinted` holds stderr through
the restore and passes on everything else (issue 37 item 14: no raw tracebacks)."""

from __future__ import annotations

import os
import threading

from jxformers.train import checkpoint

REPORT = (
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 806, in call_soon_threadsafe\n'
    "    self._check_closed()\n"
    '  File "/usr/lib/python3.11/asyncio/base_events.py", line 519, in _check_closed\n'
    "    raise RuntimeError('Event loop is closed')\n"
    "RuntimeError: Event loop is closed\n"
)


def test_the_late_reads_reports_are_dropped_and_every_other_line_passes(capfd):
    def write(text):  # as C code writes: to the descriptor, past sys.stderr
        os.write(2, text.encode())

    with checkpoint._late_reads_unprinted():
        write("orbax: a warning of its own\n")
        threads = [threading.Thread(target=write, args=(REPORT,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # lines of two reports printed into each other, as seen (each print writes its parts apart)
        write(
            "        self._check_closed()self._check_closed()\n"
            "RuntimeErrorraise RuntimeError('Event loop is closed')\n"
            "RuntimeError: : Event loop is closedEvent loop is closed\n"
            '    self._check_closed()  File "/x/asyncio/base_events.py", line 519, in _check_closed\n'
            "Traceback (most recent call last):Traceback (most recent call last):\n"
        )
        write("ValueError: DATA_LOSS in another file\n")
    err = capfd.readouterr().err
    assert err == "orbax: a warning of its own\nValueError: DATA_LOSS in another file\n", err


def test_other_tracebacks_pass_through_whole(capfd):
    other = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nKeyError: 3\n'
    with checkpoint._late_reads_unprinted():
        os.write(2, other.encode())
    assert capfd.readouterr().err == other
