"""vLLM's greedy ids for a list of jobs, one model after another in one process (vLLM's CPU start-up is
the slow part). Runs in the engines venv (scripts/install_engines.sh), never imported by the tests:

    .venv-engines/bin/python tests/engines/vllm_generate.py JOBS.json RESULTS.json

A job is {"name", "model" (HF dir), "prompt" (ids), "new_tokens", "llm_kwargs", "dtype" (default float32)};
each result is {"ids": [...]} or {"error": "...", "traceback": "..."}, written after every job. The first job
that fails ends the process: what a failed model leaves behind in vLLM's process state must not decide the
next job's result (a MiniMax-M2 that failed its router assert made the Mixtral after it fail), so the caller
(tests/test_engines.py) runs the remaining jobs in a fresh process.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def generate(job: dict, dtype: str = "float32") -> list[int]:
    from vllm import LLM, SamplingParams

    # float32 as transformers' oracle; no tokenizer (ids in, ids out); eager: no torch.compile start-up
    # one process for everything (uni executor, VLLM_ENABLE_V1_MULTIPROCESSING=0 from the caller): every
    # process vLLM spawns imports it again, a minute each on 2 cores
    try:
        llm = LLM(model=job["model"], dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_model_len=64,
                  max_num_seqs=1, seed=0, distributed_executor_backend="uni", **job.get("llm_kwargs", {}))
        params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True, detokenize=False)
        out = llm.generate([{"prompt_token_ids": job["prompt"]}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)
    finally:
        # a model that failed half-way leaves its parallel groups behind, and the next model would find them
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm = None
        cleanup_dist_env_and_memory()
        gc.collect()


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = {}
    for job in jobs:
        try:
            results[job["name"]] = {"ids": generate(job, job.get("dtype", "float32"))}
        except Exception as exc:  # reported per job; the test decides what it means
            results[job["name"]] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                                    "traceback": traceback.format_exc()[-6000:]}
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"vllm: {job['name']}: {results[job['name']]}", flush=True)
        if "error" in results[job["name"]]:
            break  # the rest in a fresh process (see the module docstring)


if __name__ == "__main__":
    main(*sys.argv[1:])
