"""Text into a packed corpus for `runtime.train` (`onboard train --data corpus.jsonl`), tokenised once and cached.

    folder = prepare_text(["corpus.jsonl"], tokenizer_dir, cache_root, mask_prompt=False)

Formats (streamed, at most RECORD_CAP characters a record): `.txt` (documents separated by blank lines), `.jsonl` / `.json` and `.parquet`
with one document per record: a `text` field (`text_field`), or `prompt` + `completion`, or chat `messages`
(rendered with the tokenizer's chat template). The model's own tokenizer (from the model directory, through
transformers' fast tokenizers) adds its special tokens to each document and an end-of-sequence token after it.
With `mask_prompt`, prompts (everything before a completion, or before the last assistant message) are kept as
context but not trained on. The corpus (`tokens.npy`, `starts.npy`, `loss_mask.npy`, `corpus.json`; the format
`runtime.train.data.PackedCorpus` reads) goes to `cache_root/<key>/`, the key a digest of the files (path, size,
modification time), the tokenizer's files and the options, so a second run with the same inputs reads it back.
It is written beside its final place and renamed into it, so a killed run leaves no half corpus behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from array import array
from pathlib import Path

import numpy as np

from onboard.errors import OnboardError, one_line

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")
VERSION = 1  # of the corpus folder's layout


def is_text(path: str | Path) -> bool:
    return Path(path).suffix in FORMATS


def _key(paths: list[Path], tokenizer_dir: Path, options: dict) -> str:
    digest = hashlib.sha256(json.dumps({"version": VERSION, **options}, sort_keys=True).encode())
    for path in paths:
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            digest.update(name.encode() + (tokenizer_dir / name).read_bytes())
    return digest.hexdigest()[:16]


def _tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    if not any((tokenizer_dir / name).is_file() for name in TOKENIZER_FILES[:1] + TOKENIZER_FILES[3:5]):
        raise OnboardError(f"{tokenizer_dir}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json): text "
                           f"data is tokenised with the model's own")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as exc:  # noqa: BLE001 - tokenizer loaders we do not own
        raise OnboardError(f"{tokenizer_dir}: the tokenizer does not load: {one_line(exc)}") from None


RECORD_CAP = 16 * 2**20  # characters of one record (one document): above it a record is refused, never buffered
ARRAY_CAP = 256 * 2**20  # a .json file holding one array is parsed whole; larger corpora belong in .jsonl


def _too_long(where: str) -> OnboardError:
    return OnboardError(f"{where}: longer than the {RECORD_CAP // 2**20} MiB cap on one record (split it into "
                        f"documents)")


def _bounded_lines(path: Path):
    """(line number, line without its end) of a text file, never reading more than RECORD_CAP of one line."""
    with open(path, encoding="utf-8", errors="strict", newline=None) as f:
        number = 0
        while True:
            try:
                line = f.readline(RECORD_CAP + 1)
            except UnicodeDecodeError as exc:
                raise OnboardError(f"{path}: not UTF-8 text after line {number} ({exc.reason})") from None
            if not line:
                return
            number += 1
            if len(line) > RECORD_CAP:
                raise _too_long(f"{path} line {number}")
            yield number, line.rstrip("\n")


def _paragraphs(path: Path):
    """Documents of a .txt file: runs of lines between blank lines."""
    lines, size = [], 0
    for number, line in _bounded_lines(path):
        if line.strip():
            lines.append(line)
            size += len(line) + 1
            if size > RECORD_CAP:
                raise _too_long(f"{path} paragraph ending at line {number}")
        elif lines:
            yield {"text": "\n".join(lines)}
            lines, size = [], 0
    if lines:
        yield {"text": "\n".join(lines)}


def _json_lines(path: Path):
    for number, line in _bounded_lines(path):
        if line.strip():
            yield _parsed(line, f"{path} line {number}")


def _parsed(text: str, where: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise OnboardError(f"{where}: nested too deeply") from None
    except ValueError as exc:
        raise OnboardError(f"{where}: not JSON ({one_line(exc)})") from None


def _json(path: Path):
    """A .json file: one array of records (read whole, so capped), or JSON lines."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from _json_lines(path)
        return
    if path.stat().st_size > ARRAY_CAP:
        raise OnboardError(f"{path}: a JSON array over {ARRAY_CAP // 2**20} MiB is read whole: give the records as "
                           f".jsonl, one per line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise OnboardError(f"{path}: not UTF-8 text ({exc.reason})") from None
    yield from _parsed(text, str(path))


def _parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=64)
        for batch in batches:
            yield from batch.to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise OnboardError(f"{path}: not readable as parquet: {one_line(exc)}") from None


READERS = {".txt": _paragraphs, ".jsonl": _json_lines, ".json": _json, ".parquet": _parquet}


def _records(path: Path):
    """The records of one data file, streamed: no record above RECORD_CAP is ever held whole (.json arrays and
    parquet row groups aside, which are bounded by their file)."""
    return READERS[path.suffix](path)


def _text(value, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise OnboardError(f"{where}: {field!r} must be text, not {type(value).__name__}")
    if len(value) > RECORD_CAP:
        raise _too_long(where)
    return value


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise OnboardError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    for i, message in enumerate(value):
        _text(message.get("role"), where, f"messages[{i}].role")
        _text(message.get("content"), where, f"messages[{i}].content")
    if sum(len(m["content"]) for m in value) > RECORD_CAP:
        raise _too_long(where)
    return value


def _document(record: dict, tokenizer, text_field: str, mask_prompt: bool, where: str) -> tuple[list, list]:
    """(token ids, loss mask) of one record."""
    if not isinstance(record, dict):
        raise OnboardError(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record and record["messages"]:
        messages = _messages(record["messages"], where)
        if not getattr(tokenizer, "chat_template", None):
            raise OnboardError(f"{where}: chat messages, but the tokenizer has no chat template")
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                               return_dict=False) if mask_prompt else []
        return list(full), [0] * len(prompt) + [1] * (len(full) - len(prompt))
    if "prompt" in record and "completion" in record:
        prompt = tokenizer(_text(record["prompt"], where, "prompt"))["input_ids"]
        completion = tokenizer(_text(record["completion"], where, "completion"), add_special_tokens=False)["input_ids"]
        return prompt + completion, [0 if mask_prompt else 1] * len(prompt) + [1] * len(completion)
    if mask_prompt:
        raise OnboardError(f"{where}: --mask-prompt needs prompt + completion fields or chat messages")
    if text_field not in record:
        raise OnboardError(f"{where}: no {text_field!r} field (fields: {', '.join(sorted(record)) or 'none'})")
    ids = tokenizer(_text(record[text_field], where, text_field))["input_ids"]
    return ids, [1] * len(ids)


def prepare_text(paths, tokenizer_dir, cache_root, *, mask_prompt: bool = False, text_field: str = "text",
                 vocab_size: int | None = None) -> Path:
    """The packed corpus folder of `paths` (module docstring), made once per key."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for path in paths:
        if not path.is_file():
            raise OnboardError(f"{path}: {'not a regular file' if path.exists() else 'no such data file'}")
        if path.suffix not in FORMATS:
            raise OnboardError(f"{path}: data must be {', '.join(FORMATS)} (text) or .npy / .bin (token ids)")
    tokenizer_dir = Path(tokenizer_dir)
    options = {"mask_prompt": mask_prompt, "text_field": text_field}
    folder = Path(cache_root) / _key(paths, tokenizer_dir, options)
    if (folder / "corpus.json").is_file():
        return folder
    tokenizer = _tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id
    tokens, mask, starts = array("q"), array("B"), []  # 9 bytes a token, not a Python int's 36
    for path in paths:
        for number, record in enumerate(_records(path), 1):
            ids, trained = _document(record, tokenizer, text_field, mask_prompt, f"{path} record {number}")
            if not ids:
                continue
            if eos is not None and ids[-1] != eos:
                ids, trained = ids + [eos], trained + [1]
            starts.append(len(tokens))
            tokens.extend(ids)
            mask.extend(trained)
    if not tokens:
        raise OnboardError(f"{', '.join(map(str, paths))}: no text to train on")
    tokens, mask = np.frombuffer(tokens, dtype=np.int64), np.frombuffer(mask, dtype=np.uint8)
    if vocab_size is not None and tokens.max() >= vocab_size:
        raise OnboardError(f"the tokenizer at {tokenizer_dir} gives id {tokens.max()}, outside the model's vocabulary "
                           f"of {vocab_size}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        np.save(staging / "tokens.npy", tokens.astype(np.int32 if tokens.max() < 2**31 else np.int64))
        np.save(staging / "starts.npy", np.asarray(starts, dtype=np.int64))
        if not mask.all():
            np.save(staging / "loss_mask.npy", mask)
        (staging / "corpus.json").write_text(json.dumps(
            {"version": VERSION, "files": [str(p) for p in paths], "tokenizer": str(tokenizer_dir),
             "documents": len(starts), "tokens": len(tokens), "trained_tokens": int(mask.sum()), **options},
            indent=2, sort_keys=True) + "\n")
        os.replace(staging, folder)  # a concurrent run that got there first: its corpus is the same
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "corpus.json").is_file():
            raise
    return folder
