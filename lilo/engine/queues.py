"""One model's commands, released strictly in seq order, with retries deduplicated."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future

from lilo.engine.commands import Command
from lilo.errors import ConflictError

# Seq ids remembered after they ran, so a late retry gets the first run's future instead of running twice.
REMEMBERED_SEQS = 1024


class ModelQueue:
    def __init__(self, first_seq: int = 1, remembered: int = REMEMBERED_SEQS) -> None:
        self.next_seq = first_seq
        self.ready = False  # set once the model's adapter is in place
        self.running = False  # its head was dispatched and has not finished
        self.idle_since_s: float | None = None  # when its last head finished (with nothing queued behind: idle)
        self._held: dict[int, tuple[Command, Future]] = {}
        self._seen: OrderedDict[int, tuple[str, Future]] = OrderedDict()
        self._remembered = remembered

    def offer(self, command: Command, future: Future) -> Future:
        """Queue ``command`` (resolved through ``future``); a retry of a known seq returns the first future."""
        known = self._seen.get(command.seq_id)
        if known is not None:
            fingerprint, first = known
            if fingerprint == command.fingerprint:
                return first
            raise ConflictError(
                f"seq_id {command.seq_id} of model {command.model_id!r} was already submitted with a different "
                "payload; send each new step with the next seq_id.")
        if command.seq_id < self.next_seq:
            raise ConflictError(
                f"seq_id {command.seq_id} of model {command.model_id!r} is behind this model's next seq_id "
                f"{self.next_seq}; it ran long ago or never will. Send steps with increasing seq_ids.")
        self._held[command.seq_id] = (command, future)
        self._seen[command.seq_id] = (command.fingerprint, future)
        while len(self._seen) > self._remembered:
            self._seen.popitem(last=False)
        return future

    def head(self) -> Command | None:
        """The next command in seq order, if it has arrived and nothing of this model is running."""
        if not self.ready or self.running:
            return None
        held = self._held.get(self.next_seq)
        return held[0] if held else None

    @property
    def has_work(self) -> bool:
        """Something of it is queued or running."""
        return self.running or bool(self._held)

    def take_head(self) -> tuple[Command, Future]:
        self.running = True
        return self._held.pop(self.next_seq)

    def finish_head(self, at_s: float) -> None:
        self.running = False
        self.next_seq += 1
        self.idle_since_s = at_s

    def drain(self) -> list[tuple[Command, Future]]:
        """Everything still held (on removal), in seq order."""
        held = [self._held[seq] for seq in sorted(self._held)]
        self._held.clear()
        return held
