"""Image-text data made offline: coloured shapes drawn with PIL, conversations about them in the NeMo-RL SFT guide's
Energon format (shards + ``energon prepare``), and a tiny LLaVA-1.5 processor folder.

Used by the tests (``from examples.shapes_dataset import ...``) and from a shell, with any Hugging Face tokenizer
folder (``configs/tiny_llava_cpu.yaml`` expects SmolLM2's, which ``make demo`` extracts to
``out/demo/smollm2-tokenizer``)::

    python examples/shapes_dataset.py out/shapes --tokenizer out/demo/smollm2-tokenizer
    # -> out/shapes/ds (the Energon dataset), out/shapes/processor (the LLaVA processor folder)
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

SIZE = 64
"""Side of each drawn image in pixels."""
ORDINALS = ("first", "second", "third")
"""Member name parts of a sample's images: ``KEY.first.png``, ``KEY.second.png``."""


def draw_shape(shape: str, colour: str, size: int = SIZE, background: str = "white") -> bytes:
    """A PNG (bytes) of one filled ``shape`` (``circle``, ``square``, ``triangle``) in ``colour`` (a PIL colour
    name) on ``background``, ``size`` x ``size`` pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), background)
    draw, m = ImageDraw.Draw(image), size // 8
    box = (m, m, size - m, size - m)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(size // 2, m), (size - m, size - m), (m, size - m)], fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r} (circle, square, triangle)")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _user(images: int, text: str) -> dict:
    """A user message of ``images`` image parts (media_index counted by :func:`_sample`) and one text part."""
    return {"role": "user", "content": [*({"type": "image", "media_index": None} for _ in range(images)),
                                        {"type": "text", "text": text}]}


def _sample(key: str, messages: list[dict], shapes: list[tuple[str, str]]) -> tuple[str, dict, dict[str, bytes]]:
    """``(key, record, members)``: the image parts numbered in order, one PNG member per shape."""
    count = 0
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] == "image":
                part["media_index"], count = count, count + 1
    assert count == len(shapes), (key, count, shapes)
    names = [f"{key}.{ORDINALS[k]}.png" for k in range(len(shapes))]
    record = {"messages": messages, "media": [{"type": "image", "member": n} for n in names], "tools": None}
    return key, record, {n: draw_shape(*s) for n, s in zip(names, shapes)}


def conversations() -> list[tuple[str, dict, dict[str, bytes]]]:
    """Eight samples ``(key, record, members)``: one image each (colour, shape), two with two images, one
    multi-turn, one text-only (no media); keys ``000000`` ...."""
    one = [("circle", "red", "It is red.", "A circle."), ("square", "blue", "It is blue.", "A square."),
           ("triangle", "green", "It is green.", "A triangle."), ("circle", "orange", "It is orange.", "A circle.")]
    out = [_sample(f"{i:06d}", [_user(1, "What colour is the shape?"), {"role": "assistant", "content": colour}],
                   [(shape, name)]) for i, (shape, name, colour, _) in enumerate(one[:2])]
    out.append(_sample("000002", [_user(1, "What shape is this?"), {"role": "assistant", "content": one[2][3]}],
                       [one[2][:2]]))
    out.append(_sample("000003", [_user(2, "How many shapes are in the two pictures?"),
                                  {"role": "assistant", "content": "Two: a red circle and a blue square."}],
                       [("circle", "red"), ("square", "blue")]))
    out.append(_sample("000004", [
        {"role": "system", "content": "You describe pictures briefly."},
        _user(1, "What colour is the shape?"), {"role": "assistant", "content": one[3][2]},
        {"role": "user", "content": "And what shape is it?"}, {"role": "assistant", "content": one[3][3]},
        _user(1, "Is this one the same colour?"), {"role": "assistant", "content": "No, this one is green."}],
        [one[3][:2], ("square", "green")]))
    out.append(_sample("000005", [
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "media_index": None},
                                     {"type": "text", "text": "with"}, {"type": "image", "media_index": None}]},
        {"role": "assistant", "content": "A yellow triangle, then a purple circle."}],
        [("triangle", "yellow"), ("circle", "purple")]))
    out.append(("000006", {"messages": [{"role": "user", "content": "Which colour do blue and yellow make?"},
                                        {"role": "assistant", "content": "Green."}], "media": [], "tools": None}, {}))
    out.append(_sample("000007", [_user(1, "How many shapes?"), {"role": "assistant", "content": "One."}],
                       [("square", "red")]))
    return out


def write_shard(path: Path, samples: list[tuple[str, dict, dict[str, bytes]]]) -> None:
    """A WebDataset shard: each sample's record as ``KEY.json``, then its members."""
    with tarfile.open(path, "w") as tar:
        for key, record, members in samples:
            for name, data in [(f"{key}.json", json.dumps(record, ensure_ascii=False).encode()), *members.items()]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def prepare(folder: Path, shards: dict[str, list], split_parts: list[str]) -> Path:
    """Write ``{shard name: [(key, record, members)]}`` into ``folder`` and run ``energon prepare`` on it
    (``CrudeWebdataset``, ``split_parts`` such as ``train:shard-00000[01].tar``)."""
    from click.testing import CliRunner
    from megatron.energon.tools.prepare import command as energon_prepare

    folder.mkdir(parents=True)
    for name, samples in shards.items():
        write_shard(folder / name, samples)
    args = [str(folder), "--non-interactive", "--no-progress", "--num-workers", "1", "--sample-type",
            "CrudeWebdataset"]
    for part in split_parts:
        args += ["--split-parts", part]
    result = CliRunner().invoke(energon_prepare, args)
    if result.exit_code != 0:
        raise RuntimeError(f"energon prepare {folder}: {result.output} {result.exception!r}")
    return folder


def shapes_dataset(folder: Path) -> Path:
    """:func:`conversations` as an Energon dataset: train = ``shard-000000.tar`` (samples 0-4) and
    ``shard-000001.tar`` (5-6), val = ``shard-000002.tar`` (7)."""
    samples = conversations()
    return prepare(folder, {"shard-000000.tar": samples[:5], "shard-000001.tar": samples[5:7],
                            "shard-000002.tar": samples[7:]},
                   ["train:shard-00000[01].tar", "val:shard-000002.tar"])


def llava_processor_folder(folder: Path, tokenizer: Path, crop: int = 28) -> Path:
    """A tiny LLaVA-1.5 processor saved into ``folder``: the tokenizer at ``tokenizer`` (smollm2-135m-instruct) with
    an added ``<image>`` special token, a ``CLIPImageProcessor`` resizing the shortest edge to ``crop`` and
    center-cropping ``crop`` x ``crop``, ``LlavaProcessor(patch_size=14, vision_feature_select_strategy="default",
    num_additional_image_tokens=1)`` with the tokenizer's chat template: ``(28 // 14) ** 2 + 1 - 1 = 4`` image-token
    ids per image."""
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tok.chat_template)
    processor.save_pretrained(str(folder))
    return folder


def main(argv: list[str] | None = None) -> None:
    """``OUT --tokenizer DIR``: write ``OUT/ds`` (:func:`shapes_dataset`) and ``OUT/processor``
    (:func:`llava_processor_folder`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write ds/ and processor/ into (must not hold ds/)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a Hugging Face tokenizer folder")
    args = parser.parse_args(argv)
    print(shapes_dataset(args.out / "ds"))
    print(llava_processor_folder(args.out / "processor", args.tokenizer))


if __name__ == "__main__":
    main()
