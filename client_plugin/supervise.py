"""How gpushare-run runs its command: in a process group of its own, signals passed on,
job control, heartbeats, and a grace period before the group is killed.

``gpushare-run`` runs its command under a grant (client_plugin.run) or as a dry run on a
private simulated node (client_plugin.predict); both start and supervise it here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping

from client_plugin.grant import Heartbeat, reclaimed_exit
from gpushare.exitcodes import EXIT_INTERNAL

_PR_SET_PDEATHSIG = 1
# Passed on to the command. Held blocked while the command runs and taken with
# sigtimedwait, so one thread sees them in order and no handler races the loop.
# One gpushare-run was started with ignored (nohup) stays ignored, for both.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _forwarded() -> set[int]:
    return {s for s in FORWARDED if signal.getsignal(s) != signal.SIG_IGN}


def _loop_signals() -> set[int]:
    return {*_forwarded(), signal.SIGCHLD, signal.SIGTTOU}


def say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"gpushare-run: {message}", file=sys.stderr, flush=True)


def exit_code(returncode: int) -> int:
    """A shell's view of a child's status: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class Terminal:
    """The controlling terminal, when gpushare-run runs in its foreground.

    The command runs in a process group of its own (so that its whole tree can
    be killed), which the terminal must then treat as the foreground job:
    Ctrl-C and Ctrl-Z reach the command, and it may read the terminal."""

    def __init__(self) -> None:
        self.fd = -1
        try:
            self.fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            return  # no controlling terminal

    def holds(self, pgid: int) -> bool:
        """Is process group ``pgid`` the terminal's foreground job?"""
        if self.fd < 0:
            return False
        try:
            return os.tcgetpgrp(self.fd) == pgid
        except OSError:
            return False

    def foreground(self) -> bool:
        """Is gpushare-run's process group the terminal's foreground job?"""
        return self.holds(os.getpgrp())

    def give(self, pgid: int) -> None:
        # SIGTTOU is blocked, so a background caller may hand the terminal over.
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(self.fd, pgid)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def die_with(parent: int, signum: int) -> None:
    """In a child before exec: ``signum`` when gpushare-run (pid ``parent``) dies; a child
    whose parent died before the request took effect ends at once."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(EXIT_INTERNAL)


def _prepare_child(parent: int, mask: Iterable[int], tty_fd: int) -> None:
    """In the child before exec: a process group of its own (the terminal's foreground
    when gpushare-run had it), death with gpushare-run, and the parent's signal mask."""
    os.setpgid(0, 0)
    if tty_fd >= 0:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(tty_fd, os.getpid())
    die_with(parent, signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def spawn(
    cmd: list[str], env: Mapping[str, str], term: Terminal, stdout: int | None = None
) -> subprocess.Popen[bytes]:
    """Start CMD in a process group of its own; ``stdout``: a descriptor for its standard
    output instead of gpushare-run's."""
    parent = os.getpid()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _loop_signals())
    # The terminal goes to the command only when gpushare-run is a job of its own (an
    # interactive shell's); in a script's group, Ctrl-C must still reach the script.
    tty_fd = term.fd if term.foreground() and os.getpgrp() == os.getpid() else -1
    try:
        # Default dispositions for the command: gpushare-run's are its own.
        child = subprocess.Popen(
            cmd,
            env=dict(env),
            stdout=stdout,
            preexec_fn=lambda: _prepare_child(parent, mask, tty_fd),
        )
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    # Both sides set the group, so neither the loop nor a signal sees it unset.
    with contextlib.suppress(OSError):
        os.setpgid(child.pid, child.pid)
    if tty_fd >= 0:
        term.give(child.pid)
    return child


class Supervisor:
    """Runs the command to its end: signals passed on, grace, heartbeats, job control."""

    def __init__(
        self,
        child: subprocess.Popen[bytes],
        term: Terminal,
        grace: float,
        hb: Heartbeat | None,
        watch: Callable[[], bool] | None = None,
        watch_interval: float = 0.05,
    ) -> None:
        """``watch``: called about every ``watch_interval`` seconds while the command runs;
        once it returns True the command's process group is asked to end (SIGTERM) and
        killed after the grace period, as for a passed-on signal."""
        self.child = child
        self.pgid = child.pid
        self.term = term
        self.grace = grace
        self.hb = hb
        self.kill_at: float | None = None
        self.next_beat = time.monotonic() + (hb.interval if hb else 0.0)
        self.had_terminal = self.term.holds(self.pgid)
        self.signals = _loop_signals()
        self.forwarded = _forwarded()
        # nodemgr reclaimed the task: the exit code of its reason (the command is killed),
        # and the reason.
        self.reclaimed: int | None = None
        self.reason: str | None = None
        self.watch = watch
        self.watch_interval = watch_interval
        self.next_watch = time.monotonic() + watch_interval
        self.ended = False  # watch() asked the command to end

    def _killpg(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def _timeout(self) -> float:
        now = time.monotonic()
        ends = [self.next_beat] if self.hb else []
        if self.watch is not None and not self.ended:
            ends.append(self.next_watch)
        if self.kill_at is not None:
            ends.append(self.kill_at)
        return max(0.0, min(ends) - now) if ends else 3600.0

    def _stopped(self) -> None:
        """The command stopped (Ctrl-Z, SIGTTIN): stop too, so the shell sees the job
        stopped, and carry the command on when the shell continues gpushare-run."""
        if self.term.holds(self.pgid):
            self.term.give(os.getpgrp())
        os.kill(os.getpid(), signal.SIGSTOP)
        # Continued: by `fg` (the terminal is ours again: pass it on) or by `bg`.
        if self.term.foreground():
            self.term.give(self.pgid)
        self._killpg(signal.SIGCONT)

    def _reap(self) -> int | None:
        """The command's returncode once it has ended, else None."""
        while True:
            try:
                pid, status = os.waitpid(self.child.pid, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                return self.child.returncode if self.child.returncode is not None else -9
            if pid == 0:
                return None
            if os.WIFSTOPPED(status):
                if self.had_terminal:
                    self._stopped()
                # Without a terminal no shell does job control: whoever stopped the
                # command continues it, and gpushare-run keeps the task alive meanwhile.
                continue
            self.child.returncode = os.waitstatus_to_exitcode(status)
            return self.child.returncode

    def run(self) -> int:
        while True:
            info = signal.sigtimedwait(self.signals, self._timeout())
            if info is not None and info.si_signo in self.forwarded:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.child.pid, info.si_signo)
                if self.kill_at is None:
                    self.kill_at = time.monotonic() + self.grace
            returncode = self._reap()
            if returncode is not None:
                break
            now = time.monotonic()
            if self.watch is not None and not self.ended and now >= self.next_watch:
                if self.watch():
                    self.ended = True
                    self._killpg(signal.SIGTERM)
                    if self.kill_at is None:
                        self.kill_at = now + self.grace
                self.next_watch = time.monotonic() + self.watch_interval
            if self.kill_at is not None and now >= self.kill_at:
                say(f"the command outlived the {self.grace:g}s grace period: killing it")
                self._killpg(signal.SIGKILL)
                self.kill_at = now + 3600.0
            if self.hb is not None and now >= self.next_beat:
                self.hb.beat()
                self.next_beat = time.monotonic() + self.hb.interval
                if self.hb.reclaimed is not None and self.reclaimed is None:
                    # Its GPUs are gone: the command cannot go on, and is ended at once.
                    line, self.reclaimed = reclaimed_exit(self.hb.reclaimed)
                    self.reason = self.hb.reclaimed.reason
                    say(line)
                    self._killpg(signal.SIGKILL)
        if returncode == -signal.SIGKILL and self.hb is not None and self.reclaimed is None:
            # nodemgr kills the command of a task it reclaimed while gpushare-run was
            # silent (stopped, or starved): a heartbeat says so.
            self.hb.ask_reclaimed()
            if self.hb.reclaimed is not None:
                line, self.reclaimed = reclaimed_exit(self.hb.reclaimed)
                self.reason = self.hb.reclaimed.reason
                say(line)
        if self.had_terminal and self.term.holds(self.pgid):
            self.term.give(os.getpgrp())
        return returncode
