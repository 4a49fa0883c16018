"""Progress bars, printing and logging on the main rank only."""

from __future__ import annotations

import contextlib
import io
import logging

import pardist


def _outputs():
    bar, every_bar, out, logged = io.StringIO(), io.StringIO(), io.StringIO(), io.StringIO()
    items = list(pardist.progress(range(5), desc="eval", file=bar))
    list(pardist.progress(range(2), file=every_bar, main_only=False))
    with contextlib.redirect_stdout(out):
        pardist.print0("hello from", pardist.rank())
    log = pardist.get_logger("test_progress")
    handler = logging.StreamHandler(logged)
    log.logger.addHandler(handler)
    log.logger.setLevel(logging.INFO)
    log.logger.propagate = False
    try:
        log.info("epoch %d", 1)
        log.debug("not shown: below the level")
        log.warning("slow batch", main_only=False)
    finally:
        log.logger.removeHandler(handler)
    return items, bar.getvalue(), every_bar.getvalue(), out.getvalue(), logged.getvalue()


def test_main_rank_only(run):
    (items0, bar0, every0, out0, log0), (items1, bar1, every1, out1, log1) = run(2, _outputs)
    assert items0 == items1 == [0, 1, 2, 3, 4]  # every rank iterates
    assert "eval" in bar0 and "5/5" in bar0 and bar1 == ""
    assert "2/2" in every0 and "2/2" in every1
    assert out0 == "hello from 0\n" and out1 == ""
    assert log0 == "epoch 1\n[rank 0] slow batch\n"
    assert log1 == "[rank 1] slow batch\n"


def test_before_init_counts_as_main():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pardist.print0("x")
    assert out.getvalue() == "x\n"
    assert not pardist.progress(range(3), file=io.StringIO()).disable
    assert pardist.progress(range(3), disable=True).disable


class _Counting:
    passes = 0

    def __len__(self):
        return 2

    def __iter__(self):
        _Counting.passes += 1
        return iter("ab")


def test_progress_iterates_once():
    # A second iter() would start a DataLoader's workers again, or take a loader's epoch.
    assert list(pardist.progress(_Counting(), file=io.StringIO())) == ["a", "b"]
    assert _Counting.passes == 1
