"""Which rank died or stopped answering, when a collective fails.

A gloo / nccl timeout says only "timed out waiting for recv" (or "connection closed by peer"): it
does not say which of N ranks is gone. Every rank therefore runs a `Heartbeat`: a daemon thread
that bumps a counter under ``qatlib/heartbeat/<rank>`` in the job's TCP store (under torchrun the
store lives in the launcher's agent, so it outlives any worker). When a collective fails, the
surviving rank reads every counter twice, ``2 * interval`` apart: a counter that did not move
belongs to a rank whose process is gone (SIGKILL, OOM) or frozen (SIGSTOP, a hung driver; a
stopped process stops all its threads). On the same host its /proc state says which.

torch has no such facility (its flight recorder is nccl-only and names no peer), hence this module.
Counters, not timestamps: hosts' clocks need not agree.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KEY = "qatlib/heartbeat/{rank}"
# Messages of collectives that failed because a peer is gone / silent (gloo, nccl, torch).
_COLLECTIVE_MARKERS = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gloo",
    "nccl",
)


class CollectiveFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering (named in the message)."""


def _open_store(timeout_s: float):
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return torch.distributed.TCPStore(
            addr,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as e:  # noqa: BLE001 - no heartbeat is a weaker message, not a failure
        log.warning("no heartbeat store at %s:%s (%s): a failed rank will not be named", addr, port, e)
        return None


def _proc_state(pid: int) -> str | None:
    """The one-letter /proc state of ``pid`` on this host (``T`` = stopped), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


class Heartbeat:
    """A daemon thread publishing ``{"n": beats, "pid", "host"}`` for this rank every ``interval`` s."""

    def __init__(self, rank: int, world: int, interval: float = 1.0) -> None:
        self.rank, self.world, self.interval = rank, world, interval
        self.store = _open_store(timeout_s=10)
        self._reader = _open_store(timeout_s=10) if self.store is not None else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self.store is not None:
            self._beat(0)
            self._thread = threading.Thread(target=self._run, name="qatlib-heartbeat", daemon=True)
            self._thread.start()
            atexit.register(self.stop)  # also when the caller never closes its context (see `stop`)
        return self

    def _beat(self, n: int) -> None:
        rec = {"n": n, "pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(KEY.format(rank=self.rank), json.dumps(rec))

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            n += 1
            try:
                self._beat(n)
            except Exception:  # noqa: BLE001 - the store (launcher) is gone: the job is ending
                return

    def stop(self) -> None:
        """Stop beating and wait for the thread: a daemon thread still inside a ``TCPStore.set`` (C++,
        GIL released) while the interpreter exits can abort the process in its C++ teardown
        ("terminate called without an active exception", SIGABRT) after all its work succeeded."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 15)  # one beat plus the store's 10 s timeout
            self._thread = None
            atexit.unregister(self.stop)

    def _read(self) -> dict[int, dict]:
        out = {}
        for r in range(self.world):
            key = KEY.format(rank=r)
            try:
                if self._reader.check([key]):
                    out[r] = json.loads(self._reader.get(key))
            except Exception:  # noqa: BLE001 - a missing record is reported as such
                pass
        return out

    def silent_ranks(self) -> list[str]:
        """One line per other rank that is not answering (its heartbeat did not move in
        ``2 * interval``), naming its pid and host and, on this host, whether it is gone or stopped."""
        if self._reader is None:
            return []
        before = self._read()
        time.sleep(2 * self.interval + 0.5)
        after = self._read()
        host = socket.gethostname()
        lines = []
        for r in range(self.world):
            if r == self.rank:
                continue
            a, b = before.get(r), after.get(r)
            if b is None:
                lines.append(f"rank {r} never reported a heartbeat")
                continue
            if a is not None and b["n"] != a["n"]:
                continue  # alive and answering its heartbeat: not the culprit
            what = f"rank {r} (pid {b['pid']} on {b['host']}) stopped answering"
            if b["host"] == host:
                state = _proc_state(b["pid"])
                if state is None:
                    what = f"rank {r} (pid {b['pid']} on {b['host']}) died"
                elif state in ("T", "t"):
                    what += " (its process is stopped, e.g. SIGSTOP)"
                elif state == "Z":
                    what = f"rank {r} (pid {b['pid']} on {b['host']}) died"
            lines.append(what)
        return lines


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed on a missing peer (not a user error)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc).lower()
    return any(m in msg for m in _COLLECTIVE_MARKERS)


def failure_message(exc: BaseException, heartbeat: Heartbeat | None, rank: int, timeout_s: float) -> str:
    """The error a surviving rank reports: which ranks are silent, then the backend's own words."""
    silent = heartbeat.silent_ranks() if heartbeat is not None else []
    who = "; ".join(silent) if silent else "no other rank is known to be gone (see the other ranks' errors)"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"a collective failed on rank {rank} (timeout {timeout_s:g} s, global.collective_timeout_s): "
        f"{who}. Backend: {type(exc).__name__}: {first[:300]}"
    )
