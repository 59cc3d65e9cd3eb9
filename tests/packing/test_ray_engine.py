"""``--engine ray``: the packer on a local Ray cluster of two worker nodes gives the local engine's bytes."""

import json
import shutil
import sys

import pytest

from packsft.packing import cli, ray_engine
from packsft.packing.config import PackConfig, PackError
from packsft.packing.pipeline import run_pack
from packsft.sidecar import sidecar_path
from packsft.token_cache import cache_paths

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def ray_cluster():
    """A head without CPUs and two one-CPU worker nodes: every task runs on a worker node."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="WARNING")
    yield ray
    ray.shutdown()
    cluster.shutdown()


def _inputs(tmp_path, shared_data):
    """A JSONL file with a bad line, a blank line and a long tool-call conversation, plus a Parquet file."""
    chat = (shared_data / "chat" / "gsm8k_test.messages.jsonl").read_text(encoding="utf-8").splitlines()[:300]
    tools = (shared_data / "tools" / "glaive_toolcall_en_demo.messages.jsonl").read_text(encoding="utf-8")
    lines = chat[:100] + ["{not json", ""] + chat[100:] + tools.splitlines()[:120]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    records = [json.loads(t) for t in chat[:80]]
    parquet = tmp_path / "more.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    return [str(jsonl), str(parquet)]


def _pack(out_dir, inputs, tokenizer, **kw):
    out_dir.mkdir()
    out = out_dir / "rows.jsonl.packed"
    cfg = PackConfig(inputs=inputs, output=str(out), tokenizer=str(tokenizer), max_seq_len=1024,
                     context_parallel_size=2, progress=False, histogram="", shard_bytes=40_000, **kw)
    report = run_pack(cfg)
    files = [out, sidecar_path(out), *cache_paths(out)]
    return report, {p.name: p.read_bytes() for p in files}


@pytest.mark.slow
def test_ray_engine_output_is_byte_identical_to_the_local_engine(ray_cluster, tmp_path, shared_data, tokenizer_dir,
                                                                 monkeypatch):
    workers = [n for n in ray_cluster.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    assert len(workers) == 2
    monkeypatch.setattr(ray_engine, "_PART_ROWS_MIN", 8)  # several row-writing tasks for a small output
    inputs = _inputs(tmp_path, shared_data)
    local, local_files = _pack(tmp_path / "local", inputs, tokenizer_dir(SMOLLM2), num_workers=0)
    remote, remote_files = _pack(tmp_path / "ray", inputs, tokenizer_dir(SMOLLM2), engine="ray")
    assert len(ray_engine._parts(list(range(remote.rows)), remote.packed_conversations, 8)) > 1
    assert local.rows > 20 and local.rejected and local.oversize
    assert remote_files == local_files
    for key in ("input_conversations", "packed_conversations", "rows", "rejected", "oversize", "warnings",
                "per_input", "lower_bound_rows"):
        assert getattr(remote, key) == getattr(local, key), key
    assert remote.rejected[0]["line"] == 101 and "not valid JSON" in remote.rejected[0]["reason"]
    assert not list((tmp_path / "ray").glob(".*.tmp")), "the spools and parts are removed"


@pytest.mark.slow
def test_ray_engine_strict_stop_names_the_line(ray_cluster, tmp_path, shared_data, tokenizer_dir):
    inputs = _inputs(tmp_path, shared_data)
    with pytest.raises(PackError, match=r"in\.jsonl:101: .*not valid JSON.*strict"):
        _pack(tmp_path / "strict", inputs[:1], tokenizer_dir(SMOLLM2), engine="ray", strict=True)


def test_ray_address_needs_the_ray_engine(tmp_path, capsys, shared_data, tokenizer_dir):
    argv = ["--input", str(shared_data / "chat" / "gsm8k_test.messages.jsonl"), "--output",
            str(tmp_path / "x.jsonl.packed"), "--tokenizer", str(tokenizer_dir(SMOLLM2)), "--max-seq-length", "1024",
            "--ray-address", "auto"]
    assert cli.main(argv) == 2
    assert "error: --ray-address needs --engine ray" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl.packed").exists()


def test_a_shard_result_survives_the_ray_encoding_whole():
    """Every ShardResult field crosses _encode/_decode (a field left out came back as its default: the new
    trained_fitting as 0, so every --engine ray pack stopped with 'nothing to train')."""
    import dataclasses

    import numpy as np

    from packsft.packing.shards import Shard, ShardResult

    r = ShardResult(Shard(2, 1, 10, 90), 5, 4, "/s/spool.shard2", np.array([3, 9], np.int32),
                    np.array([0, 40], np.int64), np.array([40, 50], np.int64), [(1, "bad")],
                    [("no_trained_token", 3, "m")], [(1, 4, 9000, False, 77, 2, 0)], 80, "/s/tokens.shard2",
                    np.array([0, 24], np.int64), trained_fitting=1)
    back = ray_engine._decode(ray_engine._encode(r))
    for f in dataclasses.fields(ShardResult):
        a, b = getattr(r, f.name), getattr(back, f.name)
        assert (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), f.name


def test_ray_engine_without_ray_says_which_extra(monkeypatch):
    for name in ("ray", "ray.data"):   # ray.data too: the cluster tests before this one imported it
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError, match=r"pip install 'packsft\[ray\]'"):
        with ray_engine.ray_session(None):
            pass


@pytest.mark.slow
def test_ray_engine_task_error_reaches_the_driver(ray_cluster, tmp_path, tokenizer_dir):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file PAR1")
    out = tmp_path / "out"
    with pytest.raises((ValueError, PackError), match="bad.parquet"):
        _pack(out, [str(bad)], tokenizer_dir(SMOLLM2), engine="ray")
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
def test_ray_engine_worker_killed_every_time_fails_naming_its_shard(ray_cluster, tmp_path, shared_data,
                                                                    tokenizer_dir, monkeypatch):
    from packsft.packing.worker import WORKER_HOOK_ENV

    monkeypatch.setenv(WORKER_HOOK_ENV, "2:SIGKILL")  # the actor reading shard 2 kills itself, each retry too
    inputs = _inputs(tmp_path, shared_data)
    with pytest.raises(PackError, match=r"failed while reading shard 2 of .*in\.jsonl \(bytes \d+-\d+\)"):
        _pack(tmp_path / "killed", inputs[:1], tokenizer_dir(SMOLLM2), engine="ray")
    assert [p.name for p in (tmp_path / "killed").iterdir()] == [".rows.jsonl.packed.lock"]


def test_an_address_nothing_listens_on_is_refused_before_ray_init():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"--ray-address 127\.0\.0\.1:{port}: no Ray head answers there"):
        ray_engine._check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        ray_engine._check_reachable("headnode")
    for left_to_ray in (None, "auto", "ray://head:10001"):
        ray_engine._check_reachable(left_to_ray)
