"""bench/pack.py end to end on two small real files: the tables it prints and its count check."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_prints_throughput_per_file_and_for_all_files_with_the_counts_checked(tmp_path, shared_data,
                                                                                    tokenizer_dir):
    data = tmp_path / "chat"
    data.mkdir()
    for name in ("gsm8k_test.messages.jsonl", "hh_rlhf_harmless_base_test.messages.jsonl"):
        with open(shared_data / "chat" / name, encoding="utf-8") as src:
            (data / name).write_text("".join(line for _, line in zip(range(40), src)), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "pack.py"), "--data", str(data), "--tokenizers",
                           str(tokenizer_dir("smollm2-135m-instruct")), "--max-seq-lens", "4096",
                           "--context-parallel-sizes", "1", "--throughput-limit", "30", "--repeat", "1",
                           "--workers", "1", "2", "--cache", ""], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MISMATCH" not in proc.stdout
    cases = {}
    for line in proc.stdout.splitlines():
        name = "all files (one run)" if line.startswith("all files (one run)") else line.split(" ")[0]
        fields = line[len(name):].split()
        if name.startswith(("gsm8k", "hh_rlhf", "all files")) and len(fields) >= 15:  # the throughput table
            cases[name, int(fields[2])] = fields
    assert {n for n, _ in cases} == {"gsm8k_test.messages.jsonl", "hh_rlhf_harmless_base_test.message",
                                     "all files (one run)"}, proc.stdout
    for (name, procs), fields in cases.items():
        assert len(fields) == (15 if procs == 1 else 17), (name, fields)  # x1 (paired) only with 2 processes
        assert float(fields[4]) > 0 and float(fields[11]) > float(fields[10]) > 0  # load s; e2e > wall ratio


def test_bench_input_it_cannot_use_and_bad_counts_are_error_lines(tmp_path, shared_data, tokenizer_dir, monkeypatch,
                                                                  capsys):
    data = tmp_path / "chat"
    data.mkdir()
    with open(shared_data / "chat" / "gsm8k_test.messages.jsonl", encoding="utf-8") as src:
        head = "".join(line for _, line in zip(range(3), src))
    (data / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + head.encode() + b"\n{not json\n")  # a mark and a blank: fine
    bench = [sys.executable, str(REPO / "bench" / "pack.py"), "--data", str(data), "--tokenizers",
             str(tokenizer_dir("smollm2-135m-instruct")), "--cache", ""]
    proc = subprocess.run(bench + ["--efficiency-only"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        f"error: {data / 'a.jsonl'}:5: not valid JSON: Expecting property name enclosed in double quotes (column 2)"
    # the counts are checked by main() itself: called in this process (the error exit above went through __main__)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # what importing bench/pack.py sets; put back after
    spec = importlib.util.spec_from_file_location("bench_pack", REPO / "bench" / "pack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    for flag in ("--workers", "--repeat", "--throughput-limit"):
        rc = module.main(bench[2:] + [flag, "0"])
        assert (rc, capsys.readouterr().err.strip()) == (2, f"error: {flag} must be at least 1, got 0")
