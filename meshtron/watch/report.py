"""One failure report per job, whichever rank gets there first, through the launcher's store.

torchrun stops every worker as soon as one exits, so "rank 0 prints" loses the message whenever another rank
exits first: every rank competes for the report on the job's key-value store, and the rank whose own error ended
the job records it so its peers' failed collectives stay quiet. See docs/failures.md, 'No hangs'.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

from meshtron.torch_private import default_store

_REPORT = "meshtron/watch/report"
_CAUSE = "meshtron/watch/report/cause"
# How long a rank that lost the claim waits for the winner to print before exiting anyway.
_WAIT = timedelta(seconds=30)


def launch_store(timeout: timedelta):
    """(store, rank, world size) of the launcher's rendezvous, the store scoped to this restart
    attempt: torchrun keeps its store across ``--max-restarts``, where a restarted rank could read the
    values a dead attempt left."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store), rank, world_size


def _job_store(timeout: timedelta = timedelta(seconds=60)):
    """The store of the running job: the process group's, else the launcher's; None if unreachable."""
    if dist.is_initialized():
        return default_store()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    try:
        return launch_store(timeout)[0]
    except Exception:  # noqa: BLE001 - no store: the caller prints for itself
        return None


class OncePerJob:
    """One rank of the job does something (prints a report) once: the first to claim it. The others wait
    until it is done, since exiting first could get the launcher to stop that rank mid-way. Keys under
    ``prefix`` on the job's ``store``."""

    def __init__(self, store: dist.Store, prefix: str):
        self.store, self.prefix = store, prefix

    def claim(self) -> bool:
        """True for the first rank to ask (it does the thing, then calls :meth:`done`)."""
        return self.store.add(f"{self.prefix}/claims", 1) == 1

    def done(self) -> None:
        self.store.set(f"{self.prefix}/printed", "1")

    def wait(self, timeout: timedelta) -> None:
        """Until the claiming rank is done; raises if it does not finish within ``timeout``."""
        self.store.wait([f"{self.prefix}/printed"], timeout)


def report_once(message: str) -> None:
    """Print ``message`` (the same on every rank) once for the job: the first rank to claim it prints."""
    store = _job_store()
    if store is None:
        _print(message)
        return
    once = OncePerJob(store, _REPORT)
    try:
        first = once.claim()
    except Exception:  # noqa: BLE001 - the store went away with its host: say it ourselves
        _print(message)
        return
    if first:
        _print(message)
        once.done()
        return
    try:
        once.wait(_WAIT)
    except Exception:  # noqa: BLE001 - the winner died first: its message may be lost, ours is the same
        _print(message)


def record_cause(message: str) -> None:
    """This rank's own error ends the job: print it and leave it on the store for the peers."""
    _print(message)
    store = _job_store()
    if store is not None:
        try:
            store.set(_CAUSE, message)
        except Exception:  # noqa: BLE001 - printed already; peers then print their own lines
            pass


def report_consequence(message: str) -> None:
    """A collective failed because a peer stopped: print ``message`` unless a peer recorded the cause."""
    store = _job_store()
    try:
        known = store is not None and store.check([_CAUSE])
    except Exception:  # noqa: BLE001
        known = False
    if not known:
        _print(message)


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = ["launch_store", "record_cause", "report_consequence", "report_once"]
