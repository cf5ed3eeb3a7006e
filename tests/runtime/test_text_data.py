"""Real text into training (`onboard train --data corpus.jsonl`, `onboard.train.data`, `runtime.train.data`), issue 16.

A word-level tokenizer the test builds (with the `tokenizers` library, saved as a transformers fast tokenizer
with a chat template) sits in each released model's directory, as a real model's does. Text in .txt, .jsonl and
.parquet tokenises to one packed corpus; packed windows restart positions at each document and never make a
document's first token the target of the one before; prompts are masked out with --mask-prompt; the adapted
model keeps packed documents apart (checked at adapt, for softmax, gated-delta and lightning attention, with
Jamba's Mamba1 mixer as the control that does not, which `onboard train` then refuses); a run on text starts from HuggingFace's own loss of the packed
batch and writes its held-out loss and perplexity.
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from cli import main
from onboard.errors import OnboardError
from onboard.train.data import prepare_text
from runtime.train.data import PackedCorpus, model_inputs

WORDS = "the a model expert router token layer attention learns routes packs every document sees only its own".split()
SEQ = 32


def _tokenizer(folder) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(WORDS) + " ."], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
    fast.save_pretrained(folder)
    return fast


def _documents(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) + " ." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as .txt, .jsonl and .parquet, prompt + completion and chat records of them, and a
    held-out file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    (folder / "docs.txt").write_text("\n\n".join(docs) + "\n")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"text": docs}), folder / "docs.parquet")
    (folder / "pairs.jsonl").write_text("".join(json.dumps({"prompt": d[:12], "completion": d}) + "\n" for d in docs))
    (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": d[:12]},
                                                                         {"role": "assistant", "content": d}]}) + "\n"
                                               for d in docs))
    (folder / "held_out.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(12, seed=1)))
    (folder / "empty.jsonl").write_text("")
    return folder


@pytest.fixture(scope="module")
def models_with_tokenizers(released_models):
    """The session's released models (tests/runtime/conftest.py), each with the word-level tokenizer beside it."""
    out = {}
    for family in ("mixtral", "qwen3_next", "deepseek_v3", "minimax", "jamba"):
        model_dir, bundle = released_models(family)
        _tokenizer(model_dir)
        out[family] = (model_dir, bundle)
    return out


def test_txt_jsonl_and_parquet_tokenise_to_one_packed_corpus_made_once(corpus, tmp_path):
    tokenizer_dir = tmp_path / "tok"
    tokenizer = _tokenizer(tokenizer_dir)
    folders = [prepare_text(corpus / name, tokenizer_dir, tmp_path / "cache") for name in
               ("docs.txt", "docs.jsonl", "docs.parquet")]
    arrays = [(np.load(f / "tokens.npy"), np.load(f / "starts.npy")) for f in folders]
    for tokens, starts in arrays[1:]:
        assert np.array_equal(tokens, arrays[0][0]) and np.array_equal(starts, arrays[0][1])
    tokens, starts = arrays[0]
    first = tokenizer(_documents()[0])["input_ids"] + [tokenizer.eos_token_id]
    assert tokens[:len(first)].tolist() == first and starts[1] == len(first) and len(starts) == 40
    stamp = (folders[1] / "tokens.npy").stat().st_mtime_ns
    assert prepare_text(corpus / "docs.jsonl", tokenizer_dir, tmp_path / "cache") == folders[1]  # read back
    assert (folders[1] / "tokens.npy").stat().st_mtime_ns == stamp


def test_packed_windows_restart_positions_and_never_predict_across_documents():
    tokens = np.arange(100, 120)
    corpus = PackedCorpus(tokens, np.array([0, 3, 11]), 8, loss_mask=(np.arange(20) % 7 != 5).astype(np.uint8))
    inputs = model_inputs(corpus, 0, 0, 0, grad_accum=1, dp=1, micro_batch=2)  # windows [0, 8) and [8, 16)
    assert inputs["input_ids"].tolist() == [list(range(100, 116))]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 8, 11, 16] and inputs["max_length_q"] == 5
    labels = inputs["labels"][0].tolist()
    assert [i for i, v in enumerate(labels) if v == -100] == [3, 5, 11, 12]  # document starts 3, 11; masked 5, 12


def test_prompts_are_masked_out_of_the_loss(corpus, tmp_path):
    tokenizer_dir = tmp_path / "tok"
    tokenizer = _tokenizer(tokenizer_dir)
    docs = _documents()
    for name in ("pairs.jsonl", "chat.jsonl"):
        folder = prepare_text(corpus / name, tokenizer_dir, tmp_path / "cache", mask_prompt=True)
        tokens, starts, mask = (np.load(folder / f) for f in ("tokens.npy", "starts.npy", "loss_mask.npy"))
        end = starts[1]
        answer = tokenizer(docs[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert tokens[end - len(answer):end].tolist() == answer  # the completion closes the first document
        assert mask[:end].tolist() == [0] * (end - len(answer)) + [1] * len(answer), name
        labels = PackedCorpus.open(folder, SEQ).sequence(0)["labels"]
        assert (labels[:end - len(answer)] == -100).all() and (labels[end - len(answer):end] >= 0).all()
    with pytest.raises(OnboardError, match="--mask-prompt needs prompt \\+ completion fields or chat messages"):
        prepare_text(corpus / "docs.jsonl", tokenizer_dir, tmp_path / "cache", mask_prompt=True)


def test_adapted_models_keep_packed_documents_apart_and_a_model_that_does_not_is_refused(models_with_tokenizers,
                                                                                         corpus, capsys):
    """Softmax attention (Mixtral), the gated delta rule beside softmax (Qwen3-Next) and lightning attention beside
    softmax (MiniMax) keep a packed document's logits those of the document alone; Jamba's Mamba1 mixer is given no
    boundaries by its HuggingFace layer and carries its state across: its bundle says so and training on packed
    text is refused."""
    kept = {family: json.loads((bundle / "verification.json").read_text())["packed"]
            for family, (_, bundle) in models_with_tokenizers.items()}
    assert kept["mixtral"]["kept_apart"] and kept["qwen3_next"]["kept_apart"] and kept["minimax"]["kept_apart"]
    assert not kept["jamba"]["kept_apart"] and kept["jamba"]["max_rel_error"] > 1e-2
    model_dir, bundle = models_with_tokenizers["jamba"]
    assert main(["train", str(bundle), "--weights", str(model_dir), "--data", str(corpus / "docs.jsonl")]) == 1
    assert "lets them see each other" in capsys.readouterr().err


def test_training_on_text_starts_from_the_models_own_loss_and_logs_held_out_perplexity(models_with_tokenizers,
                                                                                        corpus, tmp_path):
    model_dir, bundle = models_with_tokenizers["mixtral"]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"dtype": "fp32", "seq_len": SEQ, "micro_batch": 2, "schema_version": 1}))
    log = tmp_path / "run.jsonl"
    assert main(["train", str(bundle), "--weights", str(model_dir), "--plan", str(plan), "--data",
                 str(corpus / "docs.jsonl"), "--eval-data", str(corpus / "held_out.jsonl"), "--eval-every", "2",
                 "--steps", "4", "--runlog", str(log), "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4] and evals[1]["loss"] < evals[0]["loss"]
    assert all(e["perplexity"] == pytest.approx(math.exp(e["loss"])) for e in evals)
    # HuggingFace's own loss of the first packed batch: its attention masks by the restarting positions
    corpus_dir = next(f for f in (bundle / "data").iterdir()
                      if json.loads((f / "corpus.json").read_text())["files"] == [str(corpus / "docs.jsonl")])
    inputs = model_inputs(PackedCorpus.open(corpus_dir, SEQ), 0, 0, 0, grad_accum=1, dp=1, micro_batch=2)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(input_ids=inputs["input_ids"], labels=inputs["labels"],
                           position_ids=inputs["position_ids"], use_cache=False).loss
    assert steps[0]["loss"] == pytest.approx(float(theirs), rel=1e-5)


def test_text_data_errors_are_one_line(models_with_tokenizers, corpus, tmp_path, capsys):
    model_dir, bundle = models_with_tokenizers["mixtral"]
    assert main(["train", str(bundle), "--data", str(corpus / "docs.jsonl")]) == 1
    assert "give --weights MODEL" in capsys.readouterr().err
    assert main(["train", str(bundle), "--weights", str(model_dir), "--data", str(corpus / "empty.jsonl")]) == 1
    assert "empty.jsonl" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if not f.name.startswith(("tokenizer", "chat_template", "special")):
            os.symlink(f, bare / f.name)
    assert main(["train", str(bundle), "--weights", str(bare), "--data", str(corpus / "docs.jsonl")]) == 1
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["train", str(bundle), "--weights", str(model_dir), "--data", str(corpus / "docs.csv")]) == 1
    assert "no such" in capsys.readouterr().err


def _write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("name, content, words", [
    ("n.jsonl", '{"text": "the model"}\n{"text": 5}\n', "record 2: 'text' must be text, not int"),
    ("p.jsonl", '{"prompt": ["a"], "completion": "b"}\n', "'prompt' must be text, not list"),
    ("m.jsonl", '{"messages": "hi"}\n', "'messages' must be a list"),
    ("r.jsonl", '{"messages": [{"role": "user", "content": 3}]}\n', "messages[0].content' must be text"),
    ("l.jsonl", '[1, 2]\n', "a record must be a JSON object, not list"),
    ("j.jsonl", '{"text": "a"}\n{"text": \n', "line 2: not JSON"),
    ("d.jsonl", "[" * 100000 + "\n", "nested too deeply"),
    ("u.txt", b"the model\n\n\xff\xfe routes\n", "not UTF-8"),
    ("a.json", '[{"text": "a"}, 7]', "record 2: a record must be a JSON object"),
    ("x.parquet", "not parquet at all", "not readable as parquet"),
], ids=["text a number", "prompt a list", "messages text", "content a number", "record a list", "broken line",
        "deep nesting", "not utf-8", "json array of non-objects", "not parquet"])
def test_bad_records_are_one_line_naming_file_and_record(name, content, words, tmp_path):
    path = _write(tmp_path / name, content)
    _tokenizer(tmp_path / "tok")
    with pytest.raises(OnboardError, match=None) as caught:
        prepare_text(path, tmp_path / "tok", tmp_path / "cache")
    message = str(caught.value)
    assert str(path) in message and words in message and "\n" not in message, message


@pytest.mark.parametrize("name", ["big.jsonl", "big.txt"])
def test_a_record_over_the_cap_is_refused_before_it_is_read_whole(name, tmp_path, monkeypatch):
    """The reader never holds more than the cap of one line: a gigabyte line costs what the cap costs. (The cap
    is lowered here so the test writes 3 MiB, not a gigabyte.)"""
    import tracemalloc

    import onboard.train.data as data

    monkeypatch.setattr(data, "RECORD_CAP", 2**20)
    path = tmp_path / name
    with open(path, "w") as f:
        f.write('{"text": "the"}\n' if name.endswith("jsonl") else "the\n\n")
        f.write(('{"text": "' if name.endswith("jsonl") else "") + "a " * (3 * 2**19) + "\n")
    _tokenizer(tmp_path / "tok")
    tracemalloc.start()
    try:
        with pytest.raises(OnboardError, match="longer than the 1 MiB cap on one record") as caught:
            prepare_text(path, tmp_path / "tok", tmp_path / "cache")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = "line 2" if name.endswith("jsonl") else "line 3"
    assert line in str(caught.value) and peak < 2.5 * 2**20 * 4, peak  # a str of the cap, UCS-4 at worst


def test_a_fifo_as_data_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "data.jsonl")
    with pytest.raises(OnboardError, match="not a regular file"):
        prepare_text(tmp_path / "data.jsonl", tmp_path / "tok", tmp_path / "cache")


def _eval_loss(model, corpus_dir, dp: int, batches: int, micro_batch: int) -> float:
    """The held-out loss as the loop computes it (`runtime.train.loop._evaluate`): every rank's windows, mean
    over their target tokens."""
    corpus = PackedCorpus.open(corpus_dir, SEQ)
    total = count = 0.0
    for rank in range(dp):
        for micro in range(batches):
            inputs = model_inputs(corpus, 0, micro, rank, grad_accum=batches, dp=dp, micro_batch=micro_batch)
            targets = int((inputs["labels"][..., 1:] != -100).sum())
            with torch.no_grad():
                loss = model(input_ids=inputs["input_ids"], labels=inputs["labels"],
                             position_ids=inputs["position_ids"], use_cache=False).loss
            total, count = total + float(loss) * targets, count + targets
    return total / count


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["qwen3_next", pytest.param("deepseek_v3", marks=pytest.mark.discovery)])
def test_the_whole_job_on_four_processes_reloads_in_transformers_and_peft(forked_torchrun, family, models_with_tokenizers, corpus,
                                                                          tmp_path):
    """Released weights, text tokenised by the model's tokenizer, four gloo processes with FSDP2 + expert
    parallelism + LoRA, a PEFT adapter and a merged checkpoint exported: both reload in plain transformers (+ peft)
    to the same model, and where transformers' own code reads packed documents (softmax attention) it gives the
    held-out loss the trained model logged. A hybrid with linear attention and an MLA model with shared experts
    (the held-out loss checked on it); Mixtral's four-process run with the same plan, released weights and both
    exports is test_weights' (its text on one process is above)."""
    from peft import PeftModel

    model_dir, bundle = models_with_tokenizers[family]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"dp_shard": 4, "ep": 2, "dtype": "fp32", "seq_len": SEQ, "schema_version": 1,
                                "lora": {"rank": 4, "alpha": 8, "targets": ["attention", "experts"]}}))
    log = tmp_path / "run.jsonl"
    assert main(["train", str(bundle), "--weights", str(model_dir), "--plan", str(plan), "--data",
                 str(corpus / "docs.jsonl"), "--eval-data", str(corpus / "held_out.jsonl"), "--steps", "2", "--lr",
                 "0.01", "--runlog", str(log), "--checkpoint-dir", str(tmp_path / "ck"), "--threads", "1",
                 "--export-peft", str(tmp_path / "peft"), "--export-hf", str(tmp_path / "hf")]) == 0  # 1 thread a rank
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    via_peft = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    via_hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(5, 20, (1, SEQ), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = via_peft(input_ids=ids).logits, via_hf(input_ids=ids).logits
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    if family != "qwen3_next":  # transformers' gated delta rule in torch takes no packed documents: it stops here
        logged = [json.loads(line) for line in log.read_text().splitlines() if '"eval"' in line][-1]
        held_out = next(f for f in (bundle / "data").iterdir()
                        if json.loads((f / "corpus.json").read_text())["files"] == [str(corpus / "held_out.jsonl")])
        assert _eval_loss(via_hf, held_out, 4, 4, 1) == pytest.approx(logged["loss"], rel=1e-5)
