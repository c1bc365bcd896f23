"""Hang report: a step that never ends becomes one line naming the rank that is behind and the collective
the others wait in, plus a file per rank, instead of a silent wait until the collective timeout.

Each rank runs a watchdog thread that talks only to the job's key-value store (no collective of its own),
so it still works while every rank waits in one. See docs/failures.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from meshtron.watch.collective_log import LOG, LOG_SIZE, CollectiveLog, Entry
from meshtron.watch.report import OncePerJob, record_cause

HANG_EXIT_CODE = 1
_HANG = "meshtron/hang"  # the store keys' prefix
_DETECTED = f"{_HANG}/detected"
_DETECTORS = f"{_HANG}/detectors"
_GATHER_S = 15.0  # how long the reporting rank waits for its peers' summaries


def _state_key(rank: int) -> str:
    return f"{_HANG}/rank-{rank}"


def hang_limit(configured_s: float, collective_timeout_s: float, step_seconds: list[float]) -> float:
    """Seconds a step may run before it is reported as a hang: ``[train] hang_timeout_s``, or for 0 the larger
    of 300 s and 10 x the median step so far, at most half the collective timeout, so the report comes before
    a collective gives up."""
    if configured_s > 0:
        return configured_s
    median = statistics.median(step_seconds) if step_seconds else 0.0
    return min(max(300.0, 10 * median), collective_timeout_s / 2)


class Watchdog:
    """This rank's watchdog thread; ``step_started`` / ``step_finished`` arm and disarm it."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        output_dir: str | Path,
        hang_timeout_s: float,
        collective_timeout_s: float,
        names: dict[tuple[int, ...], str],
        log: CollectiveLog = LOG,
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.folder = Path(output_dir) / "hang"
        self.hang_timeout_s, self.collective_timeout_s = hang_timeout_s, collective_timeout_s
        self.names, self.log = names, log
        self._step: int | None = None
        self._since: float | None = None
        self._seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtron-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def step_started(self, step: int) -> None:
        self._step, self._since = step, time.monotonic()

    def step_finished(self) -> None:
        if self._since is not None:
            self._seconds.append(time.monotonic() - self._since)
        self._since = None

    def limit(self) -> float:
        return hang_limit(self.hang_timeout_s, self.collective_timeout_s, self._seconds)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit() / 10)):
            since, limit = self._since, self.limit()
            if since is not None and time.monotonic() - since > limit:
                self._report(
                    f"step {self._step} has run {time.monotonic() - since:.0f} s on rank {self.rank} "
                    f"(hang limit {limit:.0f} s)"
                )
            elif self._peer_saw_hang():
                self._report(None)

    def _peer_saw_hang(self) -> bool:
        try:
            return self.store.check([_DETECTED])
        except Exception:  # noqa: BLE001 - the store's host is gone: the launcher is ending the job anyway
            return False

    def _report(self, reason: str | None) -> None:
        """Write this rank's file and summary, print the job's one line if first, then exit."""
        if reason is not None and self.store.add(_DETECTORS, 1) == 1:
            self.store.set(_DETECTED, reason)
        entries, counts = self.log.snapshot()
        path = self.folder / f"rank-{self.rank}.txt"
        self.folder.mkdir(parents=True, exist_ok=True)
        path.write_text(self._rank_file(entries, counts))
        self.store.set(_state_key(self.rank), json.dumps(self._state(entries, counts)))
        once = OncePerJob(self.store, _HANG)
        if once.claim():
            states = self._gather_states()
            why = self.store.get(_DETECTED).decode()
            record_cause(hang_summary(states, self.world_size, why, self.folder))  # peers' failures stay quiet
            once.done()
        else:
            try:
                once.wait(timedelta(seconds=_GATHER_S + 15))
            except Exception:  # noqa: BLE001 - the reporting rank died: exit anyway, the files are written
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _gather_states(self) -> dict[int, dict]:
        states: dict[int, dict] = {}
        deadline = time.monotonic() + _GATHER_S
        while len(states) < self.world_size and time.monotonic() < deadline:
            for rank in range(self.world_size):
                if rank not in states and self.store.check([_state_key(rank)]):
                    states[rank] = json.loads(self.store.get(_state_key(rank)))
            time.sleep(0.2)
        return states

    def _state(self, entries: list[Entry], counts: dict[tuple[int, ...], int]) -> dict:
        waiting = entries[-1] if entries and entries[-1].state == "issued" else None
        return {
            "step": self._step,
            "waiting": None
            if waiting is None
            else {
                "op": waiting.op,
                "group": list(waiting.group),
                "dim": self._name(waiting.group),
                "peers": waiting.peers,
                "group_seq": waiting.group_seq,
            },
            "counts": [[list(g), n] for g, n in counts.items()],
            "where": _innermost_frame(),
        }

    def _name(self, group: tuple[int, ...]) -> str:
        return self.names.get(tuple(group), "a group")

    def _rank_file(self, entries: list[Entry], counts: dict[tuple[int, ...], int]) -> str:
        now = time.monotonic()
        since = "" if self._since is None else f", started {now - self._since:.1f} s ago"
        lines = [
            f"meshtron hang report: rank {self.rank} of {self.world_size}, step {self._step}{since}; "
            f"hang limit {self.limit():.0f} s",
            "",
            f"last {len(entries)} of {self.log.issued} collectives issued (at most {LOG_SIZE}, oldest first):",
        ]
        lines += [f"  {e.line(now)}  [{self._name(e.group)}]" for e in entries]
        lines += ["", "collectives issued per group:"]
        lines += [f"  {self._name(g)} {list(g)}: {n}" for g, n in counts.items()]
        lines += ["", "Python stacks:"]
        frames = sys._current_frames()
        for thread in threading.enumerate():
            if thread.ident in frames:
                lines.append(f"thread {thread.name}:")
                lines += ["  " + line.rstrip() for line in traceback.format_stack(frames[thread.ident])]
        return "\n".join(lines) + "\n"


def _innermost_frame() -> str:
    """Where the main thread is: its innermost Python frame, as file:line in function."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _short(path: str) -> str:
    parts = Path(path).parts
    for anchor in ("meshtron", "torch", "transformers"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor) :])
    return path


def hang_summary(states: dict[int, dict], world_size: int, why: str, folder: Path) -> str:
    """The job's one line: who is behind, where the others wait, which file to read."""
    silent = [r for r in range(world_size) if r not in states]
    outside = sorted(r for r, s in states.items() if s["waiting"] is None)
    behind = outside or _lagging(states)
    parts = [f"meshtron: hang: {why}."]
    if behind:
        where = "; ".join(f"rank {r} at {states[r]['where']}" for r in behind)
        parts.append(
            f"Behind: {_ranks_list(behind)} ({'outside any collective' if outside else 'fewer collectives issued'}: "
            f"{where})."
        )
    waits: dict[tuple, list[int]] = {}
    for rank, state in sorted(states.items()):
        if state["waiting"] is not None and rank not in behind:
            w = state["waiting"]
            waits.setdefault((w["op"], w["dim"], tuple(w["group"]), w["group_seq"], w["peers"]), []).append(rank)
    for (op, dim, group, seq, peers), ranks in waits.items():
        lag = [f"rank {r} issued {_count(states[r], group)}" for r in behind if r in group]
        which = f" ({peers})" if peers else f" (their collective #{seq} on it" + "".join(f"; {x}" for x in lag) + ")"
        parts.append(
            f"{_ranks_list(ranks).capitalize()} wait{'s' if len(ranks) == 1 else ''} in {op} over "
            f"{dim} {list(group)}{which}."
        )
    if silent:
        parts.append(f"No answer from {_ranks_list(silent)} (dead, or its Python thread cannot run).")
    first = behind[0] if behind else (silent[0] if silent else 0)
    parts.append(f"Stacks and last collectives: {folder}/rank-*.txt (start with rank-{first}.txt).")
    return " ".join(parts)


def _count(state: dict, group: tuple[int, ...]) -> int:
    return next((n for g, n in state["counts"] if tuple(g) == group), 0)


def _lagging(states: dict[int, dict]) -> list[int]:
    """Every rank in a collective: those that issued fewer collectives on a group than a peer of it."""
    per_group: dict[tuple[int, ...], dict[int, int]] = {}
    for rank, state in states.items():
        for group, count in state["counts"]:
            per_group.setdefault(tuple(group), {})[rank] = count
    return sorted({r for counts in per_group.values() for r, n in counts.items() if n < max(counts.values())})


def _ranks_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


__all__ = ["HANG_EXIT_CODE", "Watchdog", "hang_limit", "hang_summary"]
