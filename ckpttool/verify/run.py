"""verify: prove a conversion by running it. One process per model-parallel rank loads its
`model{rank}-mp{N}.safetensors` strictly into the bundled model (ckpttool.model), generates greedily,
and, with a reference HF checkpoint, compares its logits to the same model run unsharded.

Launch: `run_verify` starts the ranks itself (forked from a forkserver; gloo on CPU, NCCL on CUDA),
hosting the rendezvous store on a kernel-chosen port, so there is no port race; under torchrun it
runs as the current rank. Either way each rank sees the torchrun environment (RANK, WORLD_SIZE, ...).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ckpttool.defaults import cores
from ckpttool.errors import CkptError, InputError
from ckpttool.execute.distributed import launched_by_torchrun, local_world_size
from ckpttool.families.base import Verifier
from ckpttool.families.table import family_for
from ckpttool.io.checkpoint import read_config, read_json_object
from ckpttool.io.layout import mp_file
from ckpttool.layouts.table import verify_ranks
from ckpttool.model.generate import greedy_generate, teacher_forced_logits
from ckpttool.model.parallel import ParallelContext
from ckpttool.verify.defaults import DEFAULT_PROMPT, DEFAULT_TOLERANCE, check_options
from ckpttool.verify.oracle import transformers_logits

_CONFIG_FIX = "copy the HF config.json beside the model{i}-mp{N}.safetensors files"
_GRACE_S = 5.0  # how long the other ranks get to report after one fails, before they are stopped


@dataclass(kw_only=True, slots=True)
class Check:
    ok: bool
    detail: str


@dataclass(kw_only=True)
class VerifyReport:
    """What verify found. `ok` is True only if every check passed."""

    ok: bool
    generated_ids: list[int]
    checks: dict[str, Check]
    max_abs_logit_diff: float | None
    mp: int
    prompt_ids: list[int]
    device: str
    dtype: str
    tolerance: float
    generated_text: str | None = None

    def to_json(self) -> dict:
        data = asdict(self)
        return {"ok": data.pop("ok"), "generated_ids": data.pop("generated_ids"), "checks": data.pop("checks"),
                "max_abs_logit_diff": data.pop("max_abs_logit_diff"), **data}

    @classmethod
    def from_json(cls, data: dict) -> "VerifyReport":
        checks = {name: Check(**c) for name, c in data["checks"].items()}
        return cls(**{**data, "checks": checks})

    def render(self, directory: object) -> str:
        lines = [f"verify {directory} (mp={self.mp}, {self.device}, {self.dtype})"]
        for name, check in self.checks.items():
            lines.append(f"  {'PASS' if check.ok else 'FAIL'}  {name:<9} {check.detail}")
        lines.append(f"generated ids: {self.generated_ids}")
        if self.generated_text is not None:
            lines.append(f"generated text: {self.generated_text!r}")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


@dataclass(kw_only=True)
class VerifyJob:
    """Everything a rank needs (plain data: it is pickled to spawned ranks)."""

    directory: str
    mp: int
    prompt_ids: list[int]
    max_new_tokens: int
    device: str
    dtype: str
    tolerance: float
    reference: str | None = None
    attn_impl: str = "absorb"
    logits_path: str | None = None  # rank 0 saves the float32 logits of each step here (safetensors)
    result_dir: str | None = None  # spawned ranks: where rank 0 writes result.json, any rank error-rank{r}.json


# -- the public entry point --------------------------------------------------------------------------
def run_verify(directory: Path | str, *, reference: Path | str | None = None, prompt: str | None = None,
               prompt_ids: list[int] | None = None, max_new_tokens: int = 8, device: str = "cpu",
               dtype: str = "float32", tolerance: float | None = None, mp: int | None = None,
               attn_impl: str = "absorb", logits_path: Path | str | None = None,
               timeout_s: float = 3600.0) -> VerifyReport:
    """Verify the mp shards in `directory`; raises CkptError for unusable input (no shards, bad
    options), returns a report (possibly not ok) once the model ran or failed a check.

    Ranks are started from a multiprocessing forkserver, so a script calling this must guard its
    top level with `if __name__ == "__main__":` (as with torch.multiprocessing.spawn)."""
    directory = Path(directory)
    mp = verify_ranks(directory, mp)
    config_path = directory / "config.json"
    family_for(read_config(config_path, missing_fix=_CONFIG_FIX), config_path)  # before any rank starts
    if device == "auto":  # one GPU per rank when there are enough, else CPU
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= mp else "cpu"
    check_options(device=device, dtype=dtype, attn_impl=attn_impl, max_new_tokens=max_new_tokens, prompt=prompt,
                  prompt_ids=prompt_ids, ranks_here=local_world_size() if launched_by_torchrun() else mp,
                  gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if reference is not None and not (Path(reference) / "config.json").is_file():
        raise InputError("reference directory has no config.json", file=reference,
                         fix="pass the HF checkpoint the shards were converted from")
    ids = list(prompt_ids) if prompt_ids is not None else encode_prompt(directory, prompt or DEFAULT_PROMPT)
    if not ids:
        raise InputError("the prompt is empty", fix="pass a non-empty --prompt or --prompt-ids")
    job = VerifyJob(directory=str(directory.resolve()), mp=mp, prompt_ids=ids, max_new_tokens=max_new_tokens,
                    device=device, dtype=dtype, reference=None if reference is None else str(Path(reference).resolve()),
                    tolerance=DEFAULT_TOLERANCE[dtype] if tolerance is None else float(tolerance),
                    attn_impl=attn_impl, logits_path=None if logits_path is None else str(logits_path))
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != mp:
            raise InputError(f"torchrun started {world} processes but the directory holds mp={mp} shards",
                             file=directory, fix=f"run torchrun --nproc-per-node {mp}")
        report = run_rank(job)
    else:
        report = _spawn_ranks(job, timeout_s)
    report.generated_text = decode_ids(directory, report.generated_ids)
    return report


def reports_here() -> bool:
    """Started by torchrun, only rank 0 prints the report (every rank computes it)."""
    return not launched_by_torchrun() or os.environ.get("RANK") == "0"


def load_family(directory: Path) -> tuple[Verifier, object]:
    """The bundled model's side of the family config.json in `directory` names, and its args."""
    path = directory / "config.json"
    raw = read_config(path, missing_fix=_CONFIG_FIX)
    verifier = family_for(raw, path).verifier()
    return verifier, verifier.load_args(raw, path)


# -- tokenizer (optional dependency: `tokenizers`) ---------------------------------------------------
def _tokenizer(directory: Path):
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InputError("--prompt needs the `tokenizers` package", fix="pip install tokenizers, or pass --prompt-ids") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own exception type
        raise InputError(f"cannot load tokenizer.json: {str(exc)[:200]}", file=path,
                         fix="re-copy tokenizer.json from the checkpoint, or pass --prompt-ids 1,2,3") from None


def encode_prompt(directory: Path, text: str) -> list[int]:
    """Token ids of `text`, with BOS first when tokenizer_config.json asks for it."""
    tok = _tokenizer(directory)
    if tok is None:
        raise InputError("no tokenizer.json beside the shards", file=directory,
                         fix="copy the tokenizer files beside the shards, or pass --prompt-ids 1,2,3")
    ids = tok.encode(text, add_special_tokens=False).ids
    config_path = directory / "tokenizer_config.json"
    config = read_json_object(config_path, "tokenizer_config.json", "fix or re-copy tokenizer_config.json from "
                              "the checkpoint, or pass --prompt-ids") if os.path.lexists(config_path) else {}
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if config.get("add_bos_token") and isinstance(bos, str) and tok.token_to_id(bos) is not None:
        ids = [tok.token_to_id(bos), *ids]
    return ids


def decode_ids(directory: Path, ids: list[int]) -> str | None:
    try:
        tok = _tokenizer(directory)
    except InputError:
        return None
    return None if tok is None else tok.decode(ids, skip_special_tokens=False)


# -- one rank ----------------------------------------------------------------------------------------
def run_rank(job: VerifyJob) -> VerifyReport:
    """The program every rank runs; returns the same report on every rank."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    if job.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if job.device == "cuda" else "gloo", timeout=timedelta(minutes=30))
    try:
        return _run_rank(job, rank, world, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _run_rank(job: VerifyJob, rank: int, world: int, device: torch.device) -> VerifyReport:
    ctx = ParallelContext(rank, world)
    dtype = getattr(torch, job.dtype)
    torch.manual_seed(0)
    directory = Path(job.directory)
    family, args = load_family(directory)
    _check_prompt(job.prompt_ids, args.vocab_size)
    with torch.device(device):
        model = family.build(args, ctx, dtype, job.attn_impl)

    shard = directory / mp_file(rank, world)
    checks: dict[str, Check] = {}
    skipped = 0
    try:
        skipped = family.load_shard(model, shard) or 0
        load_problems = []
    except InputError as exc:
        load_problems = [str(exc)]
    load_problems = _gather(load_problems, world)
    n_params = sum(1 for _ in model.parameters())
    skipped = skipped if isinstance(skipped, dict) else {"MTP": skipped}
    note = "".join(f"; {n} MTP tensor(s) on rank {rank} skipped: verify runs the main model, the MTP layer is "
                   "neither loaded nor checked" if what == "MTP" else
                   f"; {n} {what} tensor(s) on rank {rank} skipped: verify runs the text model"
                   for what, n in skipped.items() if n)
    checks["load"] = Check(ok=not load_problems, detail="\n".join(load_problems) or
                           f"{world} shard(s) loaded strictly ({n_params} tensors on rank {rank}){note}")
    generated, diff = [], None
    if load_problems:
        for name in ("weights",) * bool(job.reference) + ("finite", "generate") + ("reference",) * bool(job.reference):
            checks[name] = Check(ok=False, detail="not run: loading failed")
    else:
        if job.reference:
            try:
                problems = family.weight_differences(model, ctx, Path(job.reference), args.n_layers, shard)
            except CkptError as exc:
                problems = [f"reference did not load: {exc}"]
            problems = _gather(problems, world)
            checks["weights"] = Check(ok=not problems, detail="\n".join(problems) or
                                      "every tensor equals its slice of the reference (quantized compared dequantized)")
        generated, logits = greedy_generate(model, job.prompt_ids, job.max_new_tokens, args.eos_token_ids)
        finite = bool(torch.isfinite(logits).all())
        checks["finite"] = Check(ok=finite, detail=f"logits at {len(generated)} step(s) are "
                                                   + ("finite" if finite else "NOT finite (NaN or inf)"))
        checks["generate"] = Check(ok=True, detail=f"{len(generated)} new token(s): {generated}")
        if rank == 0 and job.logits_path:
            save_file({"logits": logits.contiguous()}, job.logits_path)
        if job.reference and rank == 0:
            del model  # free this rank's shard before the whole reference model is built
            checks["reference"], diff = _compare_to_reference(job, logits, generated, dtype, device)
    if job.reference and world > 1:  # only rank 0 ran the reference: share its verdict
        shared = [checks.get("reference"), diff]
        dist.broadcast_object_list(shared, src=0)
        checks["reference"], diff = shared
    report = VerifyReport(ok=all(c.ok for c in checks.values()), generated_ids=generated, checks=checks,
                          max_abs_logit_diff=diff, mp=world, prompt_ids=job.prompt_ids, device=job.device,
                          dtype=job.dtype, tolerance=job.tolerance)
    if world > 1:
        dist.barrier()
    return report


def _gather(problems: list[str], world: int) -> list[str]:
    """Every rank's problems, on every rank, so all ranks take the same branch afterwards."""
    if world == 1:
        return problems
    everyone: list = [None] * world
    dist.all_gather_object(everyone, problems)
    return [p for rank_problems in everyone for p in rank_problems]


def _compare_to_reference(job: VerifyJob, logits: torch.Tensor, generated: list[int], dtype: torch.dtype,
                          device: torch.device) -> tuple[Check, float | None]:
    """The reference model on the HF checkpoint, teacher-forced on the generated ids: transformers'
    own implementation where it can (verify/oracle.py), else the bundled model at mp=1."""
    reference = Path(job.reference)
    expected, oracle = transformers_logits(reference, job.prompt_ids, generated, dtype, device)
    if expected is None:
        oracle = f"the bundled model at mp=1 ({oracle})"
        try:
            family, args = load_family(reference)
            with torch.device(device):
                model = family.build(args, ParallelContext(), dtype, job.attn_impl)
            family.load_hf(model, reference, args.n_layers)
        except CkptError as exc:
            return Check(ok=False, detail=f"reference {reference} did not load: {exc}"), None
        expected = teacher_forced_logits(model, job.prompt_ids, generated)
    diff = float((expected - logits).abs().max())
    ok = diff <= job.tolerance  # False for NaN too
    if not math.isfinite(diff):
        return Check(ok=False, detail=f"logit difference against {reference} is {diff}"), None
    same_ids = expected.argmax(-1).tolist() == generated
    detail = (f"max |logit diff| {diff:.3g} {'<=' if ok else '>'} tolerance {job.tolerance:g} against {oracle} "
              f"on {reference}; greedy ids {'agree' if same_ids else 'DIFFER'}")
    return Check(ok=ok, detail=detail), diff


def _check_prompt(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InputError(f"prompt ids {bad} are outside the vocabulary [0, {vocab_size})",
                         fix="pass token ids of this model's tokenizer")


# -- spawning ranks ----------------------------------------------------------------------------------
# Ranks are forked from a forkserver that has imported torch and this module once, so starting N
# ranks costs N forks, not N interpreter starts; the forkserver never touches CUDA, so NCCL is safe.
def _spawn_ranks(job: VerifyJob, timeout_s: float) -> VerifyReport:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ckpttool.verify.run"])
    with tempfile.TemporaryDirectory(prefix="ckpttool-verify-") as tmp:
        job.result_dir = tmp
        # We host the store on a port the kernel picks; ranks connect as clients, as under torchrun's agent.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = [context.Process(target=_rank_process, args=(job, rank, store.port), name=f"verify-rank{rank}")
                 for rank in range(job.mp)]
        try:
            for p in procs:
                p.start()
            _wait(procs, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            del store
        return _collect(Path(tmp), procs)


def _rank_process(job: VerifyJob, rank: int, port: int) -> None:
    """Body of a spawned rank: torchrun's environment, output to rank{r}.log, then run. Rank 0 writes
    result.json; a CkptError goes to error-rank{r}.json; anything else is a traceback in the log."""
    out = Path(job.result_dir)
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job.mp), LOCAL_WORLD_SIZE=str(job.mp),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    if job.device == "cpu":  # ranks share the cores instead of fighting over them
        torch.set_num_threads(max(1, cores() // job.mp))
    try:
        report = run_rank(job)
    except CkptError as exc:
        (out / f"error-rank{rank}.json").write_text(json.dumps({"message": str(exc)}))
        sys.exit(3)
    if rank == 0:
        (out / "result.json.tmp").write_text(json.dumps(report.to_json()))
        (out / "result.json.tmp").rename(out / "result.json")


def _wait(procs: list, timeout_s: float) -> None:
    deadline, failed_at = time.monotonic() + timeout_s, None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now  # the others are likely blocked in a collective: give them a moment, then stop
        if now > deadline or (failed_at is not None and now - failed_at > _GRACE_S):
            return
        time.sleep(0.02)


def _collect(tmp: Path, procs: list) -> VerifyReport:
    for error_path in (tmp / f"error-rank{rank}.json" for rank in range(len(procs))):
        if error_path.exists():
            raise InputError(json.loads(error_path.read_text())["message"])
    result = tmp / "result.json"
    if all(p.exitcode == 0 for p in procs) and result.exists():
        return VerifyReport.from_json(json.loads(result.read_text()))
    # a rank that failed first before the ones stopped after it (_wait's grace, then kill)
    for rank, p in sorted(enumerate(procs), key=lambda rank_p: rank_p[1].exitcode == -signal.SIGKILL):
        if p.exitcode != 0:
            log = tmp / f"rank{rank}.log"  # none where the rank died before its body opened it
            lines = log.read_bytes().decode(errors="replace").strip().splitlines() if log.exists() else ["(no log)"]
            tail = "\n    ".join(lines[-15:])
            raise CkptError(f"verify rank {rank} exited with code {p.exitcode}:\n    {tail}",
                            fix="report a bug with this output if the checkpoint and options look right")
    raise CkptError("verify ranks did not finish in time", fix="raise the timeout or check the ranks' load")
