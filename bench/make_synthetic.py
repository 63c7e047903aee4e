"""Write a DeepSeek-V3- or V4-shaped synthetic checkpoint (HF layout, as published) for benchmarks, streaming.

V3 (the default): every tensor has its real V3 shape (hidden 7168, intermediate 18432, moe_intermediate 2048,
MLA with q_lora 1536 / kv_lora 512, vocab 129280, 128x128 F32 `weight_scale_inv`); only the number of layers
and routed experts is cut down, so the size is set by --layers / --experts (one routed expert is
3 x 2048 x 7168 FP8 bytes = 44 MB; embed + head are 3.7 GB of BF16 at the real vocab).
V4 (--model v4): DeepSeek-V4-Flash's published dims and form (hidden 4096, every linear projection FP8 with an
F8_E8M0 `.scale` per 128x128 block, routed experts MXFP4: I8 [M, K/2] with an F8_E8M0 `.scale` per 32 values;
sinks, hyper-connections and biases F32), layers and experts cut down alike (--dense-layers: leading
sliding-window layers; then CSA and HCA alternate as in V4-Flash).

Nothing is held but one chunk: each safetensors file's header is computed from the shapes first,
then tensor bytes are written in order from pools of random bytes (FP8 with the NaN encodings
0x7F/0xFF removed, BF16 from a normal distribution), taken at random offsets so no two tensors share
content. Example:

    python bench/make_synthetic.py --out /tmp/v3-syn --layers 2 --dense-layers 1 --experts 144 --shards 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ckpttool.families.deepseek.spec import DeepseekConfig, hf_tensor_shapes, is_fp8_in_published_checkpoint
from ckpttool.families.demo_files import write_tokenizer
from ckpttool.formats import FP8_QUANTIZATION_CONFIG

BLOCK = 128
CHUNK = 32 << 20  # bytes written per write() call; also what one pool slice is
POOL = 128 << 20  # random bytes generated once per dtype family and reused at random offsets
ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "F8_E8M0": 1, "I8": 1, "I32": 4}
V4_F32_LEAVES = ("attn_sink", "ape", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
                 "hc_ffn_base", "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale")


def v3_config(layers: int, dense_layers: int, experts: int, vocab: int, n_shared: int) -> dict:
    """DeepSeek-V3's published config.json with the layer and expert counts replaced."""
    n_group = next((g for g in (8, 4, 2, 1) if experts % g == 0 and experts // g >= 2), 1)
    topk_group = max(1, n_group // 2)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
        "first_k_dense_replace": dense_layers, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "n_group": n_group, "n_routed_experts": experts, "n_shared_experts": n_shared, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": min(8, topk_group * max(1, experts // n_group)),
        "num_hidden_layers": layers, "num_key_value_heads": 128, "num_nextn_predict_layers": 0,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": dict(FP8_QUANTIZATION_CONFIG), "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": topk_group, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "transformers_version": "4.46.3", "use_cache": True, "v_head_dim": 128,
        "vocab_size": vocab,
    }


def v4_config(layers: int, dense_layers: int, experts: int, vocab: int) -> dict:
    """DeepSeek-V4-Flash's published config.json (hub fields) with the layer and expert counts replaced."""
    ratios = [0] * dense_layers + [(4, 128)[i % 2] for i in range(layers - dense_layers)]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64,
        "index_topk": 512, "max_position_embeddings": 1048576, "moe_intermediate_size": 2048,
        "n_routed_experts": experts, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts_per_tok": min(6, experts), "num_hidden_layers": layers, "num_hash_layers": min(3, layers),
        "num_key_value_heads": 1, "num_nextn_predict_layers": 0, "o_groups": 8, "o_lora_rank": 1024,
        "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
        "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "vocab_size": vocab, "compress_rope_theta": 160000, "compress_ratios": ratios,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [BLOCK, BLOCK], "expert_dtype": "fp4"},
    }


@dataclass(slots=True)
class Entry:
    name: str
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]
    kind: str  # fp8 | scale | bf16 | norm | bias | fp4 | e8m0 | f32 | tid2eid

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def tensor_entries(cfg: DeepseekConfig) -> list[Entry]:
    """Every tensor of the checkpoint in file order, each FP8 weight followed by its scale."""
    out: list[Entry] = []
    for name, shape in hf_tensor_shapes(cfg, with_mtp=False).items():
        if is_fp8_in_published_checkpoint(name):
            out.append(Entry(name, "F8_E4M3", shape, "fp8"))
            out.append(Entry(name + "_scale_inv", "F32", (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)), "scale"))
        elif name.endswith("e_score_correction_bias"):
            out.append(Entry(name, "F32", shape, "bias"))
        elif name.endswith("norm.weight"):
            out.append(Entry(name, "BF16", shape, "norm"))
        else:  # embed, head, router gate
            out.append(Entry(name, "BF16", shape, "bf16"))
    return out


def v4_entries(cfg) -> list[Entry]:
    """Every tensor of a V4 checkpoint in file order, in the published dtypes, each quantized weight followed
    by its `.scale`."""
    from ckpttool.families.deepseek_v4.spec import KEY_MAPS, hf_tensor_shapes as v4_shapes

    out: list[Entry] = []
    for name, shape in v4_shapes(cfg, with_mtp=False).items():
        scale = name[: -len("weight")] + "scale"
        if KEY_MAPS["deepseek"].is_linear(name) and ".ffn.experts." in name:
            out += [Entry(name, "I8", (shape[0], shape[1] // 2), "fp4"),
                    Entry(scale, "F8_E8M0", (shape[0], shape[1] // 32), "e8m0")]
        elif KEY_MAPS["deepseek"].is_linear(name):
            out += [Entry(name, "F8_E4M3", shape, "fp8"),
                    Entry(scale, "F8_E8M0", (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK)), "e8m0")]
        elif name.endswith("tid2eid"):
            out.append(Entry(name, "I32", shape, "tid2eid"))
        elif name.endswith(V4_F32_LEAVES):
            out.append(Entry(name, "F32", shape, "f32"))
        elif name.endswith("norm.weight"):
            out.append(Entry(name, "BF16", shape, "norm"))
        else:
            out.append(Entry(name, "BF16", shape, "bf16"))
    return out


def assign_files(entries: list[Entry], n_files: int) -> list[list[Entry]]:
    """Split into about n_files by bytes, keeping each scale with its weight; empty files are dropped."""
    total = sum(e.nbytes for e in entries)
    groups: list[list[Entry]] = [[] for _ in range(n_files)]
    done = 0
    idx = 0
    for e in entries:
        if e.kind not in ("scale", "e8m0"):
            idx = min(n_files - 1, done * n_files // max(total, 1))
        groups[idx].append(e)
        done += e.nbytes
    return [g for g in groups if g]


class RandomSource:
    """Pools of random bytes, sliced at random offsets: generation runs at disk speed, not RNG speed."""

    def __init__(self, seed: int, experts: int = 1):
        self.rng = np.random.default_rng(seed)
        self.experts = experts
        fp8 = self.rng.integers(0, 256, size=POOL + CHUNK, dtype=np.uint8)
        nan = (fp8 & 0x7F) == 0x7F  # e4m3fn NaN is S.1111.111; 0x7E/0xFE are +-448
        fp8[nan] ^= 0x01
        self.fp8 = fp8
        gen = torch.Generator().manual_seed(seed)
        bf16 = (torch.randn((POOL + CHUNK) // 2, generator=gen) * 0.02).to(torch.bfloat16)
        self.bf16 = bf16.view(torch.uint8).numpy()

    def chunks(self, e: Entry):
        """The tensor's bytes as a sequence of buffers (no more than CHUNK bytes each)."""
        if e.kind in ("fp8", "bf16", "fp4"):  # any byte is two valid e2m1 codes
            pool = self.bf16 if e.kind == "bf16" else self.fp8
            left = e.nbytes
            while left:
                n = min(CHUNK, left)
                off = int(self.rng.integers(0, POOL // 2)) * 2  # even: BF16 elements stay aligned
                yield memoryview(pool[off:off + n])
                left -= n
            return
        numel = math.prod(e.shape)
        if e.kind == "scale":  # amax/448 of real weights spans a few decades around 1e-4..1e-2
            arr = np.exp(self.rng.uniform(math.log(1e-5), math.log(1e-2), size=numel)).astype(np.float32)
        elif e.kind == "bias":
            arr = self.rng.uniform(0.0, 0.1, size=numel).astype(np.float32)
        elif e.kind == "e8m0":  # 2**-20 .. 2**-6: what amax / 448 (or / 6) of real weights rounds up to
            arr = self.rng.integers(107, 122, size=numel, dtype=np.uint8)
        elif e.kind == "f32":
            arr = self.rng.normal(0.0, 0.1, size=numel).astype(np.float32)
        elif e.kind == "tid2eid":
            arr = self.rng.integers(0, self.experts, size=numel, dtype=np.int32)
        else:  # norm weights around 1
            t = torch.from_numpy(self.rng.normal(1.0, 0.1, size=numel).astype(np.float32)).to(torch.bfloat16)
            arr = t.view(torch.uint8).numpy()
        yield memoryview(arr.view(np.uint8))


def safetensors_header(entries: list[Entry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads with spaces to 8-byte alignment
    return len(raw).to_bytes(8, "little") + raw


def write_file(path: Path, entries: list[Entry], source: RandomSource, fsync: bool) -> int:
    written = 0
    with open(path, "wb", buffering=0) as f:
        head = safetensors_header(entries)
        f.write(head)
        for e in entries:
            for buf in source.chunks(e):
                while buf:  # raw writes may be short
                    n = f.write(buf)
                    buf = buf[n:]
                    written += n
        if fsync:
            os.fsync(f.fileno())
    return written + len(head)


def build(out: Path, *, layers: int, dense_layers: int, experts: int, shards: int, vocab: int, n_shared: int,
          seed: int, fsync: bool = True, dry_run: bool = False, quiet: bool = False, model: str = "v3") -> dict:
    if model == "v4":
        from ckpttool.families.deepseek_v4.config import DeepseekV4Config

        raw = v4_config(layers, dense_layers, experts, vocab)
        entries = v4_entries(DeepseekV4Config.from_dict(raw))
    else:
        raw = v3_config(layers, dense_layers, experts, vocab, n_shared)
        entries = tensor_entries(DeepseekConfig.from_dict(raw))
    groups = assign_files(entries, shards)
    fp8_bytes = sum(e.nbytes for e in entries if e.kind in ("fp8", "fp4"))
    total = sum(e.nbytes for e in entries)
    # what a BF16 conversion writes: FP8 weights double, MXFP4 ones quadruple, scales vanish, the rest is copied
    grow = {"fp8": 2, "fp4": 4, "scale": 0, "e8m0": 0}
    bf16_bytes = sum(grow.get(e.kind, 1) * e.nbytes for e in entries)
    summary = {
        "out": str(out), "model": model, "layers": layers, "dense_layers": dense_layers, "experts": experts,
        "vocab": vocab,
        "files": len(groups), "tensors": len(entries), "total_bytes": total, "fp8_bytes": fp8_bytes,
        "bf16_output_bytes": bf16_bytes, "seed": seed,
        "command": shlex.join([sys.executable, *sys.argv]),
    }
    if dry_run:
        return summary
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; remove it or choose another --out")
    started = time.monotonic()
    source = RandomSource(seed, experts)
    weight_map: dict[str, str] = {}
    written = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        written += write_file(out / fname, group, source, fsync)
        weight_map.update({e.name: fname for e in group})
        if not quiet:
            print(f"  {fname}: {len(group)} tensors, {sum(e.nbytes for e in group) / 1e9:.2f} GB", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2))
    write_tokenizer(out, vocab)
    seconds = time.monotonic() - started
    summary.update(seconds=round(seconds, 2), gb_per_s=round(written / seconds / 1e9, 3))
    # beside the checkpoint, not in it: converters copy every top-level file of SRC
    Path(str(out).rstrip("/") + ".synthetic.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="new (or empty) directory to write")
    p.add_argument("--model", choices=("v3", "v4"), default="v3", help="DeepSeek-V3's shapes and form, or V4-Flash's")
    p.add_argument("--layers", type=int, default=1, help="decoder layers (num_hidden_layers)")
    p.add_argument("--dense-layers", type=int, default=0, help="leading dense layers (first_k_dense_replace)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (n_routed_experts)")
    p.add_argument("--shards", type=int, default=4, help="safetensors files to spread the tensors over")
    p.add_argument("--vocab", type=int, default=129280, help="vocab size (129280 in V3; embed+head = 3.7 GB BF16)")
    p.add_argument("--n-shared", type=int, default=1, help="shared experts (n_shared_experts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of each file (faster, leaves dirty pages)")
    p.add_argument("--dry-run", action="store_true", help="print the sizes and exit")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if args.dense_layers > args.layers or args.layers < 1 or args.experts < 1 or args.shards < 1:
        p.error("need 1 <= --layers, 0 <= --dense-layers <= --layers, --experts >= 1, --shards >= 1")
    if args.experts % 8:
        print(f"warning: {args.experts} experts do not split over --mp 8", file=sys.stderr)
    summary = build(args.out, layers=args.layers, dense_layers=args.dense_layers, experts=args.experts,
                    shards=args.shards, vocab=args.vocab, n_shared=args.n_shared, seed=args.seed,
                    fsync=not args.no_fsync, dry_run=args.dry_run, quiet=args.json, model=args.model)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        verb = "would write" if args.dry_run else "wrote"
        rate = "" if args.dry_run else f" in {summary['seconds']:.1f}s ({summary['gb_per_s']:.2f} GB/s)"
        print(f"{verb} {summary['total_bytes'] / 1e9:.2f} GB ({summary['fp8_bytes'] / 1e9:.2f} GB FP8/MXFP4 weights) "
              f"in {summary['files']} files, {summary['tensors']} tensors, to {args.out}{rate}; "
              f"a BF16 conversion writes {summary['bf16_output_bytes'] / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
