"""The packer's fast paths keep its output: start-up imports, one template render, shards and workers, dead workers."""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import packsft.prompt_formats as pf
from packsft.conversation import parse_record
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.packing.shards import plan_shards
from packsft.packing.worker import WORKER_HOOK_ENV
from packsft.prompt_formats import chat_template
from packsft.sidecar import sidecar_path
from packsft.token_cache import cache_paths
from packsft.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEMPLATED = ("smollm2-135m-instruct", "qwen2.5", "mistral-nemo", "nemotron-h-layout-tekken")


def test_pack_cli_start_imports_no_torch_megatron_or_matplotlib(tokenizer_dir):
    code = ("import sys; import packsft.packing.cli; from packsft.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(tokenizer_dir('qwen2.5'))!r}); "
            "print(sorted(m for m in ('torch', 'megatron', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def _conversations(shared_data: Path, per_file: int):
    for path in sorted((shared_data / "chat").glob("*.jsonl")) + sorted((shared_data / "tools").glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line, text in zip(range(1, per_file + 1), f):
                yield path.name, line, parse_record(json.loads(text), path, line)


def _tokenize_all(convs, tok, fmt):
    out = []
    for _, _, c in convs:
        try:
            out.append(pf.tokenize_conversation(c.messages, pf.Tokenization.of(tok, fmt), c.tools,
                                                c.chat_template_kwargs))
        except pf.PromptFormatError as e:
            out.append(f"error: {e}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATED)
def test_one_render_gives_the_two_render_tokens_and_targets_on_real_files(name, shared_data, tokenizer_dir,
                                                                          monkeypatch):
    tok = load_tokenizer(tokenizer_dir(name))
    fmt = pf.get_prompt_format("chat-template", tok)
    convs = list(_conversations(shared_data, 60))
    used = []
    traced = chat_template._render_traced
    monkeypatch.setattr(chat_template, "_render_traced", lambda *a: used.append(r := traced(*a)) or r)
    fast = _tokenize_all(convs, tok, fmt)
    monkeypatch.setattr(chat_template, "_compile_jinja_template", None)  # the two-render path of earlier packsft
    slow = _tokenize_all(convs, tok, fmt)
    diff = [(f, line) for (f, line, _), a, b in zip(convs, fast, slow) if a != b]
    assert not diff, f"{name}: tokens or targets differ at {diff[:5]}"
    if name != "nemotron-h-layout-tekken":  # its template edits contents (strip, split): always rendered twice
        assert sum(r is not None for r in used) > len(convs) // 2


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ '<s>' + m['role'] + ':' + m['content'] | trim + '</s>\n' }}{% endfor %}",
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>\n{% endfor %}",
    "{% for m in messages %}{{ '<s>' + m['role'] + ':' + (m['content'] if 'x' in m['content'] else 'no') + '</s>' }}"
    "{% endfor %}",
])
def test_a_template_that_uses_the_content_is_rendered_twice(template, tokenizer_dir, monkeypatch):
    tok = load_tokenizer(tokenizer_dir("smollm2-135m-instruct"))
    fmt = pf.get_prompt_format("chat-template", tok, chat_template=template)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "  x answer  "}]
    assert chat_template._render_traced(tok, fmt, chat_template._template_messages(msgs), [2], None, {}) is None
    got = pf.tokenize_conversation(msgs, pf.Tokenization.of(tok, fmt))
    monkeypatch.setattr(chat_template, "_compile_jinja_template", None)
    assert got == pf.tokenize_conversation(msgs, pf.Tokenization.of(tok, fmt))


def test_a_template_that_only_concatenates_is_rendered_once(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir("qwen2.5"))
    fmt = pf.get_prompt_format("chat-template", tok)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "answer"}]
    text = chat_template._render_traced(tok, fmt, msgs, [2], None, {})
    assert text == tok.apply_chat_template(
        [dict(m, content=f"\ue000{m['content']}\ue001") if i == 2 else m for i, m in enumerate(msgs)],
        tokenize=False)


def _mixed_input(shared_data: Path, path: Path) -> Path:
    """Real conversations with a blank line, bad JSON and an empty conversation between them."""
    with open(path, "w", encoding="utf-8") as out:
        for name, n in (("gsm8k_test", 40), ("chitchat", 12), ("hh_rlhf_harmless_base_test", 30)):
            with open(shared_data / "chat" / f"{name}.messages.jsonl", encoding="utf-8") as f:
                for _, line in zip(range(n), f):
                    out.write(line)
            out.write("\nnot json\n" + json.dumps({"messages": []}) + "\n")
    return path


def _outputs(out: Path):
    report = json.loads(Path(str(out) + ".report.json").read_text())
    return (out.read_bytes(), sidecar_path(out).read_bytes(), *(p.read_bytes() for p in cache_paths(out)),
            report["rejected"], report["oversize"], report["warnings"], report["per_input"])


MIXED_RUNS = ((0, None), (0, 20_000), (2, 20_000), (3, 7_000))   # (--num-workers, --shard-bytes)


@pytest.fixture(scope="module")
def mixed_runs(shared_data, tokenizer_dir, tmp_path_factory):
    """The mixed input packed with qwen2.5 at each of ``MIXED_RUNS``, recording which process took the tokenizer
    fingerprint and, in each process set up to read shards, whether it is a worker and its frozen-object count:
    ``(src, {run: {"outputs", "report", "fingerprint_pids", "inits", "frozen_after", "sidecar_fingerprint"}})``."""
    from packsft.packing import local_engine
    from packsft.prompt_formats import spec
    from packsft.sidecar import read_sidecar

    tmp_path = tmp_path_factory.mktemp("mixed")
    src = _mixed_input(shared_data, tmp_path / "in.jsonl")
    taken, seen = tmp_path / "taken", tmp_path / "inits"
    fingerprint, init = spec.tokenizer_fingerprint, local_engine.init_worker

    def recording_fingerprint(tok):
        with open(taken, "a") as f:
            f.write(f"{os.getpid()}\n")
        return fingerprint(tok)

    def recording_init(cfg, spool_dir, in_worker, tok=None):
        with open(seen, "a") as f:
            f.write(f"{int(in_worker)} {gc.get_freeze_count()}\n")
        init(cfg, spool_dir, in_worker, tok)

    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec, "tokenizer_fingerprint", recording_fingerprint)  # forked: the workers' too
        mp.setattr(local_engine, "init_worker", recording_init)
        for workers, shard_bytes in MIXED_RUNS:
            out = tmp_path / f"w{workers}s{shard_bytes}" / "rows.jsonl.packed"
            taken.unlink(missing_ok=True)
            seen.unlink(missing_ok=True)
            report = run_pack(PackConfig(inputs=[str(src)], output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")),
                                         max_seq_len=1024, num_workers=workers, shard_bytes=shard_bytes,
                                         progress=False, histogram=""))
            runs[workers, shard_bytes] = {
                "outputs": _outputs(out), "report": report, "listing": sorted(os.listdir(out.parent)),
                "fingerprint_pids": taken.read_text().split(), "frozen_after": gc.get_freeze_count(),
                "inits": [line.split() for line in seen.read_text().splitlines()],
                "sidecar_fingerprint": read_sidecar(str(out))["tokenizer_fingerprint"]}
    return src, runs


@pytest.mark.slow
def test_output_is_the_same_for_any_worker_count_and_shard_size(mixed_runs):
    src, runs = mixed_runs
    assert len(plan_shards([str(src)], 20_000)) >= 4
    for run in runs.values():
        assert run["listing"] == [".rows.jsonl.packed.lock", "rows.jsonl.packed", "rows.jsonl.packed.meta.json",
                                  "rows.jsonl.packed.report.json", "rows.jsonl.packed.tokens-index.npy",
                                  "rows.jsonl.packed.tokens.npy"]
    first = runs[0, None]["outputs"]
    assert all(run["outputs"] == first for run in runs.values())
    assert len(first[2]) > 128 and len(first[3]) > 128  # the token cache and its index were compared too
    lines = [r["line"] for r in first[4]]
    assert lines == [42, 43, 57, 58, 90, 91]  # blank line, bad JSON, empty conversation after each block
    assert runs[MIXED_RUNS[-1]]["report"].input_conversations == 40 + 12 + 30 + 6
    assert first[7] == {str(src): {"conversations": 88, "rejected": 6, "blank_lines": 3}}  # every line accounted


@pytest.mark.parametrize("files", [1, 2])
def test_small_inputs_are_read_without_workers(files, shared_data, tokenizer_dir, tmp_path, monkeypatch):
    """One JSONL shard, or small files (a shard each) of at most 256 KiB in all: --num-workers 2 starts no
    process (it would only add its start) and gives the same outputs as --num-workers 0."""
    import concurrent.futures

    src = [str(_mixed_input(shared_data, tmp_path / f"in{i}.jsonl")) for i in range(files)]
    assert len(plan_shards(src)) == files
    got = {}
    for workers in (0, 2):
        out = tmp_path / f"w{workers}" / "rows.jsonl.packed"
        if workers:
            monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", None)  # fails if a pool is started
        run_pack(PackConfig(inputs=src, output=str(out), tokenizer=str(tokenizer_dir("qwen2.5")),
                            max_seq_len=1024, num_workers=workers, progress=False, histogram=""))
        got[workers] = _outputs(out)
    assert got[0] == got[2] and len(got[0][0]) > 1000


def test_with_workers_the_tokenizer_fingerprint_is_taken_by_a_worker(mixed_runs, tokenizer_dir):
    """With workers, a worker takes the sidecar's tokenizer fingerprint (in the main process it would hold the
    GIL that the thread handing out shards needs), once; without, the main process; the same value."""
    from packsft.prompt_formats import spec

    _, runs = mixed_runs
    for workers in (0, 2):
        pids = runs[workers, 20_000]["fingerprint_pids"]
        assert len(pids) == 1 and (pids[0] == str(os.getpid())) == (workers == 0)
    assert runs[0, 20_000]["sidecar_fingerprint"] == runs[2, 20_000]["sidecar_fingerprint"] == \
        spec.tokenizer_fingerprint(load_tokenizer(tokenizer_dir("qwen2.5")))


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_forked_workers_start_with_the_inherited_objects_frozen(mixed_runs):
    """The workers are forked with the garbage collector's objects frozen (their collections then leave the
    inherited pages alone), and the main process unfreezes them once the workers are started."""
    run = mixed_runs[1][2, 20_000]
    assert len(run["inits"]) == 2 and all(w == "1" and int(n) > 0 for w, n in run["inits"])
    assert run["frozen_after"] == 0


def test_counting_in_this_process_runs_with_the_objects_frozen(shared_data, tokenizer_dir, tmp_path, monkeypatch):
    """Without workers the shards are counted with the garbage collector's objects frozen (a full collection
    then skips the imports' and the tokenizer's), and unfrozen after; a caller's frozen objects stay frozen."""
    from packsft.packing import local_engine

    seen = []
    count = local_engine.count_shard
    monkeypatch.setattr(local_engine, "count_shard",
                        lambda shard: (seen.append(gc.get_freeze_count()), count(shard))[1])
    src = _mixed_input(shared_data, tmp_path / "in.jsonl")

    def pack():
        run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "rows.jsonl.packed"),
                            tokenizer=str(tokenizer_dir("smollm2-135m-instruct")), max_seq_len=1024, num_workers=0,
                            shard_bytes=20_000, progress=False, histogram=""))

    pack()
    assert len(seen) > 1 and all(n > 1000 for n in seen) and gc.get_freeze_count() == 0
    keep = [[i] for i in range(1000)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        pack()
        assert gc.get_freeze_count() > frozen // 2 and keep
    finally:
        gc.unfreeze()


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_callers_frozen_objects_stay_frozen(shared_data, tokenizer_dir, tmp_path):
    """A caller that froze its objects (``gc.freeze`` at its start) has them frozen after a run with workers."""
    keep = [[i] for i in range(1000)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        run_pack(PackConfig(inputs=[str(_mixed_input(shared_data, tmp_path / "in.jsonl"))],
                            output=str(tmp_path / "rows.jsonl.packed"), tokenizer=str(tokenizer_dir("qwen2.5")),
                            max_seq_len=1024, num_workers=2, shard_bytes=20_000, progress=False, histogram=""))
        assert gc.get_freeze_count() > frozen // 2 and keep  # (frozen objects freed since are not counted)
    finally:
        gc.unfreeze()


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
def test_a_worker_that_dies_taking_the_fingerprint_after_the_shards_is_reported(shared_data, tokenizer_dir,
                                                                                tmp_path, monkeypatch):
    """The worker taking the tokenizer fingerprint dies (e.g. the out-of-memory killer) after the last shard's
    result came back: a PackError naming the dead worker, as for a death while reading a shard."""
    import signal

    from packsft.packing import merge
    from packsft.packing.config import PackError
    from packsft.prompt_formats import spec

    flag = tmp_path / "shards_done"
    progress = merge._shard_progress
    merged = []

    def counting(bar, result, conversations):
        merged.append(result.shard.index)
        if len(merged) == len(plan_shards([str(src)], 20_000)):
            flag.touch()
        progress(bar, result, conversations)

    def dies_after_the_shards(tok):  # in the worker: waits for the main process to merge every shard
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    src = _mixed_input(shared_data, tmp_path / "in.jsonl")
    monkeypatch.setattr(merge, "_shard_progress", counting)
    monkeypatch.setattr(spec, "tokenizer_fingerprint", dies_after_the_shards)  # forked: the workers' too
    with pytest.raises(PackError, match="died .killed by SIGKILL"):
        run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "rows.jsonl.packed"),
                            tokenizer=str(tokenizer_dir("qwen2.5")), max_seq_len=1024, num_workers=2,
                            shard_bytes=20_000, progress=False, histogram=""))
    assert flag.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".rows.jsonl.packed.lock", "in.jsonl",
                                                                           "shards_done"]


def test_shards_are_line_aligned_and_cover_the_file(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(b"x" * (i % 17) + b"\n" for i in range(500)) + b"tail")
    for size in (1, 5, 64, 1000, 10**6):
        shards = plan_shards([str(src)], size)
        assert shards[0].start == 0 and shards[-1].end == src.stat().st_size
        data = src.read_bytes()
        for a, b in zip(shards, shards[1:]):
            assert a.end == b.start and data[b.start - 1 : b.start] == b"\n"


def test_the_default_plan_cuts_the_last_two_shards_of_bytes_finer(tmp_path, monkeypatch):
    """By default the last ``2 * shard size`` bytes of all the inputs are cut in quarter shards (the workers then
    finish together), whichever file they are in; a given shard size, and an input of one shard, are cut evenly."""
    from packsft.packing import shards as shards_module

    monkeypatch.setattr(shards_module, "SHARD_BYTES_MIN", 4000)
    files = []
    for name, lines in (("a", 530), ("b", 40)):  # 77-byte lines: boundaries move to line starts
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_bytes(b"".join(b"y" * 76 + b"\n" for _ in range(lines)))
    total = sum(f.stat().st_size for f in files)  # 43,890 bytes: 4000-byte shards, a tail of 8000
    shards = plan_shards([str(f) for f in files])
    sizes = np.array([s.end - s.start for s in shards])
    starts = np.cumsum(sizes) - sizes  # in all the inputs' bytes
    ends = starts + sizes
    tail = ends > total - 8000 + 77  # shards with bytes in the tail (more than the line a cut moves to)
    assert starts[tail][0] >= total - 8000  # none reaches into it from before
    assert max(sizes[tail]) <= 1000 + 76 and sizes[tail].sum() >= 8000 - 76
    assert all(n >= 4000 for n in sizes[~tail][:-1]) and shards[-1].file_idx == 1  # before it: whole shards
    assert all(n >= 4000 for n in (s.end - s.start for s in plan_shards([str(files[0])], 4000)[:-1]))
    assert len(plan_shards([str(files[1])])) == 1  # 3080 bytes: one shard
    files[1].write_bytes((b"z" * 79 + b"\n") * 60)
    assert len(plan_shards([str(files[1])])) == 5  # 4800 bytes: more than a shard, all in the tail


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_killed_worker_fails_the_run_naming_its_shard_and_leaves_no_temp_files(sig, shared_data, tokenizer_dir,
                                                                                   tmp_path):
    """SIGKILL (the out-of-memory killer) or SIGTERM (from outside: the pool ends the other workers with it too).
    The workers are forked with SIGTERM blocked: one that did not unblock it would go on reading."""
    src = _mixed_input(shared_data, tmp_path / "in.jsonl")
    out = tmp_path / "out" / "rows.jsonl.packed"
    env = {**os.environ, WORKER_HOOK_ENV: f"2:{sig}"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "pack_megatron_sft_jsonl.py"), "--input", str(src),
                           "--output", str(out), "--tokenizer", str(tokenizer_dir("smollm2-135m-instruct")),
                           "--max-seq-length", "1024", "--num-workers", "2", "--shard-bytes", "20000",
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 2, proc.stderr
    if sig == "SIGKILL":
        assert "error: worker process" in proc.stderr and "died (killed by SIGKILL)" in proc.stderr
    else:
        assert proc.stderr.startswith("error: SIGTERM from outside the packer ended a worker process"), proc.stderr
        assert "out-of-memory" not in proc.stderr
    assert f"shard 2 of {src}" in proc.stderr
    assert time.monotonic() - t0 < 200
    assert sorted(os.listdir(out.parent)) == [".rows.jsonl.packed.lock"]


_SIGNAL_AT_FORK = """
import os, signal, sys

def send():  # at the fork of the pool's first worker: the signal is handled inside the at-fork hooks
    frames, f = [], sys._getframe()
    while f is not None:
        frames.append(f.f_code.co_qualname)
        f = f.f_back
    if "LocalEngine.count" in frames and not os.environ.get("SENT"):
        os.environ["SENT"] = "1"
        print("sent at the fork", file=sys.stderr, flush=True)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))

os.register_at_fork(before=send)
from packsft.packing.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_stop_signal_while_the_workers_are_forked_stops_the_run(sig, code, shared_data, tokenizer_dir, tmp_path):
    """Handled while the pool forked, the signal's exception was raised inside Python's at-fork hooks, which ignore
    it: the run published its outputs and exited 0 (or, between two forks, hung at exit on a worker the pool did
    not know of). It is held until the workers are started, then stops the run as anywhere else."""
    src = _mixed_input(shared_data, tmp_path / "in.jsonl")
    out = tmp_path / "out" / "rows.jsonl.packed"
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_AT_FORK, sig, "--input", str(src), "--output", str(out),
                           "--tokenizer", str(tokenizer_dir("smollm2-135m-instruct")), "--max-seq-length", "1024",
                           "--num-workers", "2", "--shard-bytes", "20000", "--no-progress"],
                          capture_output=True, text=True, timeout=240)
    assert "sent at the fork" in proc.stderr
    assert proc.returncode == code, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert sorted(os.listdir(out.parent)) == [".rows.jsonl.packed.lock"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_kill_9_of_the_packer_leaves_no_worker_process(shared_data, tokenizer_dir, tmp_path):
    src = shared_data / "chat" / "gpteacher.messages.jsonl"
    out = tmp_path / "out" / "rows.jsonl.packed"
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "pack_megatron_sft_jsonl.py"), "--input", str(src),
                             "--output", str(out), "--tokenizer", str(tokenizer_dir("smollm2-135m-instruct")),
                             "--max-seq-length", "1024", "--num-workers", "2", "--shard-bytes", "200000",
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
        workers = [int(p.name.split(".")[1]) for p in out.parent.glob(".*.tmp/worker.*")] if out.parent.exists() else []
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert len(workers) == 2, "the workers did not start reading"
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, workers)), f"workers {workers} outlived the killed packer"
