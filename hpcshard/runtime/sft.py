"""Fine-tuning data: JSONL records of prompt/completion pairs or chat messages, tokenized with
a local Hugging Face tokenizer, the loss masked on everything but what the model should
learn to write, and packed into one stream.

Each line of the file is one record:

    {"prompt": "Translate: chat", "completion": " cat"}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

A prompt/completion record is `prompt` then `completion` then the end-of-text token; only
the completion (and that end token) is learnt. A chat record is rendered with the
tokenizer's chat template, and only the assistant turns are learnt. Records are
concatenated into one token stream with a parallel stream of targets (IGNORE where the loss
is masked), which the world-size independent, resumable pipeline of `runtime.data` cuts
into windows as it does plain text: the same steps see the same tokens on any shape.

Bad records (not JSON, neither form, empty completion, no assistant turn, a template that
does not render incrementally) are skipped and counted by reason with their first line
numbers; a file with no good record is an error. Every 20th record is held out for
evaluation unless `sft_eval` names a file of its own.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcshard.errors import UserError
from hpcshard.runtime.sources import vocabulary

IGNORE = -100
"""The target of a masked position (what F.cross_entropy ignores by default)."""
HOLD_OUT = 20
"""Without sft_eval, every HOLD_OUT-th good record is held out for evaluation."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Records:
    """The tokenized records of one file, in order, and what was skipped."""

    path: str
    items: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(tokens, targets) per good record."""
    bad: Counter[str] = field(default_factory=Counter)
    first_bad: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, line: int) -> None:
        self.bad[reason] += 1
        self.first_bad.setdefault(reason, line)

    def report(self) -> str:
        tokens = sum(len(ids) for ids, _ in self.items)
        learnt = sum(t != IGNORE for _, targets in self.items for t in targets)
        text = f"{self.path}: {len(self.items)} records, {tokens} tokens, {learnt} learnt"
        bad = sum(self.bad.values())
        if bad:
            text += f"; {bad} bad record(s) skipped: " + ", ".join(
                f"{n} {reason} (first at line {self.first_bad[reason]})"
                for reason, n in self.bad.most_common())
        return text


def stream(items: list[tuple[list[int], list[int]]], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Records packed into one token stream and its parallel target stream."""
    tokens = [t for ids, _ in items for t in ids]
    targets = [t for _, tg in items for t in tg]
    return np.asarray(tokens, dtype=dtype), np.asarray(targets, dtype=np.int64)


def record_starts(items: list[tuple[list[int], list[int]]]) -> np.ndarray:
    """Parallel to `stream`'s tokens: True at each record's first token (where position ids
    restart, so a packed record attends to itself only)."""
    starts = np.zeros(sum(len(ids) for ids, _ in items), dtype=bool)
    if items:
        starts[np.cumsum([0] + [len(ids) for ids, _ in items[:-1]])] = True
    return starts


def tokenizer_dir(cfg: Any) -> str:
    """`tokenizer`, else init_from when it holds one; one line otherwise."""
    source = cfg.tokenizer or cfg.init_from
    if not source or not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
        where = (f"tokenizer={source!r} holds" if cfg.tokenizer
                 else f"init_from={cfg.init_from!r} holds" if cfg.init_from
                 else "no tokenizer or init_from is set, so there is")
        raise UserError(f"sft data needs a tokenizer: {where} no tokenizer files; give "
                        "--set tokenizer=DIR (a directory written by tokenizer.save_pretrained)")
    return str(source)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises many kinds
        raise UserError(f"tokenizer {path!r} could not be loaded ({str(err).splitlines()[0]})") from None


def _prompt_completion(tok: Any, record: dict[str, Any]) -> tuple[list[int], list[int]] | str:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return "without a string prompt and completion"
    if not completion:
        return "with an empty completion"
    head = tok(prompt, add_special_tokens=True)["input_ids"]
    tail = tok(completion, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        tail = [*tail, tok.eos_token_id]
    return head + tail, [IGNORE] * len(head) + tail


def _chat(tok: Any, record: dict[str, Any]) -> tuple[list[int], list[int]] | str:
    messages = record["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)):
        return "with malformed messages"
    if not any(m.get("role") == "assistant" for m in messages):
        return "without an assistant turn"
    if not getattr(tok, "chat_template", None):
        return "in chat form for a tokenizer without a chat template"
    # Character spans of the assistant turns, from the rendered prefixes: turn i is what
    # rendering messages[:i+1] adds to messages[:i].
    texts = [tok.apply_chat_template(messages[:i], tokenize=False) if i else ""
             for i in range(len(messages) + 1)]
    if any(not b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)):
        return "whose chat template does not render turn by turn"
    spans = [(len(texts[i]), len(texts[i + 1])) for i, m in enumerate(messages)
             if m.get("role") == "assistant"]
    enc = tok(texts[-1], add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    learnt = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return ids, [t if keep else IGNORE for t, keep in zip(ids, learnt, strict=True)]


def read(path: Path, tok: Any) -> Records:
    """Every record of a JSONL file, tokenized."""
    out = Records(str(path))
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                out.skip("not JSON", line_no)
                continue
            if not isinstance(record, dict):
                out.skip("not a JSON object", line_no)
                continue
            result = _chat(tok, record) if "messages" in record else _prompt_completion(tok, record)
            if isinstance(result, str):
                out.skip(result, line_no)
            else:
                out.items.append(result)
    return out


@dataclass(frozen=True)
class SftData:
    """Token and target streams for training and evaluation, and what was read and skipped
    (`runtime.data` makes them its DataSplits)."""

    train: np.ndarray
    eval: np.ndarray
    train_targets: np.ndarray
    eval_targets: np.ndarray
    report: str
    train_starts: np.ndarray
    """True at each record's first token (`record_starts`)."""
    eval_starts: np.ndarray


def load_sft(cfg: Any, vocab_size: int) -> SftData:
    """Streams from cfg.sft (held out: cfg.sft_eval, else every 20th good record)."""
    for key in ("sft", "sft_eval"):
        value = getattr(cfg, key)
        if value and not Path(value).is_file():
            raise UserError(f"{key}={value!r} is not a file; give a JSONL file of prompt/completion "
                            "or messages records")
    tok = load_tokenizer(tokenizer_dir(cfg))
    _, bound = vocabulary(tok)  # the largest id + 1, not the count of entries: ids can have gaps
    if bound > vocab_size:
        raise UserError(f"the tokenizer's ids run to {bound - 1}, beyond the model's vocab_size="
                        f"{vocab_size}; use the model's own tokenizer")
    train = read(Path(cfg.sft), tok)
    if not train.items:
        raise UserError(f"sft={cfg.sft!r} has no usable record ({train.report()})")
    report = train.report()
    if cfg.sft_eval:
        held = read(Path(cfg.sft_eval), tok)
        report += "; held out: " + held.report()
        train_items, held_items = train.items, held.items
    else:
        train_items = [r for i, r in enumerate(train.items, 1) if i % HOLD_OUT]
        held_items = [r for i, r in enumerate(train.items, 1) if not i % HOLD_OUT]
        report += f"; every {HOLD_OUT}th held out ({len(held_items)})"
    dtype = np.uint32 if vocab_size > 2**16 else np.uint16
    (tokens, targets), (held_tokens, held_targets) = stream(train_items, dtype), stream(held_items, dtype)
    return SftData(train=tokens, eval=held_tokens, train_targets=targets, eval_targets=held_targets,
                   report=report, train_starts=record_starts(train_items),
                   eval_starts=record_starts(held_items))
