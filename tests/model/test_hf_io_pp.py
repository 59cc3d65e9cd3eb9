"""HF conversion under pipeline parallelism (2 gloo processes): import shards by stage (2 forked ranks), export
gathers the stages (one 2-process spawn of every family's export), and the checkpoint does not depend on the layout
(PP=2 written -> PP=1 read and vice versa).

Models: the tiny random HF configs of ``tests/model/test_hf_io.py`` with 4 layers (2 per stage): Llama with tied
embeddings (the last stage holds Megatron's copy of the embedding) and Qwen2 untied with a QKV bias. Trainer:
``checkpoint.init_from`` of a PP=2 import, first loss at PP=2 and PP=1 (``tests/train/test_init_from.py``'s rows).
"""

from pathlib import Path

import pytest
import torch
from distributed_helpers import parallel_state_1proc, run_distributed, tool_forked  # noqa: F401 - fixture
from test_hf_io import LENGTHS, VOCAB, hf_model, megatron_logits
from test_init_from import (
    convert_in_process,
    convert_worker,
    hf_row_loss,
    pack_and_save_hf,
    records,
    train_worker,
    write_config,
)
from transformers import AutoModelForCausalLM

from packsft.data.context_parallel import make_packed_seq_params
from packsft.data.dataset import PackedSFTDataset
from packsft.model.config import read_model_config
from packsft.model.gpt import build_gpt_model
from packsft.model.hf_files import load_hf_checkpoint
from packsft.train.model_checkpoint import load_megatron_checkpoint

FAMILIES = ("llama", "qwen2")                                # tied; untied with QKV bias
PP2 = ("--pipeline-model-parallel-size", "2")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _import_pp2(hf: Path, out: Path) -> None:
    """``tools/convert_checkpoint.py import --hf hf --out out`` at PP=2: its ``main`` on 2 forked ranks
    (:func:`distributed_helpers.tool_forked`; dist_checkpointing's save starts processes, which a daemon cannot)."""
    tool_forked("convert_checkpoint", "import", "--hf", hf, "--out", out, *PP2, nproc=2,
                env={"HF_HUB_OFFLINE": "1"}, timeout_s=400)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, parallel_state_1proc):  # noqa: F811
    """Per family: its folder and 4-layer HF model ``src``, imported at PP=2 (2 forked ranks) and at PP=1, the PP=1
    import exported at PP=2 (one 2-process spawn for all families) and the PP=2 import exported at PP=1."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        original = hf_model(family, seed=21, num_hidden_layers=4)
        original.save_pretrained(folder / "src")
        _import_pp2(folder / "src", folder / "mcore_pp2")
        convert_in_process("import", "--hf", folder / "src", "--out", folder / "mcore_pp1")
        convert_in_process("export", "--megatron", folder / "mcore_pp2", "--out", folder / "hf_pp1")
        out[family] = (folder, original)
    run_distributed(convert_worker, 2, *[("export", "--megatron", f / "mcore_pp1", "--out", f / "hf_pp2", *PP2)
                                         for f, _ in out.values()], timeout_s=400)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_import_loads_at_pp1_and_pp2_export_equals_pp1(converted, family):
    folder, original = converted[family]
    _, part = load_hf_checkpoint(folder / "src", keep=lambda name: name.startswith("model.layers.3."))
    assert part.keys() == {k for k in original.state_dict() if k.startswith("model.layers.3.")}   # a stage's read

    # PP=2 import -> PP=1 model: logits of a packed row equal transformers' per conversation
    cfg = read_model_config(folder / "mcore_pp2")
    megatron = build_gpt_model(cfg).eval()
    load_megatron_checkpoint(megatron, folder / "mcore_pp2")
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=torch.Generator().manual_seed(4))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    packed = megatron_logits(megatron, tokens, position_ids, make_packed_seq_params(cu, max(LENGTHS)))
    with torch.no_grad():
        diff = max((packed[s:e] - original(tokens[:, s:e]).logits[0]).abs().max().item()
                   for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
    print(family, "pp=2 import at pp=1: max |logit - transformers|", diff)
    assert diff < 1e-4

    # export at PP=2 (of the PP=1 import) == export at PP=1 (of the PP=2 import), file by file, bit for bit
    names = sorted(p.name for p in (folder / "hf_pp1").iterdir())
    assert names == sorted(p.name for p in (folder / "hf_pp2").iterdir()) and "model.safetensors" in names
    for name in names:
        assert (folder / "hf_pp2" / name).read_bytes() == (folder / "hf_pp1" / name).read_bytes(), name
    exported = AutoModelForCausalLM.from_pretrained(folder / "hf_pp2", dtype=torch.float32)
    assert exported.state_dict().keys() == original.state_dict().keys()
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in original.state_dict().items())


@pytest.fixture(scope="module")
def setup_pp2(tmp_path_factory, shared_data, tokenizer_dir):
    """``tests/train/test_init_from.py``'s rows and tiny tied Llama (2 layers: 1 per stage), imported at PP=2."""
    setup = pack_and_save_hf(tmp_path_factory.mktemp("init_from_pp2"), shared_data, tokenizer_dir)
    _import_pp2(setup["dir"] / "hf", setup["imported"])
    return setup


def test_init_from_a_pp2_import_gives_the_same_first_loss_at_pp2_and_pp1(setup_pp2):
    """The PP=2 import of ``setup_pp2``; one step of ``tools/train.py``'s ``main`` at PP=2 (a 2-process spawn) and at
    PP=1 (1 process) from it (megatron optimizer: PP needs it; no checkpoint: none is read)."""
    setup, imported = setup_pp2, setup_pp2["imported"]
    config = write_config(setup, "pp_init")
    common = (f"checkpoint.init_from={imported}", "optimizer.backend=megatron", "train.train_steps=1",
              "checkpoint.save_at_end=false")
    first = {}
    for pp in (2, 1):
        out = setup["dir"] / f"pp{pp}_init"
        run_distributed(train_worker, pp, ("--config", config, *common, f"logging.output_dir={out}",
                                           f"parallel.pipeline_model_parallel_size={pp}"), timeout_s=400)
        summary, = records(out, "summary")
        assert summary["initialized_from"] == str(imported) and summary["pipeline_model_parallel_size"] == pp
        first[pp] = records(out, "train")[0]
    row = PackedSFTDataset(setup["rows"], setup["tokenizer"], "chat-template", 256)[0]
    expected = hf_row_loss(setup["hf"], row)
    print("first loss pp=2", first[2]["loss"], "pp=1", first[1]["loss"], "transformers", expected)
    assert first[2]["trained_tokens"] == first[1]["trained_tokens"] == row["num_trained_tokens"]
    assert abs(first[2]["loss"] - first[1]["loss"]) < 1e-6
    assert first[1]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
