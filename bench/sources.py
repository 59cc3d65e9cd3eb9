#!/usr/bin/env python
"""Row-source memory benchmark: Arrow memory while the packer reads a Parquet file, small file against a 10x one.

    python bench/sources.py                     # 4,000 synthetic conversations, then 10x as many
    python bench/sources.py --rows 20000 --scale 10

Setup: ``--rows`` synthetic chat records (a user and an assistant turn of about 1 KB of random hex words each,
a tool call on every fifth) written to Parquet in row groups of 1,000 (what ``datasets``' ``to_parquet`` writes),
then the same records ``--scale`` times over. Measured: the peak of ``pyarrow.total_allocated_bytes()`` while
:func:`packsft.packing.sources.iter_source` yields every record's JSON (sampled every 256 rows), for each file;
baseline, in the same run: pyarrow's default ``ParquetFile.iter_batches`` (``pre_buffer=True``), which keeps what
it has read. Streaming holds the ratio big/small near 1; the baseline's grows with the file.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from packsft.packing.sources import iter_source


def _text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.getrandbits(32):x}" for _ in range(words))   # little for Parquet to compress


def _records(n: int) -> list[dict]:
    call = {"id": "call00000", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    rng = random.Random(0)
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i} " + _text(rng, 110)}]
        if i % 5 == 0:
            msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "content": "1", "tool_call_id": "call00000"}]
        msgs.append({"role": "assistant", "content": f"answer {i} " + _text(rng, 110)})
        out.append({"id": str(i), "messages": msgs})
    return out


def _write(path: Path, table: pa.Table, copies: int) -> None:
    with pq.ParquetWriter(str(path), table.schema) as w:
        for _ in range(copies):
            w.write_table(table, row_group_size=1000)


def _peak(items, every: int = 256) -> int:
    peak = 0
    for k, _ in enumerate(items):
        if k % every == 0:
            peak = max(peak, pa.total_allocated_bytes())
    return peak


def main() -> None:
    """Print the peak Arrow memory per file and the big/small ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--scale", type=int, default=10)
    a = p.parse_args()
    table = pa.Table.from_pylist(_records(a.rows))
    with tempfile.TemporaryDirectory() as tmp:
        small, big = Path(tmp, "small.parquet"), Path(tmp, "big.parquet")
        _write(small, table, 1)
        _write(big, table, a.scale)
        del table
        res = {}
        for name, path in (("small", small), ("big", big)):
            res["packsft", name] = _peak(iter_source(path))
            res["baseline", name] = _peak(b for batch in pq.ParquetFile(path).iter_batches(batch_size=1024)
                                          for b in range(batch.num_rows))
            mib = {k: v / 2**20 for k, v in res.items() if k[1] == name}
            print(f"{name:5} {path.stat().st_size / 2**20:7.1f} MiB parquet: peak Arrow memory packsft "
                  f"{mib['packsft', name]:7.1f} MiB, baseline (pre_buffer) {mib['baseline', name]:7.1f} MiB")
    for who in ("packsft", "baseline"):
        print(f"{who:8} big/small peak ratio: {res[who, 'big'] / max(res[who, 'small'], 1):.2f} "
              f"(file ratio {a.scale})")


if __name__ == "__main__":
    main()
