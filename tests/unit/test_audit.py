"""The bypass audit's comparison (nodemgr.host.audit.compare) and its record of findings."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nodemgr.host import procfs
from nodemgr.host.audit import (
    BEYOND_SLOT,
    NO_SLOT,
    NOT_ITS_SLOT,
    UNSEEN,
    Auditor,
    AuditState,
    Finding,
    Seen,
    Slot,
    compare,
    unconfirmed,
)
from nodemgr.host.backend import NvmlBackend
from nodemgr.host.ledger import Ledger

MiB = 1 << 20


def slot(pid: int, *used: int, env: str = "a", task: str = "t1") -> Slot:
    return Slot(env, task, pid, tuple(used))


def test_a_process_its_slot_accounts_for_is_no_finding() -> None:
    seen = [Seen(0, 100, 100, 300 * MiB), Seen(1, 100, 100, 10 * MiB)]
    assert compare(seen, [slot(100, 300 * MiB, 10 * MiB)], {}, 0) == []


def test_within_the_tolerance_is_no_finding_beyond_it_is() -> None:
    s = [slot(100, 256 * MiB)]
    assert compare([Seen(0, 100, 100, 256 * MiB + 64 * MiB)], s, {}, 64 * MiB) == []
    (f,) = compare([Seen(0, 100, 100, 256 * MiB + 64 * MiB + 1)], s, {}, 64 * MiB)
    assert (f.pid, f.gpu, f.accounted, f.reason) == (100, 0, 256 * MiB, BEYOND_SLOT)
    assert (f.env, f.task_id) == ("a", "t1")


def test_a_process_without_a_slot_is_named_by_its_owner_if_known() -> None:
    seen = [Seen(1, 7, 7, 512 * MiB), Seen(0, 8, 8, 512 * MiB)]
    found = compare(seen, [slot(100, 1)], {7: ("b", "t2")}, 0)
    assert [(f.gpu, f.pid, f.reason, f.env, f.task_id) for f in found] == [
        (0, 8, NO_SLOT, None, None),
        (1, 7, NO_SLOT, "b", "t2"),
    ]
    assert all(f.accounted == 0 for f in found)


def test_a_slot_emptied_by_its_process_is_beyond_its_slot() -> None:
    (f,) = compare([Seen(0, 100, 100, 256 * MiB)], [slot(100, 0)], {}, 0)
    assert (f.reason, f.seen, f.accounted) == (BEYOND_SLOT, 256 * MiB, 0)


def test_the_slot_is_matched_by_the_processs_own_pid_not_nvmls() -> None:
    """NVML names a containerised process by its host pid, its slot by the pid it has in
    its container: the audit compares the latter (Seen.own_pid, read from NSpid)."""
    seen = [Seen(0, 4242, 12, 100 * MiB)]
    assert compare(seen, [slot(12, 100 * MiB)], {}, 0) == []
    (f,) = compare(seen, [slot(4242, 100 * MiB)], {}, 0)
    assert f.pid == 4242 and f.reason == NO_SLOT


def test_slots_of_one_pid_count_together_per_gpu() -> None:
    slots = [slot(5, 100 * MiB, 0), slot(5, 50 * MiB, 70 * MiB, env="b", task="t9")]
    assert compare([Seen(0, 5, 5, 150 * MiB), Seen(1, 5, 5, 70 * MiB)], slots, {}, 0) == []
    (f,) = compare([Seen(1, 5, 5, 71 * MiB)], slots, {}, 0)
    assert f.accounted == 70 * MiB


def test_findings_are_new_once_and_counted_once() -> None:
    state = AuditState()
    a = Finding(0, 1, 10, 0, NO_SLOT, None, None)
    b = Finding(1, 1, 10, 0, NO_SLOT, None, None)
    assert state.update([a]) == [a]
    assert state.update([a, b]) == [b]
    assert state.update([a, b]) == []
    assert state.found == 2 and state.audits == 3
    assert state.per_gpu(3) == [1, 1, 0]
    assert state.update([]) == [] and state.per_gpu(2) == [0, 0]
    # Gone and back: a new finding again (a pid reused, or the process bypassing anew).
    assert state.update([a]) == [a]
    assert state.found == 3


def test_a_slot_naming_a_process_that_maps_none_of_its_ledgers_is_not_its_own() -> None:
    ledger = (1, 2)
    covered = [Slot("a", "t1", 100, (128 * MiB,), ledger)]
    seen = [Seen(0, 4100, 100, 128 * MiB)]
    # The figures agree; only what the process maps tells the slot is not its own.
    assert compare(seen, covered, {}, 0) == []
    assert compare(seen, covered, {}, 0, {4100: frozenset({ledger, (1, 3)})}) == []
    (f,) = compare(seen, covered, {}, 0, {4100: frozenset({(1, 3)})})
    assert (f.pid, f.reason, f.seen, f.accounted) == (4100, NOT_ITS_SLOT, 128 * MiB, 128 * MiB)
    assert f.env == "a"


def test_a_ledger_is_known_by_the_device_maps_shows_not_by_fstats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On btrfs (a subvolume's st_dev) and overlayfs /proc/PID/maps shows a file under
    another device than fstat's: a process that maps its own ledger is not flagged there."""
    ledger = Ledger.create(tmp_path / "ledger", [bytes(16)])
    st = os.stat(tmp_path / "ledger")
    other = "fe:2a"  # the device maps shows
    assert os.makedev(0xFE, 0x2A) != st.st_dev
    lines = []
    for line in (procfs.maps("self") or b"").decode().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) > 4 and int(fields[4]) == st.st_ino:
            fields[3] = other
            line = " ".join(fields)
        lines.append(line)
    assert any(other in line for line in lines)  # nodemgr maps it
    shown = "\n".join(lines).encode() + b"\n"
    monkeypatch.setattr(procfs, "maps", lambda pid: shown)  # and so does the process
    try:
        mine = [Slot("a", "t1", 100, (128 * MiB,), ledger.file_id())]
        mapped = procfs.maps_files(4100, [ledger.file_id()])
        assert mapped is not None
        assert compare([Seen(0, 4100, 100, 128 * MiB)], mine, {}, 0, {4100: mapped}) == []
        assert ledger.file_id() == (os.makedev(0xFE, 0x2A), st.st_ino)
    finally:
        ledger.close()


def test_a_slot_claiming_more_than_nvml_sees_in_both_reads_is_unconfirmed() -> None:
    fake = [slot(100, 12 << 30), slot(101, 0, 300 * MiB, task="t2")]
    seen = [Seen(1, 4101, 101, 300 * MiB)]
    (f,) = unconfirmed(seen, fake, 64 * MiB, fake)
    assert (f.gpu, f.pid, f.seen, f.accounted, f.reason) == (0, 100, 0, 12 << 30, UNSEEN)
    # A charge made between the two reads (the driver's allocation may not be made yet).
    assert unconfirmed(seen, fake, 64 * MiB, [slot(101, 0, 300 * MiB, task="t2")]) == []
    # NVML's pid names the process where NVML lists it.
    (g,) = unconfirmed(seen, [slot(101, 0, 1 << 30)], 64 * MiB, [slot(101, 0, 1 << 30)])
    assert (g.pid, g.seen, g.accounted) == (4101, 300 * MiB, 1 << 30)


def test_maps_files_finds_a_mapped_ledger_by_its_lines_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger.create(tmp_path / "ledger", [bytes(16)])
    try:
        fid = ledger.file_id()
        other = (fid[0], fid[1] + 1)
        assert procfs.maps_files(os.getpid(), [fid, other]) == frozenset({fid})
        # The inode's number elsewhere on a line (a path, another device's file) is not it.
        dev = f"{os.major(fid[0]):02x}:{os.minor(fid[0]):02x}"
        fake = (
            f"7f0000000000-7f0000001000 r--p 00000000 {dev} 7 /x/ {dev} {fid[1]} y\n"
            f"7f0000001000-7f0000002000 rw-s 00000000 fe:2a {fid[1]}    /y\n"
        ).encode()
        monkeypatch.setattr(procfs, "maps", lambda pid: fake)
        assert procfs.maps_files(4100, [fid]) == frozenset()
        monkeypatch.setattr(procfs, "maps", lambda pid: None)
        assert procfs.maps_files(4100, [fid]) is None
    finally:
        ledger.close()


def test_a_process_found_mapping_its_ledger_is_remembered_by_pid_and_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit reads a process's maps until it finds a ledger there, not at every run."""
    ledger = Ledger.create(tmp_path / "ledger", [bytes(16)])
    try:
        node: Any = SimpleNamespace(config=SimpleNamespace(audit_interval=5.0))
        auditor = Auditor(node, NvmlBackend([]), AuditState())
        me = os.getpid()
        seen = [Seen(0, me, me, MiB), Seen(1, me, me, MiB)]
        slots = [Slot("a", "t1", me, (MiB, MiB), ledger.file_id())]
        reads: list[int] = []
        real = procfs.maps_files

        def counted(pid: int, files: Any) -> Any:
            reads.append(pid)
            return real(pid, files)

        monkeypatch.setattr(procfs, "maps_files", counted)
        assert auditor._mapped(seen, slots) == {me: {ledger.file_id()}}
        assert reads == [me]  # once for its two GPUs
        assert auditor._mapped(seen, slots) == {me: {ledger.file_id()}}
        assert reads == [me]  # remembered
        # A slot naming another ledger is looked for in its maps.
        elsewhere = (ledger.file_id()[0], ledger.file_id()[1] + 1)
        assert auditor._mapped(seen, [replace(slots[0], ledger=elsewhere)]) == {me: frozenset()}
        assert reads == [me, me]
        # A process NVML no longer lists is forgotten.
        assert auditor._mapped([], slots) == {}
        assert auditor._mapped(seen, slots) == {me: {ledger.file_id()}}
        assert reads == [me, me, me]
    finally:
        ledger.close()
