"""The packer's command line is generated from PackConfig: every field has its flag, every default is the field's."""

import dataclasses
import re

from packsft.packing.cli import build_parser, parse_args
from packsft.packing.config import PackConfig

REQUIRED = ["--input", "a.jsonl", "--output", "o.jsonl.packed", "--tokenizer", "t", "--max-seq-length", "64"]


def test_every_field_has_a_flag_and_the_parsed_defaults_are_the_fields():
    fields = dataclasses.fields(PackConfig)
    assert all(f.metadata.get("flags") for f in fields)
    given = {"inputs": ["a.jsonl"], "output": "o.jsonl.packed", "tokenizer": "t", "max_seq_len": 64}
    assert parse_args(REQUIRED) == PackConfig(**given)
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    assert sorted(required) == sorted(given)


def test_flags_that_make_a_field_from_others():
    cfg = parse_args([*REQUIRED, "--tensor-model-parallel-size", "4", "--no-token-cache", "--no-progress"])
    assert (cfg.sequence_parallel_size, cfg.token_cache, cfg.progress) == (1, False, False)  # TP counts only with SP
    sp = parse_args([*REQUIRED, "--tensor-model-parallel-size", "4", "--sequence-parallel"])
    assert sp.sequence_parallel_size == 4
    assert parse_args([*REQUIRED, "--format", "alpaca"]).record_format == "alpaca"


def test_the_help_lists_the_flags_in_field_order():
    text = build_parser().format_help()
    flags = [flag for f in dataclasses.fields(PackConfig) for flag, _ in f.metadata["flags"]]
    positions = [re.search(rf"^  {flag}(?![\w-])", text, re.M).start() for flag in flags]
    assert positions == sorted(positions) and len(flags) == 34
