"""What the packer asks of an engine (:class:`Engine`): count the shards, write the rows.

:class:`packsft.packing.local_engine.LocalEngine` does it in this process or a process pool of this machine,
:class:`packsft.packing.ray_engine.RayEngine` in Ray Data tasks on a cluster; :func:`packsft.packing.pipeline.run_pack`
picks one by ``PackConfig.engine``. Both give the same shard results and write the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from packsft.packing.merge import Counted
from packsft.packing.shards import Shard, ShardResult
from packsft.prompt_formats import Tokenization
from packsft.token_cache import TokenCacheWriter


class Engine(Protocol):
    """Counts the shards of a run and writes its rows (the run's :class:`~packsft.packing.config.PackConfig` is
    the engine's own)."""

    def session(self) -> AbstractContextManager[Any]:
        """The context the run's stages happen in (the Ray engine's cluster connection)."""
        ...

    def count(self, shards: list[Shard], spool_dir: str, tokenization: Tokenization | None = None,
              fingerprint: list[str] | None = None) -> Iterator[ShardResult]:
        """Read, tokenize and count each shard (:func:`packsft.packing.worker.count_shard`), spooling its accepted
        conversations in ``spool_dir``; yield the results in shard order.

        Args:
            tokenization: the packer's, resolved (tokenizer loaded), for workers that can share it.
            fingerprint: a list to which the tokenizer's fingerprint is appended when a worker took it (it then
                stays empty when the engine leaves it to the caller).

        Raises:
            PackError: a worker died or a task failed, naming the shard where known.
        """
        ...

    def write_rows(self, order, starts, counted: Counted, tmp: Path, spool_dir: str,
                   cache: TokenCacheWriter | None) -> tuple[int, str]:
        """Write all rows (conversations ``order``, row ``starts`` into it) into ``tmp`` (fsynced) and their tokens
        into ``cache``; return the rows' size in bytes and BLAKE2b-160 hex."""
        ...
