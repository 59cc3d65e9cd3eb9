"""Checkpoint folders, without torch: names, ``latest``, listing, retention, the small JSON files, free space.

Layout of ``<checkpoint_dir>``::

    latest                      # text: the name of the newest complete checkpoint, e.g. "iter_0000020"
    iter_0000020/
      .metadata, __*_*.distcp   # torch_dist shards of {"model": ..., "optimizer": ...} (dist_checkpointing)
      common.pt, metadata.json  # dist_checkpointing common state (optimizer param_groups, common_step)
      train_state.json          # rank 0: step and counters, scheduler, config, layout (+ lora_base, init_from)
      dataloader_dp{d}.pt       # one per data-parallel rank d (written by its TP=CP=0 rank): loader_state_dict
      rng_rank{r}.pt            # one per global rank r: torch, numpy (as tensors), python (JSON text), CUDA RNG states

Atomicity: every rank writes into ``iter_XXXXXXX.tmp``; after a barrier rank 0 renames it to ``iter_XXXXXXX`` and
then rewrites ``latest`` through a temp file + ``os.replace`` (:func:`publish_checkpoint`). A process killed during a
save leaves a ``.tmp`` folder that is never read (:func:`remove_partial_checkpoints` deletes it when the next run
starts) and ``latest`` still names the previous complete checkpoint. With ``keep_last`` rank 0 then prunes older
complete checkpoints (:func:`prune_checkpoints`).

Space: :func:`check_checkpoint_dir` checks before step 1 that the folder is writable and has room for one checkpoint
(``packsft.train.checkpoint.checkpoint_bytes_estimate``); a save that fails for lack of space raises
:class:`CheckpointSpaceError` (:func:`space_error`).

The tensors (``dist_checkpointing`` shards, loader and RNG states) are written and read by
:mod:`packsft.train.checkpoint`; this module imports no torch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from packsft.io import atomic_open, check_writable_dir, read_json_object, replace_dir


class CheckpointError(ValueError):
    """A checkpoint packsft refuses to read: the old pickled format, a file whose contents could run code, a state
    file that is not plain data, or a damaged ``dist_checkpointing`` file."""


LATEST = "latest"
TRAIN_STATE = "train_state.json"
OLD_TRAIN_STATE = "train_state.pt"
"""The pickled train state of checkpoints written before ``train_state.json``; such checkpoints are refused."""


LORA_BASE = "lora_base"
"""``train_state.json`` key of an adapters-only LoRA checkpoint: the base's ``{"path", "fingerprint"}``."""
INIT_FROM = "init_from"
"""``train_state.json`` key: the absolute path of ``checkpoint.init_from`` (export reads its ``hf_config.json``)."""


class CheckpointDirError(ValueError):
    """``checkpoint.dir`` cannot take a checkpoint: not writable, or too little free space (found before step 1)."""


class CheckpointSpaceError(OSError):
    """A checkpoint write failed for lack of space (``errno.ENOSPC``/``EDQUOT``, possibly wrapped by a dependency)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_checkpoint_dir(ckpt_dir: str | Path, need_bytes: int) -> None:
    """Create ``ckpt_dir`` if needed, write and remove a probe file, and check its free space.

    Raises:
        CheckpointDirError: the folder cannot be created or written, or has less than ``need_bytes`` free (the
            message gives both sizes).
    """
    ckpt_dir = Path(ckpt_dir)
    check_writable_dir(ckpt_dir, "checkpoint.dir", CheckpointDirError,
                       hint="; set checkpoint.dir to a writable folder (checked before step 1)")
    free = shutil.disk_usage(ckpt_dir).free
    if free < need_bytes:
        raise CheckpointDirError(
            f"checkpoint.dir {ckpt_dir} has {_gib(free)} free but one checkpoint needs about {_gib(need_bytes)} "
            "(weights + optimizer state); free space or set checkpoint.dir to a larger disk "
            "(checkpoint.keep_last prunes old checkpoints)")


_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "unexpected pos")


def _out_of_space(err: BaseException) -> BaseException | None:
    """The error in ``err``'s chain (causes, contexts, torch DCP's per-rank ``failures``) that says the disk is full.

    ``unexpected pos`` is what torch's zip writer reports when a ``torch.save`` hits a full disk.
    """
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(t in str(e).lower() for t in _NO_SPACE_TEXT):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                todo += [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]
    return None


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint after optimizer step ``step``: ``iter_0000020``."""
    return f"iter_{step:07d}"


def space_error(err: BaseException, ckpt_dir: Path, tmp: Path, need_bytes: int | None) -> CheckpointSpaceError | None:
    """A save's error ``err`` (writing into ``tmp``) as a :class:`CheckpointSpaceError` when its chain says the disk
    is full, naming the folder, the free and needed space and the checkpoint ``latest`` still names; else None
    (also for ``KeyboardInterrupt`` and ``SystemExit``)."""
    cause = None if isinstance(err, KeyboardInterrupt | SystemExit) else _out_of_space(err)
    if cause is None:
        return None
    latest = ckpt_dir / LATEST
    kept = f"{latest.read_text().strip()} (latest) is intact" if latest.is_file() else "no earlier checkpoint exists"
    need = f"one checkpoint needs about {_gib(need_bytes)}, " if need_bytes else ""
    try:
        free = f"{_gib(shutil.disk_usage(ckpt_dir).free)} free"
    except OSError:
        free = "free space unknown"
    reason = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else type(cause).__name__
    return CheckpointSpaceError(
        errno.ENOSPC, f"no space left for checkpoint {tmp} ({reason}): {need}{free} on {ckpt_dir}; free space or "
        f"set checkpoint.dir to a larger disk (checkpoint.keep_last prunes old checkpoints), then resume; {kept}; "
        f"the partial {tmp.name} can be deleted")


def publish_checkpoint(ckpt_dir: Path, tmp: Path, final: Path, keep_last: int = 0) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older folder of that name), point ``latest`` at it, then prune."""
    replace_dir(tmp, final)
    with atomic_open(ckpt_dir / LATEST) as f:
        f.write(final.name + "\n")
    if keep_last:
        prune_checkpoints(ckpt_dir, keep_last)


_CHECKPOINT_NAME = re.compile(r"iter_(\d{7,})")
_DELETING = ".deleting"


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` highest-step complete checkpoints up to the one ``latest`` names (never it;
    those past it, of a run a resume from an earlier checkpoint does not continue, are left to be replaced).

    Complete: an ``iter_XXXXXXX`` folder with ``train_state.json`` (``.tmp`` folders and other files are left alone).
    Each folder is first renamed to a hidden ``.iter_XXXXXXX.deleting`` (atomic), then removed, so no reader sees
    a half-deleted checkpoint; leftovers of a killed prune are removed by the next one.

    Returns:
        The checkpoints removed.
    """
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / LATEST
    pinned = latest.read_text().strip() if latest.is_file() else None
    complete = complete_checkpoints(ckpt_dir)
    if pinned is not None and step_of(pinned) is not None:   # past `latest`: a run this one does not continue,
        complete = [p for p in complete if step_of(p) <= step_of(pinned)]  # replaced as its steps are saved again
    keep = {p.name for p in complete[-keep_last:]} | {pinned}
    removed = []
    for path in complete:
        if path.name not in keep:
            trash = ckpt_dir / f".{path.name}{_DELETING}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(path, trash)
            removed.append(path)
    for trash in ckpt_dir.glob(f".iter_*{_DELETING}"):
        shutil.rmtree(trash, ignore_errors=True)
    return removed


def remove_partial_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Delete the ``iter_XXXXXXX.tmp`` folders of saves that were killed (never published: ``latest`` and every
    complete checkpoint are untouched); call on one rank, before any save of this run.

    Returns:
        The folders removed.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    partial = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.suffix == ".tmp"
                     and _CHECKPOINT_NAME.fullmatch(p.stem))
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The published ``iter_XXXXXXX`` folders of ``ckpt_dir`` that hold ``train_state.json``, lowest step first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if step_of(p) is not None and (p / TRAIN_STATE).is_file()),
                  key=step_of)


def find_resume_checkpoint(ckpt_dir: str | Path, resume: str) -> Path | None:
    """Resolve ``checkpoint.resume``: ``none`` -> None; else a path, or for ``auto`` the checkpoint ``latest`` names
    in ``ckpt_dir`` (without ``latest``: the highest-step complete checkpoint, as a save killed between publishing
    its folder and writing ``latest`` leaves; None when there is none).

    Raises:
        FileNotFoundError: ``latest`` names a missing folder, or an explicit path has no ``train_state.json``.
        CheckpointError: ``latest`` is not a file naming an ``iter_XXXXXXX`` folder, or the checkpoint has the old
            pickled ``train_state.pt`` (:func:`check_checkpoint_format`).
    """
    if resume == "none":
        return None
    if resume == "auto":
        latest = Path(ckpt_dir) / LATEST
        if not (latest.exists() or latest.is_symlink()):
            complete = complete_checkpoints(ckpt_dir)
            return complete[-1] if complete else None
        try:
            name = latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
            shown = f"holds {name!r}" if name is not None else "is not a file"
        except (OSError, UnicodeDecodeError) as err:
            name, shown = None, f"cannot be read as text ({err})"
        if name is None or not _CHECKPOINT_NAME.fullmatch(name):
            raise CheckpointError(f"{latest} should be a file naming the newest checkpoint of {ckpt_dir} (e.g. "
                                  f"iter_0000100), but {shown}; "
                                  "resume a checkpoint with checkpoint.resume=<path>, or remove it to resume the "
                                  "newest complete checkpoint")
        path = Path(ckpt_dir) / name
    else:
        path = Path(resume)
    check_checkpoint_format(path)
    if not (path / TRAIN_STATE).is_file():
        hint = "" if path.exists() else " (checkpoint.resume is 'auto', 'none' or a checkpoint folder)"
        raise FileNotFoundError(f"checkpoint {path} (checkpoint.resume={resume!r}) is missing or incomplete: "
                                f"no {TRAIN_STATE}{hint}")
    return path


def step_of(path: str | Path) -> int | None:
    """The step of a checkpoint folder named ``iter_XXXXXXX``, else None."""
    m = _CHECKPOINT_NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def check_fresh_start(resume: str, output_dir: str | Path, ckpt_dir: str | Path) -> None:
    """With ``checkpoint.resume=none``, refuse a run folder that holds an earlier run.

    An earlier run: a ``"kind": "train"`` record in ``<output_dir>/metrics.jsonl``, ``<ckpt_dir>/latest``, or a
    complete checkpoint in ``<ckpt_dir>``.
    Starting over there would append a second run to ``metrics.jsonl`` (and its plot) and mix checkpoints.

    Raises:
        CheckpointDirError: naming what was found and the ways out.
    """
    if resume != "none":
        return
    metrics, latest = Path(output_dir) / "metrics.jsonl", Path(ckpt_dir) / LATEST
    found = []
    if metrics.is_file():
        with open(metrics, encoding="utf-8", errors="replace") as f:
            if any('"kind": "train"' in line for line in f):
                found.append(f"{metrics} has training records")
    if latest.is_file():
        found.append(f"{latest} names {latest.read_text(encoding='utf-8', errors='replace').strip()!r}")
    elif complete := complete_checkpoints(ckpt_dir):
        found.append(f"{ckpt_dir} holds {', '.join(p.name for p in complete)}")
    if found:
        raise CheckpointDirError(
            f"checkpoint.resume=none but the run folder holds an earlier run ({'; '.join(found)}); starting over "
            "there would mix two runs in metrics.jsonl and the checkpoints. Set logging.output_dir (and "
            "checkpoint.dir) to a new folder, remove the old run, or resume it (checkpoint.resume=auto)")


def check_checkpoint_format(path: str | Path) -> None:
    """Refuse a checkpoint of the old format (a pickled ``train_state.pt``, no ``train_state.json``).

    Raises:
        CheckpointError: saying why (pickled files can run code when loaded) and what to do instead.
    """
    path = Path(path)
    if (path / OLD_TRAIN_STATE).is_file() and not (path / TRAIN_STATE).is_file():
        raise CheckpointError(
            f"checkpoint {path} has the old format (a pickled {OLD_TRAIN_STATE}, RNG and loader files that can run "
            f"code when loaded); packsft no longer reads it. Start over (checkpoint.resume=none in a new "
            "logging.output_dir), or keep its weights: tools/convert_checkpoint.py export --megatron "
            f"{path} --config <run>/config.yaml, then import that folder and train with checkpoint.init_from")


def load_train_state(path: str | Path) -> dict[str, Any]:
    """``train_state.json`` of a checkpoint (``state`` counters, ``scheduler``, ``config`` YAML text, ``layout``).

    Raises:
        CheckpointError: an old-format checkpoint, or the file is not a JSON object.
    """
    check_checkpoint_format(path)
    file = Path(path) / TRAIN_STATE
    saved = read_json_object(file, CheckpointError)
    if not isinstance(saved.get("state"), dict):
        raise CheckpointError(f"{file}: not a packsft train state (a JSON object with a 'state' object)")
    return saved


def check_resume_state(saved: dict[str, Any], path: str | Path, counters: tuple[str, ...]) -> None:
    """Refuse a train state (:func:`load_train_state`) a resume cannot continue from: ``state.step`` or
    ``state.consumed_samples`` missing, one of ``counters`` in ``state``, a value of ``state.source_trained_tokens``
    or ``scheduler.last_epoch`` not an integer >= 0, a step other than the ``iter_XXXXXXX`` folder's, or a
    ``layout`` that is not an object.

    Raises:
        CheckpointError: naming the file and the field.
    """
    file = Path(path) / TRAIN_STATE
    scheduler = saved.get("scheduler")
    values = {f"state.{k}": saved["state"][k] for k in counters if k in saved["state"]}
    wrong = [f"state.{k} is missing" for k in ("step", "consumed_samples") if k not in saved["state"]]
    if isinstance(scheduler, dict):
        values["scheduler.last_epoch"] = scheduler.get("last_epoch")
    else:
        wrong.append("scheduler is missing" if scheduler is None else f"scheduler is {json.dumps(scheduler)}")
    by_source = saved["state"].get("source_trained_tokens", {})
    values.update({f"state.source_trained_tokens.{k}": v for k, v in by_source.items()}
                  if isinstance(by_source, dict) else {"state.source_trained_tokens": by_source})
    wrong += [f"{k} is {json.dumps(v)}, not an integer >= 0" for k, v in values.items()
              if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    step = step_of(path)
    if step is not None and saved["state"].get("step") not in (None, step) and not wrong:
        wrong.append(f"state.step is {saved['state']['step']} in the checkpoint of step {step}")
    if not isinstance(saved.get("layout", {}), dict):
        wrong.append(f"layout is {json.dumps(saved['layout'])}, not an object")
    if wrong:
        raise CheckpointError(f"{file}: not a packsft train state ({'; '.join(wrong)}); the checkpoint is damaged: "
                              "resume an earlier one with checkpoint.resume=<path>")
