"""A random-weight AWQ 4-bit Qwen3.5 checkpoint, written directly: no hub, no calibration.

Why: a GPU benchmark wants Qwen3.5-9B's real shapes (so the kernels, the memory and the
KV cache are the real ones) without downloading 9B weights or spending minutes quantizing
them. Speed does not depend on the weights' values, so they are random:

* every quantized linear gets AWQ GEMM tensors: ``qweight`` (in, out/8) int32 of random
  int4, ``qzeros`` (in/group, out/8) int32 all 8, ``scales`` (in/group, out) float16 sized
  so the dequantized weights have std ~0.02 (as transformers' init);
* the rest (embeddings, lm_head, norms, the gated-delta-net's ``A_log``, ``dt_bias``,
  ``conv1d``, ``in_proj_a/b``) is bfloat16, initialised as transformers does;
* ``quantization_config`` is AutoAWQ's (``version: gemm``, ``zero_point: true``) with
  ``modules_to_not_convert: [in_proj_a, in_proj_b, lm_head]``, which vLLM needs for Qwen3.5
  (shared/notes/vllm-engine.md) and transformers honours;
* the tokenizer is the demo model's (a 512-token BPE). ``vocab_size`` stays the real 248,320:
  lm_head rows of token ids the tokenizer does not have, and of EOS, are zero, so greedy
  decoding never picks them and every job runs to its ``max_new_tokens`` (as the demo model
  does). Embedding rows past the tokenizer are zero too: they are never looked up.

The tensor names are transformers' own (the model is built on the meta device and walked),
i.e. what gptqmodel writes for the demo model and both engines load.

    python -m bench.random_awq OUT_DIR [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from workers import demo_model

GROUP_SIZE = 128
PACK = 8  # int4 values per int32
ZERO_POINT = 8  # every qzeros nibble: (q - 8) * scale is centred on 0
WEIGHT_STD = 0.02  # transformers' initializer_range
NOT_CONVERTED = ["in_proj_a", "in_proj_b", "lm_head"]

# Qwen3.5-9B's text model. Source: transformers 5.23's Qwen3_5TextConfig defaults, whose
# docstring calls them "the Qwen3.5-9B style configuration", checked against the published
# config.json of a Qwen/Qwen3.5-9B fine-tune (text_config: hidden 4096, intermediate 12288,
# 32 layers of 3 x linear_attention + 1 x full_attention, head_dim 256, linear key/value
# head dim 128 with 16 key and 32 value heads, vocab 248320, untied lm_head) and a model
# card (16 attention heads, 4 KV heads). rope_theta and the partial rotary factor are the
# Qwen3.5 family's.
QWEN35_9B: dict[str, object] = {
    "vocab_size": 248_320,
    "hidden_size": 4096,
    "intermediate_size": 12_288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 262_144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    "tie_word_embeddings": False,
}
# The same structure, small: vLLM's CPU kernels want linear-attention head dims of 64 or 128
# and in/out dims in multiples of 32; AWQ groups of 128 want in dims in multiples of 128.
# vocab_size is larger than the tokenizer, as in the 9B.
TINY: dict[str, object] = QWEN35_9B | {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "max_position_embeddings": 4096,
}

Fill = Callable[[np.random.Generator], np.ndarray | torch.Tensor]
_SAFETENSORS_DTYPE = {torch.int32: "I32", torch.float16: "F16", torch.bfloat16: "BF16"}


class _Tensor:
    """One tensor to write: its name, dtype, shape and how to make its values."""

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], fill: Fill):
        self.name, self.dtype, self.shape, self.fill = name, dtype, shape, fill

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _random_int4(shape: tuple[int, ...]) -> Fill:
    return lambda rng: np.frombuffer(rng.bytes(4 * math.prod(shape)), np.int32).reshape(shape)


def _constant_int4(shape: tuple[int, ...], nibble: int) -> Fill:
    word = np.uint32(int(f"{nibble:x}" * PACK, 16)).view(np.int32)
    return lambda rng: np.full(shape, word, np.int32)


def _scales(shape: tuple[int, ...]) -> Fill:
    # uniform int4 around the zero point has std ~4.6; +-50% jitter per group and column
    base = WEIGHT_STD / math.sqrt((16**2 - 1) / 12)
    return lambda rng: (base * rng.uniform(0.5, 1.5, shape)).astype(np.float16)


def _bf16(make: Callable[[np.random.Generator], np.ndarray]) -> Fill:
    return lambda rng: torch.from_numpy(np.asarray(make(rng), np.float32)).to(torch.bfloat16)


def _rows(shape: tuple[int, ...], live: int, dead: list[int]) -> Fill:
    """Normal rows below ``live``, zero rows from there and at ``dead`` (embeddings, lm_head)."""

    def make(rng: np.random.Generator) -> torch.Tensor:
        out = torch.zeros(shape, dtype=torch.bfloat16)
        out[:live] = torch.from_numpy(rng.normal(0, WEIGHT_STD, (live, shape[1])))
        out[dead] = 0
        return out

    return make


def _plan(config, live_tokens: int, eos: list[int]) -> Iterator[_Tensor]:
    """Every tensor of the checkpoint, walked from transformers' own module tree."""
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    for prefix, module in model.named_modules():
        kind = type(module).__name__
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        leaf = prefix.rsplit(".", 1)[-1]
        if kind == "Linear" and leaf not in NOT_CONVERTED:
            out_dim, in_dim = module.weight.shape
            packed = (in_dim, out_dim // PACK)
            grouped = (in_dim // GROUP_SIZE, out_dim // PACK)
            scales = (in_dim // GROUP_SIZE, out_dim)
            yield _Tensor(f"{prefix}.qweight", torch.int32, packed, _random_int4(packed))
            zeros = _constant_int4(grouped, ZERO_POINT)
            yield _Tensor(f"{prefix}.qzeros", torch.int32, grouped, zeros)
            yield _Tensor(f"{prefix}.scales", torch.float16, scales, _scales(scales))
            continue
        for pname, param in params.items():
            shape, name = tuple(param.shape), f"{prefix}.{pname}"
            if kind in ("Embedding", "Linear") and leaf in ("embed_tokens", "lm_head"):
                fill = _rows(shape, live_tokens, eos if leaf == "lm_head" else [])
            elif kind == "Qwen3_5RMSNorm":  # computes x * (1 + weight)
                fill = _bf16(lambda rng, s=shape: np.zeros(s))
            elif kind == "Qwen3_5RMSNormGated" or pname == "dt_bias":
                fill = _bf16(lambda rng, s=shape: np.ones(s))
            elif pname == "A_log":
                fill = _bf16(lambda rng, s=shape: np.log(rng.uniform(0.01, 16, s)))
            elif kind == "Conv1d":  # torch's default: kaiming uniform over a fan-in of k
                bound = 1 / math.sqrt(shape[-1])
                fill = _bf16(lambda rng, s=shape, b=bound: rng.uniform(-b, b, s))
            else:
                fill = _bf16(lambda rng, s=shape: rng.normal(0, WEIGHT_STD, s))
            yield _Tensor(name, torch.bfloat16, shape, fill)


def _write_safetensors(path: Path, tensors: list[_Tensor], seed: int) -> int:
    """Stream the tensors into one safetensors file, one at a time (9B never sits in RAM)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _SAFETENSORS_DTYPE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors:
            value = t.fill(rng)
            data = value.view(torch.uint8).numpy() if isinstance(value, torch.Tensor) else value
            assert data.nbytes == t.nbytes, t.name
            out.write(memoryview(np.ascontiguousarray(data)).cast("B"))
    return offset


def build(out: Path, shape: dict[str, object], seed: int = 0) -> dict[str, object]:
    """Write the checkpoint into ``out`` (created); return what was written and how fast."""
    from transformers import GenerationConfig, Qwen3_5TextConfig

    began = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_model._train_tokenizer(out)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3_5TextConfig(
        **shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, bos_token_id=None
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.dtype = "bfloat16"
    tensors = list(_plan(config, len(tokenizer), eos))
    size = _write_safetensors(out / "model.safetensors", tensors, seed)
    config.save_pretrained(out)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP_SIZE,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": NOT_CONVERTED,
    }
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return {
        "path": str(out),
        "bytes": size,
        "tensors": len(tensors),
        "quantized_linears": sum(t.name.endswith(".qweight") for t in tensors),
        "seconds": round(time.monotonic() - began, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="tiny shape, same structure")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out, TINY if args.tiny else QWEN35_9B, args.seed)))


if __name__ == "__main__":
    main()
