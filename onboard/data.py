"""Text into a packed corpus for `runtime.train` (`onboard train --data corpus.jsonl`), tokenised once and cached.

    folder = prepare_text(["corpus.jsonl"], tokenizer_dir, cache_root, mask_prompt=False)

Formats (read with `datasets`): `.txt` (documents separated by blank lines), `.jsonl` / `.json` and `.parquet`
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


def _records(path: Path, text_field: str):
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()  # one corpus, read once: its bars would only clutter the run's output

    builder = FORMATS[path.suffix]
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        return load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as exc:  # noqa: BLE001 - datasets' readers raise many kinds
        raise OnboardError(f"{path}: not readable as {builder} data: {one_line(exc)}") from None


def _document(record: dict, tokenizer, text_field: str, mask_prompt: bool, where: str) -> tuple[list, list]:
    """(token ids, loss mask) of one record."""
    if "messages" in record and record["messages"]:
        if not getattr(tokenizer, "chat_template", None):
            raise OnboardError(f"{where}: chat messages, but the tokenizer has no chat template")
        messages = record["messages"]
        full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                               return_dict=False) if mask_prompt else []
        return list(full), [0] * len(prompt) + [1] * (len(full) - len(prompt))
    if "prompt" in record and "completion" in record:
        prompt = tokenizer(record["prompt"])["input_ids"]
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        return prompt + completion, [0 if mask_prompt else 1] * len(prompt) + [1] * len(completion)
    if mask_prompt:
        raise OnboardError(f"{where}: --mask-prompt needs prompt + completion fields or chat messages")
    if text_field not in record:
        raise OnboardError(f"{where}: no {text_field!r} field (fields: {', '.join(sorted(record)) or 'none'})")
    ids = tokenizer(record[text_field])["input_ids"]
    return ids, [1] * len(ids)


def prepare_text(paths, tokenizer_dir, cache_root, *, mask_prompt: bool = False, text_field: str = "text",
                 vocab_size: int | None = None) -> Path:
    """The packed corpus folder of `paths` (module docstring), made once per key."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for path in paths:
        if not path.is_file():
            raise OnboardError(f"{path}: no such data file")
        if path.suffix not in FORMATS:
            raise OnboardError(f"{path}: data must be {', '.join(FORMATS)} (text) or .npy / .bin (token ids)")
    tokenizer_dir = Path(tokenizer_dir)
    options = {"mask_prompt": mask_prompt, "text_field": text_field}
    folder = Path(cache_root) / _key(paths, tokenizer_dir, options)
    if (folder / "corpus.json").is_file():
        return folder
    tokenizer = _tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id
    tokens, mask, starts = [], [], []
    for path in paths:
        for number, record in enumerate(_records(path, text_field), 1):
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
    if vocab_size is not None and max(tokens) >= vocab_size:
        raise OnboardError(f"the tokenizer at {tokenizer_dir} gives id {max(tokens)}, outside the model's vocabulary "
                           f"of {vocab_size}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        np.save(staging / "tokens.npy", np.asarray(tokens, dtype=np.int32 if max(tokens) < 2**31 else np.int64))
        np.save(staging / "starts.npy", np.asarray(starts, dtype=np.int64))
        if not all(mask):
            np.save(staging / "loss_mask.npy", np.asarray(mask, dtype=np.uint8))
        (staging / "corpus.json").write_text(json.dumps(
            {"version": VERSION, "files": [str(p) for p in paths], "tokenizer": str(tokenizer_dir),
             "documents": len(starts), "tokens": len(tokens), "trained_tokens": int(sum(mask)), **options},
            indent=2, sort_keys=True) + "\n")
        os.replace(staging, folder)  # a concurrent run that got there first: its corpus is the same
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "corpus.json").is_file():
            raise
    return folder
