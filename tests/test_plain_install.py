"""A plain install runs the whole path: a second venv with only ``pip install -e .`` (the CPU constraints for versions,
no extras) imports a tiny HF Llama, packs, trains with a checkpoint at every step, stops, resumes and exports, each
tool under a time limit (a missing dependency of a library packsft drives hung the first checkpoint: issue 40).

torch comes first, from where pip is configured to find the pinned CPU build, as ``make setup`` installs it
(``TORCH_INDEX``: the same extra index as the Makefile's). Nothing here reads ``../shared/data`` (inputs:
``tiny_offline``). Opt out with ``PACKSFT_SKIP_PLAIN_INSTALL=1`` (e.g. a machine without a package index).
A fast test checks that every third-party module packsft and its tools import is a declared dependency or extra.
"""

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tiny_offline import MAX_SEQ_LEN, write_inputs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "requirements" / "constraints-cpu.txt"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
ENV.pop("PYTHONPATH", None)
ENV.pop("VIRTUAL_ENV", None)
ENV.pop("PYTHONDONTWRITEBYTECODE", None)   # else each tool run compiles torch's and megatron's sources again

RUNTIME_ONLY = {"psutil": "megatron-core's dist_checkpointing file writer (not declared by megatron-core)"}
"""Distributions a library packsft drives needs at run time without declaring them."""


def imported_modules(*folders: str) -> dict[str, str]:
    """Top-level third-party modules imported anywhere in ``folders`` (absolute imports), with one file each."""
    found = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("packsft", "__future__"):
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_every_import_and_runtime_need_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    extras = {canonicalize_name(Requirement(r).name) for reqs in project["optional-dependencies"].values()
              for r in reqs}
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module, where in imported_modules("packsft", "tools").items():
        names = {canonicalize_name(d) for d in dists.get(module, [module])}   # not installed: its own name
        if not names & (base | extras):
            missing.append(f"{module} ({where}; distribution {sorted(names)})")
    missing += [f"{name}: {why}" for name, why in RUNTIME_ONLY.items() if name not in base]
    assert not missing, "imported or needed but not declared in pyproject.toml: " + "; ".join(missing)


def run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository; a non-zero exit or a run past ``timeout`` seconds fails with its output."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd[:4])} ... ran past {timeout} s:\n{(err.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def plain_python(tmp_path_factory) -> str:
    """The python of a fresh venv holding the CPU torch and ``pip install -e .`` (no extras)."""
    venv = tmp_path_factory.mktemp("plain") / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    # --no-compile: a .pyc is written when its module is first imported, not for the thousands nothing here imports
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "-c", str(CONSTRAINTS)]
    index = ["--extra-index-url", os.environ["TORCH_INDEX"]] if os.environ.get("TORCH_INDEX") else []
    run([*pip, *index, "torch"], timeout=600)
    run([*pip, "-e", str(REPO)], timeout=600)
    return str(venv / "bin" / "python")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PACKSFT_SKIP_PLAIN_INSTALL") == "1", reason="PACKSFT_SKIP_PLAIN_INSTALL=1")
def test_plain_install_runs_import_pack_train_resume_export(plain_python, tmp_path):
    py = plain_python
    extras = run([py, "-c", "import importlib.util as u; print([m for m in ('peft', 'gguf', 'datasets', 'ray', "
                            "'pytest') if u.find_spec(m)])"], timeout=60)
    assert extras.stdout.strip() == "[]", f"not a plain install: {extras.stdout}"
    run([py, "-m", "pip", "check"], timeout=120)
    inputs = write_inputs(tmp_path / "inputs")
    imported, rows, out = tmp_path / "imported", tmp_path / "rows.jsonl.packed", tmp_path / "run"

    run([py, "tools/convert_checkpoint.py", "import", "--hf", str(inputs["hf"]), "--out", str(imported)], timeout=240)
    run([py, "tools/pack_megatron_sft_jsonl.py", "--input", str(inputs["chats"]), "--output", str(rows),
         "--tokenizer", str(inputs["tokenizer"]), "--prompt-format", "identity", "--max-seq-length", str(MAX_SEQ_LEN)],
        timeout=180)
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"train_path": str(rows), "tokenizer": str(inputs["tokenizer"]), "prompt_format": "identity",
                 "max_seq_len": MAX_SEQ_LEN},
        "loader": {"sampler": "sequential"},
        "train": {"global_batch_size": 1, "train_steps": 3},
        "checkpoint": {"init_from": str(imported), "save_interval": 1},
        "logging": {"output_dir": str(out), "progress": False}}))   # tensorboard on (the default)
    train = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "tools/train.py",
             "--config", str(config)]
    run([*train, "train.stop_at_step=2"], timeout=300)
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    run(train, timeout=300)
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
    summaries = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "summary"]
    assert [Path(r["resumed_from"]).name if r["resumed_from"] else None for r in summaries] == [None, "iter_0000002"]

    exported = tmp_path / "exported"
    run([py, "tools/convert_checkpoint.py", "export", "--megatron", str(out / "checkpoints" / "iter_0000003"),
         "--config", str(out / "config.yaml"), "--hf-config", str(imported / "hf_config.json"),
         "--tokenizer", str(inputs["tokenizer"]), "--out", str(exported)], timeout=240)
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 32
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
