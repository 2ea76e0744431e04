"""Ranks 1..tp-1 of a replica as Ray actors, following rank 0's steps.

The class lives in a module without torch, so the driver creates these actors before it has
imported torch (seconds on a GPU host, which every follower would otherwise wait for); the
Worker, and torch with it, is built in the follower's own process. Each method is the
Worker's call of the same name (tpserve/worker/worker.py), which rank 0's executor makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpserve.config import EngineConfig
    from tpserve.worker.worker import LoadReport


class FollowerActor:
    def __init__(self, cfg: EngineConfig, rank: int) -> None:
        from tpserve.worker.worker import Worker

        self.worker = Worker(cfg, rank)

    def __repr__(self) -> str:  # Ray's state API and the dashboard's actors view
        return repr(self.worker)

    def init_distributed(self, master_addr: str, master_port: int) -> str:
        return self.worker.init_distributed(master_addr, master_port)

    def load_weights(self) -> LoadReport:
        return self.worker.load_weights()

    def available_blocks(self) -> int:
        return self.worker.available_blocks()

    def allocate_cache(self, num_blocks: int) -> None:
        self.worker.allocate_cache(num_blocks)

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> float:
        return self.worker.warmup(batch_sizes)

    def follow(self) -> int:
        """Rank 0's steps until it says stop (the long-lived loop rank 0 watches)."""
        return self.worker.follow()

    def health(self) -> dict:
        return self.worker.health()

    def shutdown(self) -> None:
        self.worker.shutdown()
