"""The token cache beside a packed file: the loader's tensors are identical with and without it, on real data;
own-row conversations store at most L tokens; a stale cache is refused, a missing one re-tokenized with a notice."""

import json
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_dataset import load_cached, packer_loads_each_tokenizer_once  # noqa: F401 - fixture

from packsft.data.collate import collate_rows
from packsft.data.context_parallel import slice_batch_for_cp
from packsft.data.dataset import PackedDataWarning, PackedSFTDataset, TokenCacheNotice
from packsft.io import stale_temps
from packsft.packing import cli
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.sidecar import SidecarError, cache_settings_blake2b, read_sidecar, sidecar_path, write_sidecar
from packsft.token_cache import HEADER, TokenCache, TokenCacheError, cache_paths
from packsft.tokenizer import load_tokenizer

TOK = "smollm2-135m-instruct"
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"


def _chats(path: Path, n: int = 24, long_every: int = 0) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            answer = f"answer {i} " + "because " * (i * 5 % 30)
            if long_every and i % long_every == 0:
                answer += "and so on " * 80
            msgs = [{"role": "user", "content": f"question {i}: " + "why " * (i * 3 % 40)},
                    {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def _pack(src, out, tok, L, cp=1, fmt="chat-template", **kw):
    return run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tok), max_seq_len=L,
                               prompt_format=fmt, context_parallel_size=cp, histogram="", progress=False, **kw))


def _datasets(out, tok, fmt, L, cp=1):
    tok = load_cached(tok)
    cached = PackedSFTDataset(out, tok, fmt, L, cp, require_sidecar=True)
    plain = PackedSFTDataset(out, tok, fmt, L, cp, require_sidecar=True, use_token_cache=False)
    assert cached.token_cache is not None and plain.token_cache is None
    return cached, plain


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where}: {k}"
        else:
            assert a[k] == b[k], f"{where}: {k}"


def _assert_every_row_equal(cached, plain, cp):
    assert len(cached) == len(plain) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackedDataWarning)  # own-row truncation reports, the same in both
        rows = [(cached[i], plain[i]) for i in range(len(cached))]
    for i, (a, b) in enumerate(rows):
        _assert_same(a, b, f"row {i}")
    for start in range(0, len(rows) - 1, 2):  # micro-batches of 2 and, with CP, every rank's slice
        a = collate_rows([r[0] for r in rows[start:start + 2]])
        b = collate_rows([r[1] for r in rows[start:start + 2]])
        _assert_same(a, b, f"batch {start}")
        for rank in range(cp if cp > 1 else 0):
            _assert_same(slice_batch_for_cp(a, cp, rank), slice_batch_for_cp(b, cp, rank), f"batch {start} rank {rank}")
    return rows


@pytest.mark.slow
@pytest.mark.parametrize(("name", "limit", "tokenizer", "fmt", "L", "cp"), [
    ("chat/gsm8k_test.messages.jsonl", 500, "qwen2.5", "chat-template", 2048, 1),
    ("chat/gsm8k_test.messages.jsonl", None, "qwen2.5", "chat-template", 2048, 2),
    ("tools/glaive_toolcall_en_demo.messages.jsonl", None, "qwen2.5", "chat-template", 2048, 2),
    ("chat/chitchat.messages.jsonl", 300, "nemotron-h-layout-tekken", "nemotron-nano-v2", 1024, 2),
])
def test_every_row_of_a_real_file_is_identical_with_and_without_the_cache(tmp_path, shared_data, tokenizer_dir,
                                                                         name, limit, tokenizer, fmt, L, cp):
    src = shared_data / name
    if limit is not None:
        lines = src.read_text(encoding="utf-8").splitlines(keepends=True)[:limit]
        src = tmp_path / "in.jsonl"
        src.write_text("".join(lines), encoding="utf-8")
    out = tmp_path / "rows.jsonl.packed"
    report = _pack(src, out, tokenizer_dir(tokenizer), L, cp, fmt)
    assert report.rejected == [] and report.rows > 10
    cached, plain = _datasets(out, tokenizer_dir(tokenizer), fmt, L, cp)
    rows = _assert_every_row_equal(cached, plain, cp)
    assert sum(len(a["cu_seqlens"]) - 1 for a, _ in rows) == report.packed_conversations
    if name.startswith("chat/chitchat"):  # own-row conversations: stored cut at L, trained the same
        assert report.oversize and all(o["action"].startswith("own row") for o in report.oversize)


@pytest.fixture(scope="module")
def small(tmp_path_factory, tokenizer_dir):
    """``copy(folder) -> rows path``: a fresh copy of one small packed set (rows, sidecar, cache); the tokenizer."""
    d = tmp_path_factory.mktemp("small")
    out = d / "rows.jsonl.packed"
    report = _pack(_chats(d / "in.jsonl", n=60), out, tokenizer_dir(TOK), 128)

    def copy(folder: Path) -> Path:
        for p in (out, sidecar_path(out), *cache_paths(out)):
            shutil.copy(p, folder / p.name)
        return folder / out.name
    return copy, load_cached(tokenizer_dir(TOK)), report


def test_own_row_conversations_store_at_most_max_seq_len_tokens_and_warn_alike(tmp_path, tokenizer_dir):
    src = _chats(tmp_path / "in.jsonl", n=12, long_every=4)
    out = tmp_path / "rows.jsonl.packed"
    L = 128
    report = _pack(src, out, tokenizer_dir(TOK), L)
    assert len(report.oversize) == 3
    tokens_path, index_path = cache_paths(out)
    index = np.load(index_path, mmap_mode="r", allow_pickle=False)
    rows, convs = int(index[2]), int(index[3])
    lengths = np.asarray(index[HEADER + 2 * (rows + 1):])
    assert len(lengths) == convs == report.packed_conversations and (lengths > L).sum() == 3
    pairs = np.load(tokens_path, mmap_mode="r", allow_pickle=False)
    assert pairs.dtype == np.int32 and pairs.shape == (int(np.minimum(lengths, L).sum()), 2)
    cached, plain = _datasets(out, tokenizer_dir(TOK), "chat-template", L)
    own = [r for r in range(rows) if (lengths[index[HEADER + r]:index[HEADER + r + 1]] > L).any()]
    assert len(own) == 3
    for r in own:
        ids, tgts, full = cached.token_cache.row(r)
        assert len(ids) == len(tgts) == L and len(full) == 1 and full[0] > L
        tokens, targets = plain.tokenize_row(r)[0]
        assert full[0] == len(tokens) and ids.tolist() == tokens[:L] and tgts.tolist() == targets[:L]
        with pytest.warns(PackedDataWarning) as a:
            row_a = cached[r]
        with pytest.warns(PackedDataWarning) as b:
            row_b = plain[r]
        assert [str(w.message) for w in a] == [str(w.message) for w in b] and "right-truncated" in str(a[0].message)
        _assert_same(row_a, row_b, f"row {r}")
    _assert_every_row_equal(cached, plain, 1)


def test_a_cache_that_disagrees_with_the_sidecar_is_refused_naming_both(tmp_path, small, tokenizer_dir):
    copy, tok, _ = small
    out = copy(tmp_path)
    tokens_path, index_path = cache_paths(out)
    good = tokens_path.read_bytes()
    tokens_path.write_bytes(good[:-8])  # another size: always refused
    with pytest.raises(SidecarError, match=r"rows.jsonl.packed.tokens.npy does not match its sidecar .*meta.json: "
                                           r"the file has \d+ bytes, the sidecar records \d+"):
        PackedSFTDataset(out, tok, "chat-template", 128, verify_rows_hash=False)
    middle = bytearray(good)
    middle[len(good) // 2] ^= 1  # same size and ends (the file is < 2 MiB: its ends cover it)
    tokens_path.write_bytes(bytes(middle))
    with pytest.raises(SidecarError, match="first and last MiB"):
        PackedSFTDataset(out, tok, "chat-template", 128)
    tokens_path.write_bytes(good)
    PackedSFTDataset(out, tok, "chat-template", 128)
    # the index of another pack: refused by its fingerprints
    other = tmp_path / "other" / "rows.jsonl.packed"
    _pack(_chats(tmp_path / "in2.jsonl", n=30), other, tokenizer_dir(TOK), 128)
    index_path.write_bytes(cache_paths(other)[1].read_bytes())
    with pytest.raises(SidecarError, match=r"tokens-index.npy does not match its sidecar"):
        PackedSFTDataset(out, tok, "chat-template", 128)


def test_the_index_header_ties_the_cache_to_its_rows(tmp_path, small):
    copy, _, report = small
    out = copy(tmp_path)
    digest = read_sidecar(out)["rows_file"]["blake2b"]
    TokenCache(out, report.rows, 128, digest)
    with pytest.raises(TokenCacheError, match="another rows file"):
        TokenCache(out, report.rows, 128, "0" * 40)
    with pytest.raises(TokenCacheError, match=f"{report.rows} rows, the rows file has {report.rows + 1}"):
        TokenCache(out, report.rows + 1, 128, digest)
    with pytest.raises(TokenCacheError, match="written for max_seq_len 128, the loader has 256"):
        TokenCache(out, report.rows, 256, digest)


def test_missing_or_unrecorded_cache_is_re_tokenized_with_one_notice(tmp_path, small):
    copy, tok, _ = small
    out = copy(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = PackedSFTDataset(out, tok, "chat-template", 128)
        reference = [ds[i] for i in range(len(ds))]
    assert ds.token_cache is not None
    tokens_path, index_path = cache_paths(out)
    tokens_path.unlink()
    with pytest.warns(TokenCacheNotice) as record:
        ds = PackedSFTDataset(out, tok, "chat-template", 128)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert "rows.jsonl.packed.tokens.npy is missing; rows are re-tokenized" in str(record[0].message)
    tokens_path.mkdir()
    with pytest.warns(TokenCacheNotice, match="tokens.npy is not a file; rows are re-tokenized"):
        PackedSFTDataset(out, tok, "chat-template", 128)
    tokens_path.rmdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further notice per row
        for i, row in enumerate(reference):
            _assert_same(ds[i], row, f"row {i}")
    assert ds.token_cache is None and ds.token_cache_status.startswith("re-tokenized")
    meta = read_sidecar(out)
    del meta["token_cache"]  # an older packsft's sidecar
    write_sidecar(out, meta)
    with pytest.warns(TokenCacheNotice, match="its sidecar records no token cache"):
        PackedSFTDataset(out, tok, "chat-template", 128, verify_rows_hash=False)


def test_a_sidecar_edited_after_packing_does_not_vouch_for_the_cache(tmp_path, small):
    """The sidecar's train_on edited to ``last``: the loader took the cache's all-turns targets (105 trained
    tokens on a row where re-tokenizing gives 9). The cache entry records a digest of the settings that made it."""
    copy, tok, _ = small
    out = copy(tmp_path)
    meta = read_sidecar(out)
    assert meta["token_cache"]["settings_blake2b"] == cache_settings_blake2b(meta)
    meta["prompt_format"]["train_on"] = "last"
    write_sidecar(out, meta)
    with pytest.warns(TokenCacheNotice, match="written under other tokenizer or prompt-format settings than its "
                                              "sidecar now records"):
        ds = PackedSFTDataset(out, tok, "chat-template", 128)
    plain = PackedSFTDataset(out, tok, "chat-template", 128, use_token_cache=False)
    assert ds.token_cache is None and ds.prompt_format.train_on == "last"
    for i in range(len(ds)):
        _assert_same(ds[i], plain[i], f"row {i}")
    del meta["token_cache"]["settings_blake2b"]  # an earlier packsft's entry: trusted as before
    write_sidecar(out, meta)
    assert PackedSFTDataset(out, tok, "chat-template", 128).token_cache is not None
    del meta["rows_file"]  # nothing ties the cache to the rows' bytes: an edited row took the cache's ids, silently
    write_sidecar(out, meta)
    with pytest.warns(TokenCacheNotice, match="records a token cache but not the rows file's size and hash"):
        assert PackedSFTDataset(out, tok, "chat-template", 128).token_cache is None


def test_data_verify_hash_full_hashes_a_cache_over_the_auto_limit_whole(tmp_path, small, tokenizer_dir, monkeypatch):
    """A cache file over 256 MiB (the limit lowered to 0 here) is checked at start by size and its first and last MiB
    only; a byte changed between them (its recorded ends matching, as they would in a large file) passes that, and
    the trainer's ``data.verify_hash: full`` hashes it whole and refuses it (it had no way to ask before)."""
    from packsft import sidecar
    from packsft.token_cache import ends_blake2b
    from packsft.train.config import load_config
    from packsft.train.data import build_datasets

    copy, _, _ = small
    out = copy(tmp_path)
    tokens_path = cache_paths(out)[0]
    data = bytearray(tokens_path.read_bytes())
    data[len(data) // 2] ^= 1
    tokens_path.write_bytes(bytes(data))
    meta = read_sidecar(out)
    meta["token_cache"]["tokens"]["ends_blake2b"] = ends_blake2b(tokens_path)
    write_sidecar(out, meta)
    monkeypatch.setattr(sidecar, "HASH_AUTO_LIMIT", 0)
    overrides = [f"data.train_path={out}", f"data.tokenizer={tokenizer_dir(TOK)}", "data.max_seq_len=128",
                 "data.split_validation_size=0", "validation.val_period=0", "validation.val_at_end=false"]
    train, _ = build_datasets(load_config(TINY, overrides))
    assert train.token_cache is not None and not train.rows_hash_checked
    with pytest.raises(SidecarError, match=r"tokens.npy does not match its sidecar .*: its BLAKE2b is [0-9a-f]{40}, "
                                           r"the sidecar records"):
        build_datasets(load_config(TINY, [*overrides, "data.verify_hash=full"]))
    with pytest.raises(ValueError, match=r"data.verify_hash must be one of \('auto', 'full'\), got 'always'"):
        load_config(TINY, [*overrides, "data.verify_hash=always"])


def test_no_token_cache_writes_none_and_removes_an_old_one(tmp_path, tokenizer_dir, capsys):
    src = _chats(tmp_path / "in.jsonl")
    out = tmp_path / "rows.jsonl.packed"
    argv = ["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_dir(TOK)),
            "--max-seq-length", "128", "--no-progress", "--histogram", ""]
    assert cli.main(argv) == 0
    assert all(p.is_file() for p in cache_paths(out)) and "token_cache" in read_sidecar(out)
    assert "token_cache" in capsys.readouterr().out  # listed with the outputs
    assert cli.main(argv + ["--no-token-cache"]) == 0
    assert not any(p.exists() for p in cache_paths(out)) and "token_cache" not in read_sidecar(out)
    assert [t for p in cache_paths(out) for t in stale_temps(p)] == []
    # so are the histogram and report at their default paths when a re-pack writes none there (they would
    # describe the earlier rows)
    histogram, report = Path(f"{out}.lengths.png"), Path(f"{out}.report.json")
    assert cli.main(argv[:-2]) == 0 and histogram.is_file() and report.is_file()
    elsewhere = tmp_path / "elsewhere.report.json"
    assert cli.main(argv + ["--report", str(elsewhere)]) == 0
    assert not histogram.exists() and not report.exists() and elsewhere.is_file()
    from packsft.packing.publish import stale_outputs  # a default path this run writes to is not stale
    swapped = {"rows": str(out), "report": f"{out}.lengths.png", "histogram": f"{out}.report.json",
               "token_cache": "t", "token_index": "i"}
    assert stale_outputs(swapped) == ()


def test_pickles_without_the_memory_maps(tmp_path, small):
    copy, tok, _ = small
    out = copy(tmp_path)
    ds = PackedSFTDataset(out, tok, "chat-template", 128)
    blob = pickle.dumps(ds.token_cache)
    assert len(blob) < 2000 and cache_paths(out)[0].stat().st_size > 20000
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.token_cache is not None
    _assert_same(copy[len(ds) - 1], ds[len(ds) - 1], "last row")


def test_sidecar_records_sizes_and_hashes_of_the_cache(tmp_path, small):
    from packsft.io import file_blake2b
    from packsft.token_cache import ends_blake2b

    copy, _, report = small
    out = copy(tmp_path)
    entry = read_sidecar(out)["token_cache"]
    assert entry["rows"] == report.rows and entry["conversations"] == report.packed_conversations
    for key, path in zip(("tokens", "index"), cache_paths(out)):
        assert entry[key] == {"file": path.name, "size": path.stat().st_size, "blake2b": file_blake2b(path),
                              "ends_blake2b": ends_blake2b(path)}
    assert sidecar_path(out).is_file()


def test_targets_as_runs_give_the_same_bytes_and_counts():
    """The packer spools targets as runs (+k trained, -k masked): the bytes, the targets list and the trained
    counts and truncations built from runs equal those of the targets list, on random runs."""
    from packsft.layout import IGNORE_INDEX
    from packsft.packing.worker import runs_head, trained_in
    from packsft.prompt_formats import targets_of_runs
    from packsft.token_cache import encode_pairs, encode_runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        runs = [int(k) * (1 if rng.random() < 0.5 else -1) for k in rng.integers(1, 6, rng.integers(1, 8))]
        n = sum(map(abs, runs))
        tokens = rng.integers(0, 50_000, n).tolist()
        targets = [t if r > 0 else IGNORE_INDEX for r in runs for t in [0] * abs(r)]
        targets = [tok if tgt != IGNORE_INDEX else IGNORE_INDEX for tok, tgt in zip(tokens, targets)]
        assert targets_of_runs(tokens, runs) == targets
        assert encode_runs(tokens, runs) == encode_pairs(tokens, targets)
        for start, end in ((1, n), (0, n), (1, max(1, n // 2)), (2, n + 5)):
            assert trained_in(runs, start, end) == sum(t != IGNORE_INDEX for t in targets[start:end])
        for k in range(n + 1):
            head = runs_head(runs, k)
            assert sum(map(abs, head)) == k and all(head)
            assert targets_of_runs(tokens[:k], head) == targets[:k]


@pytest.fixture(scope="module")
def another_eos(tmp_path_factory, tokenizer_dir):
    """Qwen2.5's tokenizer.json with another EOS (``<|file_sep|>``) in its tokenizer_config.json, loaded."""
    tok = tmp_path_factory.mktemp("another_eos") / "tok"
    shutil.copytree(tokenizer_dir("qwen2.5"), tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|file_sep|>"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    other = load_tokenizer(tok)
    assert other.eos_token == "<|file_sep|>"
    return other


@pytest.mark.parametrize("fmt", ["passthrough", "chat-template"])
def test_a_tokenizer_with_another_eos_is_refused_not_served_the_packed_ids(tmp_path, tokenizer_dir, another_eos, fmt):
    """The same tokenizer.json with another EOS in tokenizer_config.json (Llama-3 base vs instruct, say) has the same
    fingerprint, but appends (passthrough's EOS) or renders (a template's ``eos_token``) another id: the cache holds
    the packed EOS, re-tokenizing gives the new one. The sidecar records the special tokens and refuses it."""
    src, out = _chats(tmp_path / "c.jsonl", 8), tmp_path / "x.jsonl.packed"
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    kw = {"chat_template": template} if fmt == "chat-template" else {}
    _pack(src, out, tokenizer_dir("qwen2.5"), 256, fmt=fmt, **kw)
    with pytest.raises(SidecarError, match=r"(?s)special_tokens.*<\|im_end\|>.*<\|file_sep\|>"):
        PackedSFTDataset(out, another_eos, fmt, 256, chat_template=kw.get("chat_template"))


def test_another_eos_is_accepted_where_the_ids_cannot_depend_on_it(tmp_path, tokenizer_dir, another_eos):
    """Qwen2.5's own template writes ``<|im_end|>`` itself (no ``eos_token``, no appended EOS): a tokenizer with
    another EOS gives the same ids, so the file loads, cache and re-tokenizing alike."""
    src, out = _chats(tmp_path / "c.jsonl", 8), tmp_path / "x.jsonl.packed"
    _pack(src, out, tokenizer_dir("qwen2.5"), 256, fmt="chat-template")
    assert "special_tokens" not in read_sidecar(out)
    cached, fresh = (PackedSFTDataset(out, another_eos, "chat-template", 256, use_token_cache=use)
                     for use in (True, False))
    assert all(torch.equal(cached[i]["tokens"], fresh[i]["tokens"]) for i in range(len(cached)))
