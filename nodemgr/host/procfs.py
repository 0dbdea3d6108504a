"""What nodemgr reads of a process in /proc (proc(5)), in nodemgr's pid namespace."""

from __future__ import annotations

import os
from collections.abc import Iterable


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/``pid``/stat after the command name, from the state on (field 3
    of proc(5) is index 0), or None if the process is gone or the file cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; fields resume after the last ')'.
    return stat[stat.rfind(b")") + 2 :].split()


def stat_ints(pid: int, *indices: int) -> tuple[int, ...] | None:
    """The fields at ``indices`` of :func:`stat_fields` as integers, or None."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        return tuple(int(fields[i]) for i in indices)
    except (IndexError, ValueError):
        return None


def state(pid: int) -> str | None:
    """Process ``pid``'s state letter (R, S, T, Z, ...), or None once it is gone."""
    fields = stat_fields(pid)
    return fields[0].decode() if fields else None


def own_pid(pid: int) -> int:
    """The pid process ``pid`` (of nodemgr's namespace) has in its own namespace: the last
    NSpid entry of /proc/PID/status; ``pid`` itself when that cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    fields = line.split()
                    return int(fields[-1]) if len(fields) > 1 else pid
    except (OSError, ValueError):
        pass
    return pid


def maps(pid: int | str) -> bytes | None:
    """/proc/``pid``/maps (``"self"``: nodemgr's own), or None if it cannot be read (the
    process is gone, or nodemgr may not read it)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return f.read()
    except OSError:
        return None


def _range_file(line: bytes) -> tuple[int, int, tuple[int, int]] | None:
    """(start, end, (device, inode)) of one maps line; None for a line that maps no file
    or cannot be read."""
    # address perms offset dev inode [path]; address is "start-end", dev "major:minor",
    # all in hex.
    fields = line.split(maxsplit=5)
    try:
        start, end = fields[0].split(b"-")
        major, minor = fields[3].split(b":")
        ino = int(fields[4])
        if not ino:
            return None
        return int(start, 16), int(end, 16), (os.makedev(int(major, 16), int(minor, 16)), ino)
    except (IndexError, ValueError):
        return None


def mapping_at(maps: bytes, address: int) -> tuple[int, int] | None:
    """The (device, inode) ``maps`` (a /proc/PID/maps text) shows for the file mapped at
    ``address``; None where no file is mapped there."""
    for line in maps.splitlines():
        got = _range_file(line)
        if got is not None and got[0] <= address < got[1]:
            return got[2]
    return None


def maps_files(pid: int, files: Iterable[tuple[int, int]]) -> frozenset[tuple[int, int]] | None:
    """Which of ``files`` (device, inode, as Ledger.file_id gives them) process ``pid``
    maps, from /proc/``pid``/maps; None if it cannot be read (the process is gone, or
    nodemgr may not read it). Only the lines holding one of their inode numbers are
    parsed: a process may map thousands of files, and the audit asks at every run."""
    text = maps(pid)
    if text is None:
        return None
    out = set()
    for dev, ino in set(files):
        token = b" %d " % ino
        at = text.find(token)
        while at >= 0:
            start = text.rfind(b"\n", 0, at) + 1
            end = text.find(b"\n", at)
            got = _range_file(text[start : end if end >= 0 else len(text)])
            if got is not None and got[2] == (dev, ino):
                out.add((dev, ino))
                break
            at = text.find(token, at + 1)
    return frozenset(out)


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot, or None if it is gone."""
    got = stat_ints(pid, 19)
    return None if got is None else got[0]
