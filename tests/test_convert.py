"""convert / shard / dequant against the reference pipeline, bit for bit and key for key."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from conftest import assert_same_tensors, load_dir, run_cli
from reference_pipeline import formula_dequant, reference_convert, reference_dequant


@pytest.mark.parametrize("mp", [1, 2, 4])
def test_fused_convert_equals_reference_two_pass(tiny_v3_no_mtp, tmp_path, mp):
    ref = reference_convert(reference_dequant(tiny_v3_no_mtp, tmp_path / "ref-bf16"), tmp_path / "ref", mp)
    run_cli("convert", tiny_v3_no_mtp, tmp_path / "ours", "--mp", mp, "--dtype", "bf16", "--quiet")
    assert_same_tensors(load_dir(tmp_path / "ours"), load_dir(ref))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tiny_v3_no_mtp / name).read_bytes()


@pytest.mark.parametrize("mp", [2, 4])
def test_shard_bf16_v2_lite_equals_reference(tiny_v2_lite, tmp_path, mp):
    ref = reference_convert(tiny_v2_lite, tmp_path / "ref", mp)
    run_cli("shard", tiny_v2_lite, tmp_path / "ours", "--mp", mp, "--quiet")
    assert_same_tensors(load_dir(tmp_path / "ours"), load_dir(ref))


def test_shard_keeps_fp8_with_split_scales_like_reference(tiny_v3_no_mtp, tmp_path):
    ref = reference_convert(tiny_v3_no_mtp, tmp_path / "ref", 2)
    run_cli("shard", tiny_v3_no_mtp, tmp_path / "ours", "--mp", 2, "--quiet")
    ours = load_dir(tmp_path / "ours")
    assert_same_tensors(ours, load_dir(ref))
    assert ours["model0-mp2.safetensors"]["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert "layers.1.attn.wq_b.scale" in ours["model1-mp2.safetensors"]
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"  # still FP8: config says so


def test_experts_keep_global_indices_in_contiguous_ranges(tiny_v3, tmp_path):
    run_cli("convert", tiny_v3, tmp_path / "out", "--mp", 4, "--quiet")
    shards = load_dir(tmp_path / "out")
    for rank in range(4):
        experts = {int(k.split(".")[4]) for k in shards[f"model{rank}-mp4.safetensors"] if ".experts." in k}
        assert experts == {2 * rank, 2 * rank + 1}


def test_dequant_hf_output_loads_in_transformers_as_plain_bf16(tiny_v3, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "bf16"
    run_cli("dequant", tiny_v3, out, "--quiet")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if k.endswith("_scale_inv")]
    sizes = 0
    for fname in set(index["weight_map"].values()):
        with safe_open(str(out / fname), "pt") as h:
            sizes += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys())
    assert index["metadata"]["total_size"] == sizes
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    # an HF output keeps the MTP layer by default (vLLM and SGLang use it for speculative decoding)
    assert config["num_nextn_predict_layers"] == 1 and "model.layers.3.eh_proj.weight" in index["weight_map"]

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    state = model.state_dict()
    src = load_dir(tiny_v3)
    flat_src = {k: v for f in src.values() for k, v in f.items()}
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    expected = formula_dequant(flat_src[name], flat_src[name + "_scale_inv"])
    # transformers may fuse experts; compare through whichever layout it uses
    if name in state:
        assert torch.equal(state[name], expected)
    else:
        fused = state["model.layers.1.mlp.experts.down_proj"]
        assert torch.equal(fused[5], expected) or torch.equal(fused[5].T, expected)
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 9, 11]])).logits
    assert torch.isfinite(logits).all()


def test_keep_mtp_keeps_layers_and_config(tiny_v3, tmp_path):
    run_cli("dequant", tiny_v3, tmp_path / "out", "--keep-mtp", "--quiet")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "model.layers.3.eh_proj.weight" in index["weight_map"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_runs_are_byte_identical_and_manifest_checks(tiny_v3, tmp_path):
    for d in ("a", "b"):
        run_cli("convert", tiny_v3, tmp_path / d, "--mp", 2, "--quiet", "--workers", 1 if d == "a" else 4)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes(), n
    assert run_cli("inspect", tmp_path / "a", "--check").returncode == 0
    with open(tmp_path / "a" / "model1-mp2.safetensors", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x01\x02\x03")
    proc = run_cli("inspect", tmp_path / "a", "--check", check=False)
    assert proc.returncode == 1 and "model1-mp2.safetensors: blake3 mismatch" in proc.stdout


def test_manifest_hash_is_b3sum_and_older_sha256_manifests_still_check(tiny_v3, tmp_path):
    import hashlib
    import json

    from blake3 import blake3

    from ckpttool.io.layout import MANIFEST

    dst = tmp_path / "o"
    run_cli("convert", tiny_v3, dst, "--mp", 2, "--quiet")
    manifest = json.loads((dst / MANIFEST).read_text())
    for name, entry in manifest["files"].items():  # what `b3sum NAME` prints
        assert entry == {"size": (dst / name).stat().st_size, "blake3": blake3((dst / name).read_bytes()).hexdigest()}
    for name, entry in manifest["files"].items():  # as an older ckpttool wrote it
        manifest["files"][name] = {"size": entry["size"], "sha256": hashlib.sha256((dst / name).read_bytes()).hexdigest()}
    (dst / MANIFEST).write_text(json.dumps(manifest))
    assert run_cli("inspect", dst, "--check").returncode == 0
    with open(dst / "model0-mp2.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    proc = run_cli("inspect", dst, "--check", check=False)
    assert proc.returncode == 1 and "model0-mp2.safetensors: sha256 mismatch" in proc.stdout
    manifest["files"]["config.json"] = {"size": 1, "xxh3": "0"}  # a hash this version does not know: refused
    (dst / MANIFEST).write_text(json.dumps(manifest))
    proc = run_cli("inspect", dst, "--check", check=False)
    assert proc.returncode != 0 and "blake3" in proc.stderr and "Traceback" not in proc.stderr


def test_cpu_dequant_matches_formula_on_partial_blocks():
    from ckpttool.kernels.fp8 import dequant_fp8_block, quantize_fp8_block

    g = torch.Generator().manual_seed(0)
    for rows, cols in [(1, 1), (127, 129), (300, 1000), (2048 + 5, 130)]:
        w, s = quantize_fp8_block(torch.randn(rows, cols, generator=g) * 3)
        assert s.shape == (-(-rows // 128), -(-cols // 128))
        ours = dequant_fp8_block(w, s)
        assert torch.equal(ours.view(torch.int16), formula_dequant(w, s).view(torch.int16))


def test_compiled_bf16_tables_equal_numpy_for_every_kind_of_scale(monkeypatch):
    """fp8_cpu.value_tables built by C and by numba (one loop per scale) against its numpy passes, bit for
    bit: fp32 scales of every exponent (subnormal, huge enough to overflow the product, negative,
    infinite, halfway between two bf16 values) times both FP8 formats' values and INT4's."""
    import numpy as np

    from ckpttool.kernels import fp8_cpu, native, numba_jit

    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32)
    bits[:200] = bits[:200] & 0xFFFF0000 | 0x8000  # exact ties for every power-of-two value: to even, up or down
    scales = bits.view(np.float32)
    scales = np.concatenate([scales[~np.isnan(scales)][:3980], np.array([np.inf, -np.inf, 0.0, -0.0, 2.0**-149],
                                                                         dtype=np.float32)]).reshape(-1, 5)
    paths = {"c": ("1", "0"), "numba": ("0", "1"), "numpy": ("0", "0")}
    if native.library() is None:
        del paths["c"]  # no C compiler at install (test_the_c_kernels_are_built says whether CI has one)
    monkeypatch.delenv("CKPTTOOL_NUMBA", raising=False)
    if not numba_jit.in_use():
        del paths["numba"]
    if len(paths) < 2:
        pytest.skip("neither C nor numba is there to compare with numpy")
    for values in (fp8_cpu.fp8_values("F8_E4M3"), fp8_cpu.fp8_values("F8_E5M2"), np.arange(-8, 8, dtype=np.float32)):
        got = {}
        for path, (c, numba) in paths.items():
            monkeypatch.setenv("CKPTTOOL_NATIVE", c)
            monkeypatch.setenv("CKPTTOOL_NUMBA", numba)
            with np.errstate(invalid="ignore"):
                got[path] = fp8_cpu.value_tables(values, scales, "BF16")
            assert got[path].shape == (*scales.shape, len(values)), path
        for path in paths:
            assert np.array_equal(got[path], got["numpy"]), path


def test_numpy_dequant_equals_torch_arithmetic_for_every_format_and_output_dtype(cpu_kernels):
    """The CPU kernel (per-block tables, bf16 rounded in integers; the gather in C, numba or numpy)
    against torch doing the same IEEE steps: fp32(code) * scale, one cast. Random codes cover subnormals
    and the largest values; a NaN code is found in its row by every gather."""
    import numpy as np

    from ckpttool.dtypes import dtype_code
    from ckpttool.kernels import fp8_cpu

    g = torch.Generator().manual_seed(1)
    for torch_fmt, fmt in ((torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2")):
        codes = torch.randint(0, 256, (300, 260), dtype=torch.uint8, generator=g)
        finite = codes.view(torch_fmt).float().isfinite()
        codes = torch.where(finite, codes, torch.zeros_like(codes))  # NaN codes are refused, tested below
        scale = torch.rand(3, 3, generator=g) * 4 + 2.0 ** -20
        exact = codes.view(torch_fmt).float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
        for out, carrier in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32)):
            ours = fp8_cpu.dequant(codes.numpy(), scale.numpy(), fmt, dtype_code(out))
            theirs = exact.to(out).view(carrier).numpy()
            assert np.array_equal(ours.view(theirs.dtype), theirs), (fmt, out)
            bad = codes.numpy().copy()
            bad[201, 259] = 0xFF  # NaN in both formats
            with pytest.raises(fp8_cpu.NaNCodes, match=r"first in row 201\)"):
                fp8_cpu.dequant(bad, scale.numpy(), fmt, dtype_code(out))


def test_a_nan_code_is_found_in_its_row_wherever_it_lies(cpu_kernels):
    """The compiled test reads codes eight at a time from the first 8-byte boundary and the bytes before
    and after it apart: a NaN code at any offset of an unaligned, odd-sized block of codes is refused
    in its row, in both formats and signs, and a block without one passes (every other code)."""
    import numpy as np

    from ckpttool.kernels import fp8_cpu

    for fmt, nans in (("F8_E4M3", (0x7F, 0xFF)), ("F8_E5M2", (0x7D, 0x7E, 0xFF))):
        ok = np.array([c for c in range(256) if (c & 0x7F) <= fp8_cpu.NAN_ABOVE[fmt]], dtype=np.uint8)
        backing = np.resize(ok, 3 + 5 * 7)
        codes = backing[3:].reshape(5, 7)  # 3 bytes past an 8-byte boundary: a head, one word, a tail
        scale = np.ones((1, 1), dtype=np.float32)
        fp8_cpu.dequant(codes, scale, fmt, "BF16")
        for at in range(codes.size):
            bad = codes.copy() if at % 2 else codes
            saved = bad.flat[at]
            bad.flat[at] = nans[at % len(nans)]
            with pytest.raises(fp8_cpu.NaNCodes, match=rf"first in row {at // 7}\)"):
                fp8_cpu.dequant(bad, scale, fmt, "BF16")
            bad.flat[at] = saved
    inf_scale = np.array([[np.inf]], dtype=np.float32)  # not from a checkpoint (the executor refuses it), but
    zero = np.zeros((2, 3), dtype=np.uint8)             # no caller of the kernel gets a NaN from it unnamed
    zero[0] = 0x38  # 1.0: times inf is inf, not NaN
    with pytest.raises(fp8_cpu.NaNCodes, match=r"first in row 1\)"):
        fp8_cpu.dequant(zero, inf_scale, "F8_E4M3", "BF16")


@pytest.mark.parametrize("compiled", ["C", "numba"])
def test_compiled_gathers_equal_numpy_for_any_block_and_row_stride(compiled, monkeypatch):
    """The compiled gather (C's constant 128-column loop and its general one, numba's) against numpy's for
    blocks of 32 to 256 columns, partial last blocks, and codes and output that are row slices of wider
    arrays: the same bits, and nothing written outside the output's columns."""
    import numpy as np

    from ckpttool.kernels import fp8_gather

    monkeypatch.setenv("CKPTTOOL_NATIVE", "1" if compiled == "C" else "0")
    if fp8_gather.cpu_loops() != compiled:
        pytest.skip(f"{compiled} is not there: " + ("no C compiler at install" if compiled == "C" else "numba is not installed (or CKPTTOOL_NUMBA=0)"))
    rng = np.random.default_rng(5)
    for block in (32, 64, 128, 256):
        for rows, cols in ((1, 1), (block + 3, 2 * block + 5), (2 * block, 3 * block)):
            codes = rng.integers(0, 256, (rows, cols + 7), dtype=np.uint8)[:, 3:cols + 3]
            for dtype in (np.uint16, np.uint32):
                tables = rng.integers(0, 1 << 15, (-(-rows // block), -(-cols // block) * 256), dtype=dtype)
                wide = np.full((rows, cols + 4), 7, dtype=dtype)
                fp8_gather.kernel()(codes, tables, wide[:, 2:cols + 2], block.bit_length() - 1)
                expect = np.empty((rows, cols), dtype=dtype)
                fp8_gather.gather_numpy(codes, tables.reshape(tables.shape[0], -1, 256), expect, block, 0, 1 << 31)
                assert np.array_equal(wide[:, 2:cols + 2], expect), (block, rows, cols, dtype)
                assert (wide[:, :2] == 7).all() and (wide[:, cols + 2:] == 7).all(), (block, rows, cols, dtype)


def test_the_c_kernels_are_built_where_a_compiler_is():
    """setup.py builds kernels/native/*.c at install wherever a C compiler is on PATH (CI's is), so their
    absence there means a broken build, not a missing tool: reinstall (`pip install -e .`)."""
    import shutil

    from ckpttool.kernels import native

    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on PATH: the CPU dequant runs numba's or numpy's loops")
    assert native._load() is not None, "kernels/_native*.so is missing: reinstall with `pip install -e .`"


def test_nan_codes_are_refused_naming_file_and_tensor(tiny_v3_no_mtp, tmp_path):
    import shutil

    from ckpttool.io.checkpoint import Checkpoint

    src = tmp_path / "src"
    shutil.copytree(tiny_v3_no_mtp, src)
    ckpt = Checkpoint(src)
    name = max((n for n in ckpt.tensors if ckpt.source(n).info.dtype == "F8_E4M3"),
               key=lambda n: ckpt.source(n).info.shape[0])
    info = ckpt.source(name).info
    assert info.shape[0] > 130
    with open(src / ckpt.source(name).file, "r+b") as f:
        f.seek(info.start + info.shape[1] * 130 + 7)  # row 130
        f.write(b"\x7f")
    proc = run_cli("convert", src, tmp_path / "o", "--mp", 2, "--device", "cpu", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "NaN codes (first in row 130)" in proc.stderr and name in proc.stderr and "re-download" in proc.stderr
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").glob("*.safetensors"))

    from ckpttool.errors import InputError
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    with pytest.raises(InputError, match=r"first in row 130\)"):  # row 2 of the chunk that starts at 128
        convert(src, tmp_path / "o2", Spec(dequant=True, mp=2), ExecOptions(quiet=True, device="cpu", chunk_bytes=1024))


@pytest.mark.gpu
def test_nan_codes_are_refused_on_either_device():
    from ckpttool.kernels.fp8 import dequant_fp8_block
    from ckpttool.kernels.fp8_cpu import NaNCodes

    w = torch.zeros(256, 256, dtype=torch.uint8)
    w[200, 3] = 0xFF  # -NaN in e4m3fn
    for dev in ("cpu", "cuda"):
        with pytest.raises(NaNCodes):
            dequant_fp8_block(w.view(torch.float8_e4m3fn).to(dev), torch.ones(2, 2, device=dev))


@pytest.mark.gpu
def test_cuda_names_the_same_nan_row_as_the_cpu(tiny_v3_no_mtp, tmp_path):
    """Detected inside the Triton kernel (no second pass): the first bad row, as the CPU kernel says it,
    through the API and through the executor's CUDA streams (where the row is the chunk's plus r0)."""
    import shutil

    from ckpttool.errors import InputError
    from ckpttool.io.checkpoint import Checkpoint
    from ckpttool.kernels.fp8 import dequant_fp8_block
    from ckpttool.kernels.fp8_cpu import NaNCodes
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    w = torch.zeros(384, 300, dtype=torch.uint8)
    w[[311, 200], [299, 3]] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)  # +NaN, -NaN in e4m3fn
    for dev in ("cpu", "cuda"):
        with pytest.raises(NaNCodes, match=r"first in row 200\)"):
            dequant_fp8_block(w.view(torch.float8_e4m3fn).to(dev), torch.ones(3, 3, device=dev))
    src = tmp_path / "src"
    shutil.copytree(tiny_v3_no_mtp, src)
    with Checkpoint(src) as ckpt:
        name = max((n for n in ckpt.tensors if ckpt.source(n).info.dtype == "F8_E4M3"),
                   key=lambda n: ckpt.source(n).info.shape[0])
        info, file = ckpt.source(name).info, ckpt.source(name).file
    with open(src / file, "r+b") as f:
        f.seek(info.start + info.shape[1] * 130 + 7)  # row 130
        f.write(b"\x7f")
    with pytest.raises(InputError, match=r"first in row 130\)") as err:
        convert(src, tmp_path / "o", Spec(dequant=True, mp=2),
                ExecOptions(quiet=True, device="cuda", chunk_bytes=1024, wait_for_cuda=True))
    assert name in str(err.value)


@pytest.mark.gpu
def test_triton_dequant_bits_equal_cpu_and_reference_kernel():
    import importlib.util

    from ckpttool.kernels.fp8 import dequant_fp8_block, quantize_fp8_block
    from conftest import require_seeds

    spec = importlib.util.spec_from_file_location("ref_kernel", require_seeds() / "kernel.py")
    ref_kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref_kernel)
    g = torch.Generator().manual_seed(1)
    torch.set_default_dtype(torch.bfloat16)  # the reference kernel allocates its output in the default dtype
    try:
        for rows, cols in [(128, 128), (300, 1000), (7168, 2048), (2048, 7168), (576, 7168)]:
            w, s = quantize_fp8_block(torch.randn(rows, cols, generator=g) * 2)
            cpu = dequant_fp8_block(w, s)
            gpu = dequant_fp8_block(w.cuda(), s.cuda()).cpu()
            ref = ref_kernel.weight_dequant(w.cuda(), s.cuda()).cpu()
            assert torch.equal(cpu.view(torch.int16), gpu.view(torch.int16)), (rows, cols)
            assert torch.equal(ref.view(torch.int16), gpu.view(torch.int16)), (rows, cols)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("spec", [dict(dequant=True, mp=2), dict(dequant=False, mp=2), dict(dequant=True)])
def test_tiny_chunks_stream_to_identical_bytes(tiny_v3, tmp_path, spec):
    """Row-chunked streaming (1 KB chunks: single rows, 128-row FP8 blocks) changes no byte."""
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    convert(tiny_v3, tmp_path / "big", Spec(**spec), ExecOptions(quiet=True))
    convert(tiny_v3, tmp_path / "small", Spec(**spec), ExecOptions(quiet=True, chunk_bytes=1024, workers=3))
    for f in (tmp_path / "big").iterdir():
        assert f.read_bytes() == (tmp_path / "small" / f.name).read_bytes(), f.name


def test_mp_that_would_cut_heads_in_half_is_refused(tiny_v3, tmp_path):
    # 4 heads x 192 rows: 768 divides by 8, but each rank would hold half a head
    proc = run_cli("convert", tiny_v3, tmp_path / "o", "--mp", 8, check=False)
    assert proc.returncode == 1
    assert "num_attention_heads (4) is not divisible by mp=8" in proc.stderr and "fix:" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.gpu
def test_cuda_convert_equals_cpu_convert_bytes(tiny_v3, tmp_path):
    run_cli("convert", tiny_v3, tmp_path / "cpu", "--mp", 2, "--device", "cpu", "--quiet")
    run_cli("convert", tiny_v3, tmp_path / "gpu", "--mp", 2, "--device", "cuda", "--quiet")
    for f in (tmp_path / "cpu").iterdir():
        assert f.read_bytes() == (tmp_path / "gpu" / f.name).read_bytes(), f.name


@pytest.mark.gpu
def test_cuda_streams_and_pinned_buffers_change_no_byte(tiny_v3, tmp_path, monkeypatch):
    """Every chunk on the GPU (1 KB chunks: hundreds of them through 3 workers' streams and reused
    pinned buffers), then the default where early chunks run on the CPU while CUDA starts."""
    from ckpttool.execute import device as execute
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    spec = Spec(dequant=True, mp=2)
    convert(tiny_v3, tmp_path / "cpu", spec, ExecOptions(quiet=True, device="cpu"))
    gpu = convert(tiny_v3, tmp_path / "gpu", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=1024,
                                                              workers=3, wait_for_cuda=True))
    counts = _chunk_counts(gpu)
    assert counts.get("chunks_on_gpu", 0) > 100 and "chunks_on_cpu_while_cuda_started" not in counts, counts
    mixed = convert(tiny_v3, tmp_path / "mixed", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=1024))
    assert sum(_chunk_counts(mixed).values()) == counts["chunks_on_gpu"]
    monkeypatch.setattr(execute, "auto_uses_gpu", lambda cores, out_bytes: True)  # a big job on few cores
    auto = convert(tiny_v3, tmp_path / "auto", spec, ExecOptions(quiet=True, device="auto", chunk_bytes=1024,
                                                                wait_for_cuda=True))
    assert _chunk_counts(auto) == counts  # auto finds the GPU (torch imported on a thread)
    for f in (tmp_path / "cpu").iterdir():
        for other in ("gpu", "mixed", "auto"):
            assert f.read_bytes() == (tmp_path / other / f.name).read_bytes(), (other, f.name)


@pytest.mark.gpu
def test_fused_convert_equals_unmodified_reference_scripts_on_gpu(tiny_v3_no_mtp, tmp_path):
    """The real two-pass reference: fp8_cast_bf16.py (Triton kernel.py, CUDA) then convert.py."""
    import subprocess
    import sys

    from conftest import require_seeds

    subprocess.run([sys.executable, "fp8_cast_bf16.py", "--input-fp8-hf-path", str(tiny_v3_no_mtp),
                    "--output-bf16-hf-path", str(tmp_path / "ref-bf16")], cwd=require_seeds(), check=True, capture_output=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ref-bf16" / name).write_bytes((tiny_v3_no_mtp / name).read_bytes())
    ref = reference_convert(tmp_path / "ref-bf16", tmp_path / "ref", 2)
    run_cli("convert", tiny_v3_no_mtp, tmp_path / "ours", "--mp", 2, "--device", "cuda", "--quiet")
    assert_same_tensors(load_dir(tmp_path / "ours"), load_dir(ref))


def test_json_report_says_where_the_time_went(tiny_v3, tmp_path):
    proc = run_cli("convert", tiny_v3, tmp_path / "o", "--mp", 2, "--dtype", "bf16", "--json", "--device", "cpu")
    timing = json.loads(proc.stdout)["timing"]
    phases, threads = timing["phases_s"], timing["thread_s"]
    assert 0 < phases["execute"] <= phases["total"] and phases["plan"] <= phases["total"]
    assert all(threads[k] > 0 for k in ("read", "transform", "write", "hash")), threads
    assert threads["fdatasync"] >= 0, threads  # timed, but a flush on tmpfs (TMPDIR there) rounds to 0.000 s
    counts = timing.get("counts", {})
    assert not any(k.startswith("chunks_on_") for k in counts), counts  # where chunks ran: the CUDA path's counts
    assert sum(v for k, v in counts.items() if k.startswith("chunks_by_cpu_loops_")) > 0, counts  # which loops ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA cannot start")
def test_cuda_that_cannot_start_is_an_error_when_asked_for_and_the_cpu_under_auto():
    import numpy as np

    from ckpttool.execute.cuda import CudaTransforms
    from ckpttool.errors import InputError
    from ckpttool.formats import FP8_BLOCK, Chunk

    fp8 = FP8_BLOCK
    gpu = CudaTransforms("cuda", [fp8])
    gpu.wait()
    with pytest.raises(InputError, match="no CUDA device") as err:
        gpu.staging(1024)
    assert "--device cpu" in str(err.value)

    auto = CudaTransforms("auto", [fp8])
    auto.wait()
    assert auto.staging(1024) is None  # stays on the CPU, and says so in the counts
    x, scale = np.full((128, 128), 0x38, dtype=np.uint8), np.full((1, 1), 2.0, dtype=np.float32)  # 1.0 * 2
    y = auto.apply(fp8, Chunk(x, "F8_E4M3", {"scale": scale}, {"scale": "F32"}), "BF16")
    assert (y == 0x4000).all() and auto.timings.counts == {"chunks_on_cpu": 1}  # bf16 2.0


def test_auto_uses_the_gpu_only_for_a_big_job_on_few_cores(monkeypatch):
    """The measured cases (bench/HISTORY.md): with the C loops the CPU won on 4 cores at 2.56 and 18.46 GB
    of output, on 2 cores at 2.56 GB, and was level with CUDA at 18.46 GB, so the GPU is left for larger
    jobs on few cores (the model's crossings, about 29 GB on 2 cores and 520 GB on 4); never from 8 cores,
    never without a GPU driver."""
    from ckpttool.execute import device as execute

    GB = 10**9
    for cores, gpu, out, want in ((2, True, 18.46 * GB, "cpu"), (2, True, 2.56 * GB, "cpu"), (2, True, 40 * GB, "auto"),
                                  (4, True, 18.46 * GB, "cpu"), (4, True, 200 * GB, "cpu"),
                                  (4, True, 600 * GB, "auto"),
                                  (8, True, 18.46 * GB, "cpu"), (16, True, 10**15, "cpu"),
                                  (2, False, 10**15, "cpu"), (1, True, 0, "cpu")):
        monkeypatch.setattr(execute.defaults, "cores", lambda: cores)
        monkeypatch.setattr(execute, "gpu_present", lambda: gpu)
        assert execute.resolve_device("auto", int(out)) == want, (cores, gpu, out)
    monkeypatch.setattr(execute, "gpu_present", lambda: False)
    with pytest.raises(execute.InputError, match="no CUDA device"):
        execute.resolve_device("cuda")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_workers_count_the_cores_a_job_is_given_not_the_machines():
    """A job pinned to one core (taskset, a cpuset, a batch scheduler) starts one worker. (`auto`
    judges by the same count: test_auto_uses_the_gpu_only_for_a_big_job_on_few_cores.)"""
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from ckpttool import defaults; print(defaults.cores(), defaults.workers(), os.cpu_count())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.split()[:2] == ["1", "1"], proc.stdout


def test_cpu_conversion_never_imports_torch(tiny_v3_no_mtp, tmp_path):
    """torch's import is seconds of every run's start-up: the CPU data path is numpy only."""
    import subprocess
    import sys

    code = ("import sys; from ckpttool.cli import main; "
            f"rc = main(['convert', {str(tiny_v3_no_mtp)!r}, {str(tmp_path / 'o')!r}, '--mp', '2', '--device', 'cpu', "
            "'-q']); assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = reference_convert(reference_dequant(tiny_v3_no_mtp, tmp_path / "ref-bf16"), tmp_path / "ref", 2)
    assert_same_tensors(load_dir(tmp_path / "o"), load_dir(ref))


def test_with_the_c_kernels_a_conversion_never_imports_numba(tiny_v3_no_mtp, tmp_path):
    """numba's import and the load of its cached kernels were 0.4-0.8 s of every run's start-up; where the
    install built the C loops, a conversion of FP8 blocks never loads it, and writes the bytes the numba
    path (CKPTTOOL_NATIVE=0) writes."""
    import subprocess
    import sys

    from ckpttool.kernels import native

    if native.library() is None:
        pytest.skip("the C kernels were not built: setup.py found no C compiler at install")
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTTOOL_NATIVE", "CKPTTOOL_NUMBA")}
    for out, native_env, loaded in (("c", "1", False), ("numba", "0", True)):
        code = ("import sys; from ckpttool.cli import main; "
                f"rc = main(['convert', {str(tiny_v3_no_mtp)!r}, {str(tmp_path / out)!r}, '--mp', '2', '--device', "
                f"'cpu', '-q']); assert rc == 0, rc; assert ('numba' in sys.modules) == {loaded}, sorted(sys.modules)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, "CKPTTOOL_NATIVE": native_env})
        assert proc.returncode == 0, (out, proc.stderr[-2000:])
    assert_same_tensors(load_dir(tmp_path / "c"), load_dir(tmp_path / "numba"))


def test_a_run_on_numpys_loops_says_so_and_how_to_get_compiled_ones(tiny_v3_no_mtp, tmp_path):
    """pip hides why the C loops were not built; a conversion that then ran numpy's says it, and
    `--json` counts the chunks by the loops that dequantized them."""
    from conftest import run_cli_process

    env = {k: v for k, v in os.environ.items() if k not in ("CKPTTOOL_NATIVE", "CKPTTOOL_NUMBA")}
    slow = run_cli_process("convert", tiny_v3_no_mtp, tmp_path / "a", "--mp", "2", "--device", "cpu",
                           env={**env, "CKPTTOOL_NATIVE": "0", "CKPTTOOL_NUMBA": "0"})
    assert slow.returncode == 0 and "numpy's loops" in slow.stdout and "install gcc" in slow.stdout, slow.stdout
    slow_json = run_cli_process("convert", tiny_v3_no_mtp, tmp_path / "j", "--mp", "2", "--device", "cpu", "--json",
                                env={**env, "CKPTTOOL_NATIVE": "0", "CKPTTOOL_NUMBA": "0"})
    warnings = json.loads(slow_json.stdout)["warnings"]  # --json says it too
    assert any("numpy's loops" in w and "install gcc" in w for w in warnings), slow_json.stdout
    fast = run_cli_process("convert", tiny_v3_no_mtp, tmp_path / "b", "--mp", "2", "--device", "cpu", "--json", env=env)
    assert fast.returncode == 0 and "numpy's loops" not in fast.stdout and json.loads(fast.stdout)["warnings"] == []
    counts = json.loads(fast.stdout)["timing"]["counts"]
    assert not counts.get("chunks_by_cpu_loops_numpy") and sum(v for k, v in counts.items() if k.startswith("chunks_by_cpu")) > 0


def test_usage_errors_are_messages_not_tracebacks():
    from conftest import run_cli_process

    for args in (["--no-such-option"], ["convert", "--mp"], ["no-such-command"]):
        proc = run_cli_process(*args)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr and ("No such" in proc.stderr or "requires an argument" in proc.stderr), \
            (args, proc.stderr[-500:])


def _chunk_counts(report) -> dict[str, int]:
    """Where a run's chunks were dequantized (its other counts, such as the bytes hashed from memory,
    depend on thread timing)."""
    return {k: v for k, v in report.timings.to_json()["counts"].items() if k.startswith("chunks_")}
