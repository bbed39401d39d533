"""Build the demo model offline: a tiny Qwen3.5 text model, quantized to AWQ 4-bit.

No model hub is reached. The tokenizer is a byte-level BPE trained here on generated text,
the weights are random (seeded), and gptqmodel quantizes them with AWQ on the CPU. The
result is a real AWQ checkpoint that loads through the same path as Qwen3.5-9B AWQ, so the
fleet and its tests run end to end on a machine without a GPU or network.

Run ``python -m workers.demo_model`` (``make demo-model``); it builds once and caches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from shared.settings import get_settings

log = logging.getLogger(__name__)

BUILD_VERSION = "v3"  # bump when the recipe changes, so caches are rebuilt
GROUP_SIZE = 32
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = [
    "the",
    "a",
    "queue",
    "worker",
    "model",
    "token",
    "batch",
    "stream",
    "redis",
    "job",
    "prompt",
    "answer",
    "fleet",
    "gpu",
    "fast",
    "slow",
    "river",
    "mountain",
    "city",
    "light",
    "night",
    "day",
    "cat",
    "dog",
    "bird",
    "tree",
    "stone",
    "water",
    "fire",
    "wind",
    "sun",
    "moon",
    "runs",
    "waits",
    "reads",
    "writes",
    "learns",
    "sings",
    "builds",
    "finds",
    "keeps",
    "sends",
    "holds",
    "opens",
    "closes",
    "quickly",
    "quietly",
    "again",
    "never",
    "always",
    "often",
    "together",
    "alone",
    "because",
    "while",
    "when",
    "after",
]


def demo_model_dir() -> Path:
    return get_settings().cache_dir / f"demo-qwen3.5-tiny-awq-{BUILD_VERSION}"


def corpus(n: int, seed: int) -> list[str]:
    """Deterministic English-like sentences: enough to train a tokenizer and calibrate AWQ."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 24))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!"]))
    return lines


def _train_tokenizer(out: Path):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(4000, seed=1), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    return fast


def _random_model(tokenizer, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        # vLLM's CPU gated-delta-net kernel takes linear-attention head dims of 64 or 128
        # only, so both engines can load this one checkpoint.
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        bos_token_id=None,
    )
    model = Qwen3_5ForCausalLM(config)
    # Random weights would end some rows within a few tokens (EOS winning the argmax), and
    # which rows depends on the build. A zero output row for EOS scores 0 against 500 other
    # random logits, so generation runs to max_new_tokens (or a stop string) in practice,
    # and tests that need a long generation get one whatever the build.
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] = 0
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _quantize(fp_dir: Path, out: Path) -> None:
    from gptqmodel import AWQConfig, GPTQModel

    config = AWQConfig(bits=4, group_size=GROUP_SIZE)
    model = GPTQModel.load(str(fp_dir), config, device="cpu")
    model.quantize(corpus(32, seed=2), batch_size=1)
    model.save(str(out))
    # gptqmodel keeps these unquantized without listing them; transformers would otherwise
    # build AWQ layers for them and load random weights (see shared/notes/awq-models.md).
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["in_proj_a", "in_proj_b", "lm_head"]
    config_path.write_text(json.dumps(cfg, indent=2))


def build(target: Path | None = None) -> Path:
    """Build the demo AWQ checkpoint unless it is already cached; return its directory."""
    target = (target or demo_model_dir()).resolve()
    if (target / "config.json").exists():
        return target
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, os.cpu_count() or 2)))
    target.parent.mkdir(parents=True, exist_ok=True)
    # chdir: gptqmodel writes its quantization log under ./logs
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, contextlib.chdir(tmp):
        fp_dir, q_dir = Path(tmp) / "fp", Path(tmp) / "awq"
        tokenizer = _train_tokenizer(fp_dir)
        _random_model(tokenizer, fp_dir)
        _quantize(fp_dir, q_dir)
        tokenizer.save_pretrained(q_dir)
        shutil.copy(fp_dir / "generation_config.json", q_dir / "generation_config.json")
        q_dir.rename(target)  # atomic: a half-built model is never seen as cached
    log.info("built demo model in %s", target)
    return target


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None))


if __name__ == "__main__":
    main()
