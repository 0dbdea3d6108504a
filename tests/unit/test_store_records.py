"""Records nodemgr writes through nodemgr.node.store: one that the database cannot take is
dropped, logged, and holds back none written after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.messages import Request
from nodemgr.node.store import Record, Store


def test_a_record_the_database_cannot_take_holds_back_no_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path / "nodemgr.db")
    try:
        for tid in ("a", "b"):
            record = Record(tid, "e", (0,), 1, None, None, None, 1.0, None, None, 0, None)
            store.task_started(record, Request(gpus=1))
        # A peak no sqlite INTEGER holds (OverflowError, not a database error).
        store.task_ended("a", 2.0, "done", 1 << 63, None)
        store.task_ended("b", 3.0, "done", 5, None)
        assert not store.pending
        records = {r.task_id: r for r in store.history(None, None, 10)}
        assert (records["b"].ended, records["b"].peak) == (3.0, 5)
        assert "a record nodemgr cannot write is dropped" in caplog.text
    finally:
        store.close()
