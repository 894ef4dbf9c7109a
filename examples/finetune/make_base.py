"""Stand-ins for what you would download: a small Llama with its tokenizer, saved with
`save_pretrained` (several safetensors files, bf16), and a JSONL fine-tuning set built
from the Python standard library (prompt: a function's signature; completion: the first
line of its docstring). Nothing is fetched.

    python examples/finetune/make_base.py /tmp/ft      # writes /tmp/ft/base and /tmp/ft/data.jsonl
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|eos|>' }}"
                 "{% endfor %}")


def byte_bpe(texts: list[str], vocab: int, special: list[str], unk: str | None = None) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of at most `vocab` tokens trained on `texts`
    (no download), `special` tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def tiny_tokenizer(out: Path, text: str, vocab: int = 300) -> Any:
    """A byte-level BPE tokenizer of at most `vocab` tokens trained on `text` (no download),
    with an end token and a chat template, saved to `out`."""
    from transformers import PreTrainedTokenizerFast

    special = ["<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = byte_bpe([text], vocab, special)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>",
                                   additional_special_tokens=special[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def records(limit: int = 3000) -> list[dict[str, str]]:
    """(signature, first docstring line) of stdlib functions, in a fixed order."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                args = ", ".join(a.arg for a in node.args.args)
                out.append({"prompt": f"def {node.name}({args}):\n    \"\"\"",
                            "completion": doc.strip().splitlines()[0]})
                if len(out) >= limit:
                    return out
    return out


def main(root: Path) -> None:
    data = records()
    root.mkdir(parents=True, exist_ok=True)
    with (root / "data.jsonl").open("w") as f:
        for r in data:
            f.write(json.dumps(r) + "\n")
    base = root / "base"
    text = "\n".join(r["prompt"] + r["completion"] for r in data)
    tok = tiny_tokenizer(base, text, vocab=512)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=384, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(base, max_shard_size="1MB")  # type: ignore[arg-type]
    print(f"wrote {base} ({len(list(base.glob('*.safetensors')))} safetensors files) and "
          f"{root / 'data.jsonl'} ({len(data)} records)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hpcshard-finetune"))
