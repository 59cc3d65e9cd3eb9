#!/usr/bin/env python
"""Answer one chat prompt with ``transformers`` from an exported Hugging Face folder (greedy decoding).

Run by ``examples/demo.sh`` on the folder ``tools/convert_checkpoint.py export`` wrote::

    python examples/generate.py --model out/demo/smollm2-sft-hf --prompt "Hi! What do you like to do on weekends?"

A LoRA run exported with ``--lora-adapter`` answers through ``peft`` (the base folder plus the adapter folder)::

    python examples/generate.py --model out/demo/smollm2-base-hf --adapter out/demo/smollm2-chitchat-lora \
        --prompt "Hi! What do you like to do on weekends?"

The prompt is rendered with the folder's own chat template (``apply_chat_template(..., add_generation_prompt=True)``),
so the exported tokenizer files and template are exercised too. Prints the prompt and the decoded answer (special
tokens removed). Nothing is downloaded (``local_files_only``). Exit code 0, or 2 when the folder does not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--model DIR [--adapter DIR] --prompt TEXT [--system TEXT] [--max-new-tokens N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="exported HF folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--adapter", default=None,
                        help="PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to load onto "
                             "--model with peft.PeftModel.from_pretrained")
    parser.add_argument("--prompt", required=True, help="the user message")
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    return parser.parse_args(argv)


def generate(model_dir: str | Path, messages: list[dict[str, str]], max_new_tokens: int,
             adapter_dir: str | Path | None = None) -> str:
    """Greedy continuation of ``messages`` (OpenAI roles) by the model in ``model_dir``, in float32 on CPU.

    ``adapter_dir``: a PEFT LoRA adapter loaded onto that model (``peft.PeftModel.from_pretrained``), unmerged.

    Returns:
        The new text only (the prompt's tokens are cut off; special tokens skipped).

    Raises:
        OSError: (from transformers) ``model_dir`` lacks the model or tokenizer files.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    """Print the prompt and the model's answer."""
    args = parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        print(f"error: {args.model} has no config.json; export a checkpoint first "
              "(tools/convert_checkpoint.py export --megatron CKPT --out DIR --tokenizer TOK)", file=sys.stderr)
        return 2
    if args.adapter and not Path(args.adapter, "adapter_config.json").is_file():
        print(f"error: {args.adapter} has no adapter_config.json; export one with tools/convert_checkpoint.py export "
              "... --lora-adapter DIR", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    answer = generate(args.model, messages, args.max_new_tokens, args.adapter)
    print(f"user:      {args.prompt}\nassistant: {answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
