"""When a lost shard group is rebuilt: a bounded number of attempts with exponential back-off.

The budget is over the server's life, not per outage: a replica whose shards keep dying
(a bad node, a crashing kernel) should end up answering 503 with the reason instead of
rebuilding forever. The back-off restarts with each outage: the first attempt after a loss
waits `backoff_s`, each further failed attempt of the same outage doubles the wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RebuildPolicy:
    max_rebuilds: int = 3  # attempts over the server's life; 0: never rebuild
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    attempts: int = field(default=0, init=False)
    rebuilds: int = field(default=0, init=False)  # attempts that succeeded
    _failed_in_outage: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.max_rebuilds < 0:
            raise ValueError(f"--max-rebuilds must be 0 or more, not {self.max_rebuilds}")
        if self.backoff_s < 0:
            raise ValueError(f"--rebuild-backoff must be 0 or more, not {self.backoff_s}")

    @property
    def left(self) -> int:
        return max(0, self.max_rebuilds - self.attempts)

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt, or None when the budget is spent."""
        if self.left == 0:
            return None
        return min(self.backoff_s * 2 ** self._failed_in_outage, self.max_backoff_s)

    def record(self, ok: bool) -> None:
        """Count one attempt; a success ends the outage (the next one backs off from 1x)."""
        self.attempts += 1
        if ok:
            self.rebuilds += 1
            self._failed_in_outage = 0
        else:
            self._failed_in_outage += 1
