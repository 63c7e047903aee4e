"""llama.cpp's greedy ids (through llama-cpp-python) for a list of jobs: convert each HF dir to an f32 GGUF
with the converter llama.cpp ships (convert_hf_to_gguf.py), then evaluate it. Runs in the engines venv
(scripts/install_engines.sh), never imported by the tests:

    .venv-engines/bin/python tests/engines/llama_cpp_generate.py JOBS.json RESULTS.json

A job is {"name", "model" (HF dir), "gguf" (path to write), "prompt" (ids), "new_tokens"}; each result is
{"ids": [...]} or {"error": "...", "stage": "convert"|"run", "traceback": "..."}, written after every job; the
first job that fails ends the process, and the caller runs the rest in a fresh one (as vllm_generate.py).

The tiny test models carry no real tokenizer, and the converter insists on a known one (it hashes the
pre-tokenizer's output): the model class's set_vocab is replaced by a byte-level BPE vocabulary of the
model's vocab_size. Ids go in and come out, so the vocabulary's contents never touch the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

CONVERTER = Path(sys.prefix) / "llama.cpp-convert"  # where install_engines.sh puts convert_hf_to_gguf.py


def _byte_vocab(self) -> None:
    import gguf
    from gguf.vocab import SpecialVocab  # noqa: F401  (the converter's own package, as it would use it)

    # GPT-2's byte -> printable character table: the 256 tokens a byte-level BPE vocabulary starts with
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    n = int(self.hparams["vocab_size"])
    tokens = (chars + [f"<t{i}>" for i in range(max(0, n - 256))])[:n]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list(tokens)
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges([f"{chars[32]} {chars[32]}"])  # llama.cpp requires the key


def convert(model: str, out: str) -> None:
    sys.path.insert(0, str(CONVERTER))
    import convert_hf_to_gguf as conv

    get_class = conv.get_model_class

    def with_byte_vocab(*args, **kwargs):
        cls = get_class(*args, **kwargs)
        cls.set_vocab = _byte_vocab
        return cls

    conv.get_model_class = with_byte_vocab
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
    try:
        conv.main()
    finally:
        sys.argv = argv


def generate(gguf_path: str, prompt: list[int], new_tokens: int) -> list[int]:
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    # logits_all: llama-cpp-python keeps `scores` only then; the KV cache in f32 too (its default, f16, moves
    # logits by ~1e-3, enough to flip a near-tie against transformers' float32)
    f32 = llama_cpp.GGML_TYPE_F32
    llm = Llama(model_path=gguf_path, n_ctx=64, n_batch=64, n_threads=os.cpu_count() or 1, seed=0, logits_all=True,
                type_k=f32, type_v=f32, verbose=False)
    try:
        llm.eval(prompt)
        ids = []
        for _ in range(new_tokens):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            ids.append(token)
            llm.eval([token])
        return ids
    finally:
        llm.close()


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = {}
    for job in jobs:
        stage = "convert"
        try:
            if os.path.exists(job["gguf"]):
                os.remove(job["gguf"])
            # each conversion in a fresh process: the converter keeps state in its module and classes
            proc = subprocess.run([sys.executable, __file__, "--convert", job["model"], job["gguf"]],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"convert_hf_to_gguf.py exited {proc.returncode}: {proc.stderr[-3000:]}")
            stage = "run"
            results[job["name"]] = {"ids": generate(job["gguf"], job["prompt"], job["new_tokens"])}
        except BaseException as exc:  # SystemExit from the converter too: reported per job
            results[job["name"]] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "stage": stage,
                                    "traceback": traceback.format_exc()[-6000:]}
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"llama.cpp: {job['name']}: {results[job['name']]}", flush=True)
        if "error" in results[job["name"]]:
            break


if __name__ == "__main__":
    if sys.argv[1] == "--convert":
        convert(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
