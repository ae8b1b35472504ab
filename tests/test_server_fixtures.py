"""Shared helpers for the server / bench / eval tests (no tests here).

* :func:`make_served_model` writes a tiny random GLM-4.5-family checkpoint (plus random MTP
  layers) and a small byte-level BPE ``tokenizer.json`` trained on GSM8K train text, so real
  text round-trips and GSM8K prompts tokenize sensibly. ``<|endoftext|>`` (id 0) is the EOS.
* :class:`ServerProcess` runs ``mtpspec serve`` as a subprocess on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import List, Optional

import torch

from test_engine_fixtures import repo_env

from mtpspec.data.gsm8k import bundled_gsm8k_dir

torch.set_num_threads(1)  # the CI box has 2 cores shared by the test process and the server processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = bundled_gsm8k_dir()  # the copy shipped in the package (mtpspec/data/gsm8k)
VOCAB = 301  # not a multiple of 8: the vocab shards carry padding
MAX_POS = 2048


def gsm8k_rows(split: str, n: int) -> List[dict]:
    rows = []
    with open(os.path.join(GSM8K_DIR, f"{split}.jsonl"), encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= n:
                break
    return rows


def write_bpe_tokenizer(path: str, vocab_size: int = VOCAB) -> int:
    """Byte-level BPE on 300 GSM8K train rows; returns the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows("train", 300)]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0
    return tok.get_vocab_size()


def make_served_model(path: str, seed: int = 0, **overrides) -> None:
    """Checkpoint + tokenizer in ``path`` (vocab 301, 2048 positions, EOS id 0)."""
    from tiny_models import make_tiny_checkpoint
    cfg = dict(vocab_size=VOCAB, max_position_embeddings=MAX_POS, eos_token_id=0, bos_token_id=0)
    cfg.update(overrides)
    make_tiny_checkpoint(path, seed=seed, num_mtp_layers=1, **cfg)
    n = write_bpe_tokenizer(path, cfg["vocab_size"])
    assert n <= cfg["vocab_size"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    return repo_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                    HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost")


class ServerProcess:
    """``python -m mtpspec.entrypoints.cli serve --model PATH ...`` on 127.0.0.1:<free port>.

    Args:
        model: checkpoint folder.
        args: extra ``mtpspec serve`` options.
        log: file for the server's output.
        port: ``None``: a free port chosen here; ``0``: ``--port 0``, the port the server's start-up
            line names (then ``log`` must be given).
    """

    def __init__(self, model: str, args: Optional[List[str]] = None, log: Optional[str] = None,
                 start_timeout_s: float = 120.0, port: Optional[int] = None):
        self.port = free_port() if port is None else port
        cmd = [sys.executable, "-m", "mtpspec.entrypoints.cli", "serve", "--model", model, "--port", str(self.port),
               "--device", "cpu", "--torch-threads", "1"] + list(args or [])
        self.log_path = log or os.path.join(model, f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
        deadline = time.monotonic() + start_timeout_s
        while self.port == 0 and time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r" on http://127\.0\.0\.1:(\d+)", self.log())
            self.port = int(m.group(1)) if m else 0
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready(max(0.0, deadline - time.monotonic()))

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def metric_value(text: str, name: str, labels: Optional[dict] = None) -> float:
    """One sample of a Prometheus exposition (``name`` as exposed, e.g. ``..._total``)."""
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return float(s.value)
    raise KeyError(f"no sample {name} {labels or ''}")
