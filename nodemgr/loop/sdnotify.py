"""systemd's readiness protocol (sd_notify(3)): with ``Type=notify`` the unit is started
once nodemgr says ``READY=1``, after its sockets are bound, so what is ordered after it
finds them there.

The address is read once, and taken out of the environment, so that no process nodemgr
starts (the context probe) can speak for it. Outside systemd (no ``NOTIFY_SOCKET``) every
call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("nodemgr")

NOTIFY_SOCKET = "NOTIFY_SOCKET"


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.pop(NOTIFY_SOCKET, "")
        # "@name" is an abstract socket (Linux), named with a leading NUL.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        if address and not address.startswith(("/", "@")):
            log.warning("%s=%r is no socket path; systemd is not told", NOTIFY_SOCKET, address)
            self._address = ""

    def notify(self, *fields: str) -> bool:
        """Send ``fields`` (``READY=1``, ``STATUS=...``) as one datagram; whether it went."""
        if not self._address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto("\n".join(fields).encode(), self._address)
        except OSError as e:
            # systemd then times the start out (TimeoutStartSec) and says why in its log.
            log.warning("cannot tell systemd (%s): %s", NOTIFY_SOCKET, e.strerror)
            return False
        return True
