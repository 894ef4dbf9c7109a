"""Fine-tuning data: prompt/completion and chat records tokenized with a local tokenizer,
the loss masked on prompts and non-assistant turns, records packed into one stream that
the world-size independent, resumable batches cut; bad records counted, not hidden."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcshard.runtime.data import GlobalBatches, eval_batches
from hpcshard.runtime.sft import IGNORE, load_sft
from tests.hf_models import tiny_tokenizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

TEXT = (Path(json.__file__).read_text() + Path(json.__file__).with_name("decoder.py").read_text())


@dataclass
class Cfg:
    sft: str
    sft_eval: str = ""
    tokenizer: str = ""
    init_from: str = ""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    tiny_tokenizer(out, TEXT)
    return out


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def load(tmp_path: Path, tok_dir: Path, records: list[Any], **extra: str) -> Any:
    data = write(tmp_path / "data.jsonl", records)
    return load_sft(Cfg(sft=str(data), tokenizer=str(tok_dir), **extra), 300)


def test_a_completion_is_learnt_and_its_prompt_is_not(tmp_path: Path, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    splits = load(tmp_path, tok_dir, [{"prompt": "def loads(s):", "completion": " return decode(s)"}],
                  sft_eval=str(write(tmp_path / "eval.jsonl", [{"prompt": "a", "completion": "b"}])))
    prompt = tok("def loads(s):")["input_ids"]
    completion = tok(" return decode(s)", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert splits.train.tolist() == prompt + completion
    assert splits.train_targets.tolist() == [IGNORE] * len(prompt) + completion
    assert "1 records" in splits.report and "held out" in splits.report


def test_in_a_chat_only_the_assistant_turns_are_learnt(tmp_path: Path, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is JSON?"},
            {"role": "assistant", "content": "A text format."}, {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "You're welcome."}]
    splits = load(tmp_path, tok_dir, [{"messages": chat}])
    learnt = tok.decode([t for t in splits.train_targets.tolist() if t != IGNORE])
    assert learnt == "<|assistant|>A text format.<|eos|><|assistant|>You're welcome.<|eos|>"
    assert tok.decode(splits.train.tolist()) == tok.apply_chat_template(chat, tokenize=False)


def test_bad_records_are_counted_by_reason_with_their_first_line(tmp_path: Path, tok_dir: Path) -> None:
    good = {"prompt": "x = ", "completion": "1"}
    splits = load(tmp_path, tok_dir, [good, "{not json", {"prompt": "x"}, good, "[1, 2]",
                                      {"prompt": "a", "completion": ""},
                                      {"messages": [{"role": "user", "content": "hi"}]}, "{also not json"])
    assert ("2 records" in splits.report and "6 bad record(s) skipped" in splits.report
            and "2 not JSON (first at line 2)" in splits.report
            and "1 without a string prompt and completion (first at line 3)" in splits.report
            and "1 without an assistant turn (first at line 7)" in splits.report), splits.report


@pytest.mark.parametrize("records,needle", [
    (["{bad"], "has no usable record"),
])
def test_a_file_with_no_good_record_is_one_line(tmp_path: Path, tok_dir: Path, records: list[Any],
                                               needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load(tmp_path, tok_dir, records)


def test_a_tokenizer_whose_ids_pass_the_models_vocab_size_is_one_line(tmp_path: Path, tok_dir: Path) -> None:
    """The bound of a tokenizer's ids is its largest id + 1, not its count of entries: ids can
    have gaps (its end token at 60,000 among 300 entries). A model of vocab_size 300 took
    it (300 tokens, not more), and the first batch with that token failed in its embedding
    (on a GPU: a device-side assert, at every restart). One line, as for too many tokens;
    a model whose vocab_size holds the id trains on it."""
    import shutil

    gap = tmp_path / "gap"
    shutil.copytree(tok_dir, gap)
    saved = json.loads((gap / "tokenizer.json").read_text())
    saved["model"]["vocab"]["<|eos|>"] = 60000
    for added in saved["added_tokens"]:
        if added["content"] == "<|eos|>":
            added["id"] = 60000
    (gap / "tokenizer.json").write_text(json.dumps(saved))
    data = write(tmp_path / "data.jsonl", [{"prompt": "x = ", "completion": "1"}])
    with pytest.raises(ValueError, match="the tokenizer's ids run to 60000, beyond the model's "
                                         "vocab_size=300; use the model's own tokenizer") as err:
        load_sft(Cfg(sft=str(data), tokenizer=str(gap)), 300)
    assert "\n" not in str(err.value)
    assert int(load_sft(Cfg(sft=str(data), tokenizer=str(gap)), 60001).train.max()) == 60000


def test_no_tokenizer_or_file_is_one_line(tmp_path: Path) -> None:
    data = write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match="sft data needs a tokenizer: no tokenizer or init_from is set"):
        load_sft(Cfg(sft=str(data)), 300)
    with pytest.raises(ValueError, match="tokenizer=.* holds no tokenizer files"):
        load_sft(Cfg(sft=str(data), tokenizer=str(tmp_path)), 300)
    with pytest.raises(ValueError, match="sft='nowhere.jsonl' is not a file"):
        load_sft(Cfg(sft="nowhere.jsonl", tokenizer=str(tmp_path)), 300)


def test_packed_windows_are_world_size_independent_and_resume_where_they_stopped(tmp_path: Path,
                                                                                tok_dir: Path) -> None:
    """Records are packed end to end; a window's targets are the next tokens, masked where
    the record is a prompt; 1 rank and 2 ranks see the same global batches; a saved
    position resumes exactly; every 20th record is held out."""
    records = [{"prompt": f"def f{i}(x):", "completion": f" return x * {i}"} for i in range(200)]
    splits = load(tmp_path, tok_dir, records)
    tokens, targets = splits.train, splits.train_targets
    assert len(splits.eval) and "every 20th held out (10)" in splits.report
    # a position's target is its own token or IGNORE (windows read it one ahead of the input)
    assert (targets == np.where(targets == IGNORE, IGNORE, tokens.astype(np.int64))).all()

    def batches(rank: int, world: int) -> GlobalBatches:
        return GlobalBatches(tokens, seq_len=16, batch_size=4, micro=4 // world, rank=rank, world=world,
                             seed=3, targets=targets)

    one, a, b = batches(0, 1), batches(0, 2), batches(1, 2)
    for _ in range(3):
        (x1, y1), = one.next()
        (xa, ya), (xb, yb) = a.next()[0], b.next()[0]
        assert torch.equal(x1, torch.cat([xa, xb])) and torch.equal(y1, torch.cat([ya, yb]))
        assert (y1 == IGNORE).any() and (y1 != IGNORE).any()
    again = batches(0, 1)
    again.load_state_dict(one.state_dict())
    (x, y), = again.next()
    (x_ref, y_ref), = one.next()
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    (ex, ey), = list(eval_batches(splits.eval, seq_len=16, batch_size=4, micro=4, rank=0, world=1,
                                  count=1, targets=splits.eval_targets))
    assert ex.shape == ey.shape == (4, 16) and (ey != IGNORE).any()
