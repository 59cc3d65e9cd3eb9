"""Nothing packsft loads from a checkpoint runs code: a payload planted in any file of a trainer checkpoint
(``iter_*``) or of an imported model folder is refused by name, or the file is never unpickled (issue 40).

The payload writes a marker file when unpickled; every test asserts the marker does not exist after packsft's load
path (resume: :func:`_resume`; ``init_from``, export and LoRA bases: :func:`_load_import`), and the ``.metadata``,
``common.pt`` and ``_extra_state`` tests show that the reader packsft used before (torch's ``FileSystemReader``,
megatron's ``common.pt`` load under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, Transformer Engine's unpickling of its
extra state) runs it.
"""

import io
import operator
import pickle
import re

import pytest
import torch
from distributed_helpers import megatron_optimizer, optimizer_step, parallel_state_1proc  # noqa: F401 - fixture

from packsft.model.config import ModelConfig, read_model_config
from packsft.model.gpt import build_gpt_model
from packsft.model.hf_files import read_hf_config
from packsft.train import checkpoint as ckpt
from packsft.train import checkpoint_files as ckpt_files
from packsft.train.config import OptimizerConfig
from packsft.train.model_checkpoint import base_identity, load_megatron_checkpoint, save_megatron_checkpoint
from packsft.train.safe_checkpoint_read import METADATA_FILE, MetadataUnpickler

TINY = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   vocab_size=128, max_position_embeddings=32)


class _Payload:
    """Unpickling it writes ``marker`` (a planted ``__reduce__`` that runs a command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _Then:
    """Unpickling it runs the payload, then gives ``value``: the wrapped ``.metadata`` of the issue (the load goes
    on normally after the command ran)."""

    def __init__(self, marker, value):
        self.marker, self.value = marker, value

    def __reduce__(self):
        return (operator.getitem, ((_Payload(self.marker), self.value), 1))


def _model():
    torch.manual_seed(0)
    return build_gpt_model(TINY)


@pytest.fixture
def trainer_checkpoint(tmp_path, parallel_state_1proc):  # noqa: F811
    model = _model()
    opt = megatron_optimizer(model, OptimizerConfig(lr=1e-2))
    sum((p.float() ** 2).sum() for p in model.parameters()).backward()
    optimizer_step(opt)                                   # a trainer saves after a step: Adam state exists
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", 1, model, opt,
                                train_state={"state": {"step": 1, "consumed_samples": 4},
                                             "scheduler": {"last_epoch": 1}},
                                loader_state={"sampler_state": {"epoch": 0}}, dp_rank=0, write_loader_state=True)
    return path


@pytest.fixture
def imported(tmp_path, parallel_state_1proc):  # noqa: F811
    return save_megatron_checkpoint(_model(), TINY, tmp_path / "imported", hf_config={"model_type": "llama"})


def _resume(ckpt_dir):
    """The trainer's resume (``checkpoint.resume=auto``): every file of the checkpoint is read."""
    path = ckpt_files.find_resume_checkpoint(ckpt_dir, "auto")
    saved = ckpt_files.load_train_state(path)
    ckpt_files.check_resume_state(saved, path, ("step", "consumed_samples"))
    model = _model()
    opt = megatron_optimizer(model, OptimizerConfig(lr=1e-2))
    ckpt.load_model_and_optimizer(path, model, opt)
    ckpt.load_loader_state(path, 0)
    ckpt.load_rng_state(path, 0, required=True)


def _load_import(folder):
    """``init_from`` / export / a LoRA base: the folder's configs, its identity and its weights."""
    read_model_config(folder)
    read_hf_config(folder)
    base_identity(folder)
    load_megatron_checkpoint(_model(), folder)


def _storage(folder):
    """``(metadata, {fqn: [(MetadataIndex, _StorageInfo)]})`` of a torch_dist folder (read as packsft does)."""
    with open(folder / METADATA_FILE, "rb") as f:
        metadata = MetadataUnpickler(f).load()
    items = {}
    for index, info in metadata.storage_data.items():
        items.setdefault(index.fqn, []).append((index, info))
    return metadata, items


def _plant_items(folder, payload: bytes, pick):
    """Append ``payload`` to the ``.distcp`` file of each storage item ``pick(fqn, info)`` selects and point those
    items at it (rewriting ``.metadata``, which keeps only admitted classes). Returns the files changed."""
    metadata, items = _storage(folder)
    files = set()
    for fqn, entries in items.items():
        for index, info in entries:
            if not pick(fqn, info):
                continue
            file = folder / info.relative_path
            offset = file.stat().st_size
            with open(file, "ab") as f:
                f.write(payload)
            metadata.storage_data[index] = type(info)(relative_path=info.relative_path, offset=offset,
                                                      length=len(payload))
            files.add(info.relative_path)
    with open(folder / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    assert files
    return files


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _refused(name):
    return rf"{re.escape(str(name))}: refused: .*could run code.*nothing from it was executed"


def test_planted_metadata_is_refused_by_name_and_never_runs(trainer_checkpoint, imported, tmp_path):
    """A ``.metadata`` wrapped to run a command, then return the real metadata, ran on every resume before."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "payload_ran"
    for folder, load in ((trainer_checkpoint, lambda: _resume(trainer_checkpoint.parent)),
                         (imported, lambda: _load_import(imported))):
        metadata, _ = _storage(folder)
        (folder / METADATA_FILE).write_bytes(pickle.dumps(_Then(marker, metadata)))
        with pytest.raises(ckpt.CheckpointError, match=_refused(folder / METADATA_FILE)) as err:
            load()
        assert "it references _operator.getitem (not one of the classes torch.distributed.checkpoint" in str(err.value)
        assert not marker.exists()
    FileSystemReader(str(imported)).read_metadata()        # torch's reader (megatron's before): the command runs
    assert marker.exists()


@pytest.mark.parametrize("kind", ["tensor", "object"])
def test_planted_distcp_item_is_refused_by_name_and_never_runs(trainer_checkpoint, tmp_path, kind):
    """Tensor items: torch reads them with weights_only=True; objects (``ShardedObject``: extra state, optimizer
    groups): torch's planner used ``torch.load(weights_only=False)``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    marker = tmp_path / "payload_ran"
    metadata, _ = _storage(trainer_checkpoint)
    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert objects                                            # the layers' _extra_state
    seen = set()

    def first_of_kind(fqn, info):
        if (fqn in objects) != (kind == "object") or seen:
            return False
        seen.add(fqn)
        return True

    (name,) = _plant_items(trainer_checkpoint, _saved([_Payload(marker)]), first_of_kind)
    with pytest.raises(ckpt.CheckpointError, match=_refused(trainer_checkpoint / name)) as err:
        _resume(trainer_checkpoint.parent)
    assert not marker.exists()
    assert "unsupported GLOBAL" in str(err.value), err.value         # names what it refused


def test_every_distcp_file_planted_is_refused(trainer_checkpoint, imported, tmp_path):
    marker = tmp_path / "payload_ran"
    for folder, load in ((trainer_checkpoint, lambda: _resume(trainer_checkpoint.parent)),
                         (imported, lambda: _load_import(imported))):
        for file in sorted(folder.glob("*.distcp")):
            backup = (file.read_bytes(), (folder / METADATA_FILE).read_bytes())
            _plant_items(folder, _saved({"w": _Payload(marker)}),
                         lambda fqn, info, name=file.name: info.relative_path == name)
            with pytest.raises(ckpt.CheckpointError, match=_refused(file)):
                load()
            assert not marker.exists()
            file.write_bytes(backup[0])
            (folder / METADATA_FILE).write_bytes(backup[1])
        load()                                          # restored: loads


def test_extra_state_that_transformer_engine_would_unpickle_is_refused(imported, tmp_path):
    """TE < 2.18 ``pickle.loads`` a non-empty ``_extra_state`` byte tensor in ``load_state_dict``; packsft writes
    none (no FP8), so one is refused before the model sees it."""
    marker = tmp_path / "payload_ran"
    evil = torch.frombuffer(bytearray(pickle.dumps(_Payload(marker))), dtype=torch.uint8)
    _plant_items(imported, _saved([evil]), lambda fqn, info: fqn.endswith("linear_fc1._extra_state/shard_0_1"))
    with pytest.raises(ckpt.CheckpointError, match=rf"{re.escape(str(imported))}: refused: "
                                                   r"model\.decoder\.layers\.0\.mlp\.linear_fc1\._extra_state holds "
                                                   rf"{evil.numel()} bytes .*could run code"):
        _load_import(imported)
    assert not marker.exists()
    pickle.loads(evil.numpy().tobytes())               # what Transformer Engine's set_extra_state does
    assert marker.exists()


def test_planted_common_pt_is_refused_even_when_torch_is_told_to_unpickle(trainer_checkpoint, tmp_path,
                                                                         monkeypatch):
    """megatron loads ``common.pt`` with torch's default, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (a common
    workaround for other tools) turns into a plain unpickle."""
    marker = tmp_path / "payload_ran"
    common = trainer_checkpoint / "common.pt"
    state = torch.load(common, weights_only=True)
    torch.save({**state, "evil": _Payload(marker)}, common)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ckpt.CheckpointError, match=_refused(common)):
        _resume(trainer_checkpoint.parent)
    assert not marker.exists()
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    TorchCommonLoadStrategy().load_common(trainer_checkpoint)    # megatron's own reader: the command runs
    assert marker.exists()


# The files read whole (JSON, text, weights_only tensors): a pickle in place of each is refused or named as not
# what it should be; none is unpickled. weights_fingerprint.json is only a cache (a folder whose file does not
# parse is hashed again), so the load goes on.
TRAINER_FILES = {"train_state.json": "not valid JSON", "metadata.json": "cannot be loaded",
                 "dataloader_dp0.pt": "refused", "rng_rank0.pt": "refused", "common.pt": "refused"}
IMPORT_FILES = {"model_config.json": "", "hf_config.json": "", "metadata.json": "cannot be loaded",
                "common.pt": "refused", "weights_fingerprint.json": None}


def _plant_file(file, marker):
    if file.suffix == ".pt":
        file.write_bytes(_saved({"state": 1, "evil": _Payload(marker)}))
    else:
        file.write_bytes(pickle.dumps(_Payload(marker)))


@pytest.mark.parametrize("name", sorted(TRAINER_FILES))
def test_each_planted_trainer_file_is_refused_by_name(trainer_checkpoint, tmp_path, name):
    marker = tmp_path / "payload_ran"
    _plant_file(trainer_checkpoint / name, marker)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.*{TRAINER_FILES[name]}"):
        _resume(trainer_checkpoint.parent)
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(IMPORT_FILES))
def test_each_planted_import_file_is_refused_by_name_or_unused(imported, tmp_path, name):
    marker = tmp_path / "payload_ran"
    _plant_file(imported / name, marker)
    if IMPORT_FILES[name] is None:
        _load_import(imported)
    else:
        with pytest.raises(ValueError, match=rf"{re.escape(name)}.*{IMPORT_FILES[name]}"):
            _load_import(imported)
    assert not marker.exists()


def test_latest_holding_a_pickle_is_named(trainer_checkpoint, tmp_path):
    marker = tmp_path / "payload_ran"
    _plant_file(trainer_checkpoint.parent / ckpt_files.LATEST, marker)
    with pytest.raises(ckpt.CheckpointError, match="latest should be a file naming the newest checkpoint"):
        _resume(trainer_checkpoint.parent)
    assert not marker.exists()


def test_every_file_of_both_folders_is_covered(trainer_checkpoint, imported):
    """The tests above plant a payload in each file the folders hold (a new file needs a test)."""
    covered = set(TRAINER_FILES) | set(IMPORT_FILES) | {METADATA_FILE}
    for folder in (trainer_checkpoint, imported):
        names = {p.name for p in folder.iterdir() if not p.name.endswith(".distcp")}
        assert names <= covered, names - covered
