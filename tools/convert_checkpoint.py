"""Convert checkpoints between Hugging Face and packsft's Megatron format (model weights only).

Import a local HF checkpoint (a safetensors folder, or a GGUF file read through transformers'
dequantizing GGUF loader) into a Megatron ``dist_checkpointing`` folder::

    python tools/convert_checkpoint.py import --hf ~/models/SmolLM2-135M-Instruct --out ckpt/smollm2
    python tools/convert_checkpoint.py import --hf SmolLM2-135M-Instruct.Q4_1.gguf --out ckpt/smollm2
    torchrun --nproc_per_node=2 tools/convert_checkpoint.py import --hf DIR --out ckpt/smollm2-tp2 \\
        --tensor-model-parallel-size 2     # each rank reads the HF tensors once and keeps its shard
    torchrun --nproc_per_node=4 tools/convert_checkpoint.py import --hf DIR --out ckpt/smollm2-pp2 \\
        --pipeline-model-parallel-size 2   # TP = WORLD_SIZE / PP = 2; each rank keeps its stage's layers

The written checkpoint does not depend on the layout: it loads at any TP and PP size. Export a Megatron
checkpoint (at any TP and PP size, the same files; ``--config`` defaults to the folder's ``model_config.json``,
the HF config to its ``hf_config.json``) back to an HF folder that ``AutoModelForCausalLM.from_pretrained``
loads, with the tokenizer files and chat template of ``--tokenizer``, whose bos/eos/pad ids fill ``config.json``
where the HF config lacks them (a tokenizer with more tokens than the model's ``vocab_size`` is refused)::

    python tools/convert_checkpoint.py export --megatron ckpt/smollm2 --out hf/smollm2-sft \\
        --tokenizer ~/models/SmolLM2-135M-Instruct --dtype bfloat16

A LoRA run (its ``--config`` YAML has ``lora.enabled: true``) is exported merged or as a PEFT adapter::

    python tools/convert_checkpoint.py export --megatron out/train/checkpoints/iter_0000024 \\
        --config out/train/config.yaml --out hf/merged --merge-lora --tokenizer out/demo/smollm2-tokenizer
    python tools/convert_checkpoint.py export --megatron out/train/checkpoints/iter_0000024 \\
        --config out/train/config.yaml --out hf/base --lora-adapter hf/adapter \\
        --tokenizer out/demo/smollm2-tokenizer   # base + PEFT adapter folder; the tokenizer's files in --out

A LoRA run started from an imported base stores only its adapters; the export loads the base from the folder its
``train_state.json`` records (or ``--lora-base DIR``) after checking the base's fingerprint, then the adapters.

An HF LLaVA-1.5 folder (``LlavaForConditionalGeneration``; other image-text models are refused by key) imports to a
``LLaVAModel`` checkpoint with ``vision_config.json``, and exports back with the processor files of ``--tokenizer``
(a training checkpoint's: its ``data.tokenizer`` by default)::

    python tools/convert_checkpoint.py import --hf ~/models/llava-1.5-7b-hf --out ckpt/llava
    python tools/convert_checkpoint.py export --megatron ckpt/llava --out hf/llava --tokenizer ~/models/llava-1.5-7b-hf

Layouts, supported families and refused options: docs/checkpoints.md. User errors (missing files, bad
arguments, unsupported models) print ``error: ...`` and exit with status 2.

Trust: a Megatron checkpoint (``--megatron``, ``--lora-base``, and what ``import`` writes) is read without running
code from it (``.metadata`` through an unpickler that admits only torch's checkpoint metadata classes, the rest as
JSON or ``torch.load(weights_only=True)``; anything else is refused by name: docs/checkpoints.md). The HF input is read
as safetensors (or GGUF) and JSON, which cannot run code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packsft.config_rules import positive_int  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    def layout(suppress: bool) -> argparse.ArgumentParser:
        """The layout options; the subcommands' copy (``suppress``) only sets what is given after the subcommand."""
        common = argparse.ArgumentParser(add_help=False)
        common.add_argument("--tensor-model-parallel-size", type=positive_int,
                            default=argparse.SUPPRESS if suppress else None,
                            help="TP size of the Megatron model (default: WORLD_SIZE / pipeline size)")
        common.add_argument("--pipeline-model-parallel-size", type=positive_int,
                            default=argparse.SUPPRESS if suppress else 1,
                            help="PP size: each rank builds, imports or exports its pipeline stage (default 1)")
        return common

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[layout(False)])
    sub = parser.add_subparsers(dest="command", required=True)
    sub_layout = layout(True)
    imp = sub.add_parser("import", help="HF safetensors folder or GGUF file -> Megatron checkpoint",
                         parents=[sub_layout])
    imp.add_argument("--hf", required=True, help="HF checkpoint folder or *.gguf file")
    imp.add_argument("--out", required=True, help="Megatron checkpoint folder to write (new, empty or a previous "
                                                  "import: replaced atomically)")
    imp.add_argument("--max-seq-len", type=positive_int, default=None,
                     help="longest training row; lets a sliding_window >= it be accepted (Mistral, Qwen2/Qwen3)")
    imp.add_argument("--params-dtype", choices=("float32", "bfloat16"), default="float32")
    imp.add_argument("--attention-backend", choices=("torch", "te"), default="torch",
                     help="backend the checkpoint is written for: te (TransformerEngine, needs it installed) fuses "
                          "the norms into the linear layers, so its key names differ from torch's")
    exp = sub.add_parser("export", help="Megatron checkpoint -> HF safetensors folder", parents=[sub_layout])
    exp.add_argument("--megatron", required=True, help="Megatron checkpoint folder (model under key 'model')")
    exp.add_argument("--out", required=True, help="HF folder to write (new, empty or a previous export: replaced "
                                                  "atomically)")
    exp.add_argument("--config", default=None, help="model_config.json or a YAML with a model: section")
    exp.add_argument("--hf-config", default=None,
                     help="config.json of the original HF model, or its folder (optional; default: the checkpoint's "
                          "hf_config.json)")
    exp.add_argument("--tokenizer", default=None,
                     help="folder with tokenizer files and chat template to copy; its bos/eos/pad ids fill "
                          "config.json where the HF config lacks them")
    exp.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                     help="dtype of the safetensors, the PEFT adapter's too (default: the model's parameters', "
                          "float32 unless model.params_dtype says otherwise, whatever the imported HF model's)")
    lora = exp.add_mutually_exclusive_group()
    lora.add_argument("--merge-lora", action="store_true",
                      help="LoRA run: fold the adapters into the exported weights")
    lora.add_argument("--lora-adapter", default=None, metavar="DIR",
                      help="LoRA run: export the base weights to --out and the adapters as a PEFT folder DIR")
    exp.add_argument("--lora-base", default=None, metavar="DIR",
                     help="LoRA run: the imported base folder (default: the one the checkpoint records; its "
                          "fingerprint must match)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Run ``import`` or ``export``; return the exit status (2 on a user error, printed as ``error: ...``)."""
    args = parse_args(argv)
    source = Path(args.hf if args.command == "import" else args.megatron)
    if not source.exists():
        print(f"error: {'--hf' if args.command == 'import' else '--megatron'} {source} does not exist",
              file=sys.stderr)
        return 2
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from packsft.train.convert import run
    from packsft.train.distributed import destroy_distributed
    from packsft.train.model_checkpoint import unreadable_checkpoint_message
    from packsft.train.process_guard import forked_children_die_with_this_process, stop_checkpoint_writer

    forked_children_die_with_this_process()    # import saves through dist_checkpointing's forked writers
    try:
        return run(args)
    except (ValueError, OSError, ImportError, CheckpointingException) as err:   # unsupported model, bad file or
        # folder, TP layout, an optional dependency the model needs (TransformerEngine)
        print(f"error: {str(err).strip() or type(err).__name__}", file=sys.stderr)
        return 2
    except CheckpointException as err:   # torch's checkpoint reader wraps each rank's failure (a BaseException):
        # a --config of another shape than the checkpoint, a truncated or missing .distcp file
        print(f"error: {source}: {unreadable_checkpoint_message(err)}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
        stop_checkpoint_writer()


if __name__ == "__main__":   # required: dist_checkpointing.save starts a spawn-context Manager
    sys.exit(main())
