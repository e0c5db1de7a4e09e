"""Tiny random-weight models of each family kvpool serves, that vLLM can run fully offline.

kvpool's vLLM integration tests need real models, but no model hub is reachable and
a real checkpoint is far too slow on a CPU. :func:`build_tiny_model` writes one of
:data:`FAMILIES` (a few MB each, seeded weights, bf16), plus a ~2k-token byte-level BPE
tokenizer trained on CPython's own stdlib sources and a minimal chat template:

``llama``
    dense attention: 4 layers, hidden 256, GQA with 2 KV heads, head_dim 64.
``deepseek-v3``
    DeepSeek-V3's shape (Kimi-K2.5's family): multi-head latent attention at DeepSeek's
    real head sizes (``kv_lora_rank`` 512, rope 64: one 576-wide latent per token, the only
    size vLLM's CPU MLA kernel runs), dense MLPs.
``deepseek-v3-moe``
    the same with mixture-of-experts layers after the first (8 routed experts, 2 per
    token, one shared expert, DeepSeek's grouped top-k router).
``gemma3``
    Gemma-3's shape: sliding-window layers (window 128) interleaved with full attention.
``qwen3-next``
    Qwen3-Next's shape: gated-delta-net linear attention, one full-attention layer in
    four, mixture-of-experts MLPs.
``gemma3-sliding``
    Gemma-3's shape with a sliding window in every layer: one KV cache group, of sliding
    window attention.
``qwen3-next-linear``
    Qwen3-Next's shape with linear attention in every layer: one group of recurrent state
    only, as a pure state-space model has.

The outputs are meaningless but, with greedy sampling, deterministic -- so a KV connector
that restores the right KV reproduces them exactly, while wrong KV visibly changes them.

The build is reproducible for a given Python / torch / transformers / tokenizers
installation, takes a few seconds, and is atomic: it happens in a temporary directory
next to the target that is renamed into place, and a marker file records completion.
Note: vLLM's CPU attention backend only accepts a ``block_size`` that is a multiple of 32.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
import sysconfig
import tempfile
import time
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["FAMILIES", "Family", "build_tiny_model", "model_dir_for"]

logger = logging.getLogger(__name__)

#: Bump whenever the recipe changes, so stale cached builds are rebuilt.
BUILD_VERSION = "3"
MARKER_NAME = ".kvpool-tiny-model-complete"

SEED = 0
VOCAB_SIZE = 2048
TRAIN_TEXT_BYTES = 2 * 1024 * 1024
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def model_dir_for(family: str = "llama") -> str:
    """Where :func:`build_tiny_model` builds ``family`` by default
    (``$KVPOOL_CACHE_DIR/tiny-<family>``, else ``~/.cache/kvpool/tiny-<family>``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: one of {', '.join(FAMILIES)}")
    cache = os.environ.get("KVPOOL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvpool"
    )
    return os.path.join(cache, f"tiny-{family}")


def _is_complete(path: pathlib.Path) -> bool:
    marker = path / MARKER_NAME
    try:
        return marker.read_text(encoding="utf-8").strip() == BUILD_VERSION
    except OSError:
        return False


def _training_text() -> list[str]:
    """Deterministic training corpus: top-level stdlib modules, sorted, capped."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks: list[str] = []
    total = 0
    for src in sorted(stdlib.glob("*.py")):
        text = src.read_bytes()[: TRAIN_TEXT_BYTES - total].decode("utf-8", "replace")
        chunks.append(text)
        total += len(text.encode("utf-8"))
        if total >= TRAIN_TEXT_BYTES:
            break
    if total < 64 * 1024:
        raise RuntimeError(f"too little Python source under {stdlib} to train a tokenizer")
    return chunks


def _build_tokenizer(out: pathlib.Path) -> PreTrainedTokenizerFast:
    # Heavy optional dependencies (the ``vllm`` extra) are imported lazily.
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
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    # Plain prompts start with BOS, like Llama's own tokenizer.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


_COMMON: dict[str, Any] = {
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    # Larger than the usual 0.02 so that greedy continuations are varied and react to any
    # change in the context (e.g. wrong KV) instead of collapsing into repeats.
    "initializer_range": 0.1,
}

# Llama's attention (the docstring's 4 layers, hidden 256, GQA with 2 KV heads of 64), which
# Gemma-3's and Qwen3-Next's full-attention layers keep.
_GQA: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

_LLAMA: dict[str, Any] = {"intermediate_size": 688, **_GQA}

_DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,  # DeepSeek's own latent size: vLLM's CPU MLA runs only 512 + 64
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    # Dense MLPs in every layer (deepseek-v3-moe: experts after the first, DeepSeek's own
    # pattern).
    "first_k_dense_replace": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "n_group": 2,
    "topk_group": 1,
    # DeepSeek-V3's own router, as its config.json names it.  transformers' config has no
    # such fields (its router is always this one), but vLLM reads them: without them it
    # builds a softmax router with no score-correction bias, and the checkpoint's
    # ``mlp.gate.e_score_correction_bias`` fails to load (KeyError: the worker dies at start).
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}

_GEMMA3: dict[str, Any] = {
    "intermediate_size": 688,
    "query_pre_attn_scalar": 64,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    **_GQA,
}

_QWEN3_NEXT: dict[str, Any] = {
    "intermediate_size": 512,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    **_GQA,
}


class Family(NamedTuple):
    """A model family: the transformers model type that builds it (its ``AutoConfig`` and
    ``AutoModelForCausalLM``), and its config's fields beyond :data:`_COMMON` and the
    tokenizer's ids."""

    model_type: str
    fields: dict[str, Any]


#: The model families :func:`build_tiny_model` builds, by name.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", _LLAMA),
    "deepseek-v3": Family("deepseek_v3", _DEEPSEEK_V3),
    "deepseek-v3-moe": Family("deepseek_v3", {**_DEEPSEEK_V3, "first_k_dense_replace": 1}),
    "gemma3": Family("gemma3_text", _GEMMA3),
    "qwen3-next": Family("qwen3_next", _QWEN3_NEXT),
    "gemma3-sliding": Family("gemma3_text", {**_GEMMA3, "layer_types": ["sliding_attention"] * 4}),
    "qwen3-next-linear": Family(
        "qwen3_next", {**_QWEN3_NEXT, "layer_types": ["linear_attention"] * 4}
    ),
}


def _build_model(out: pathlib.Path, family: str, ids: dict[str, Any]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **fields, **_COMMON, **ids)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config)
    model = model.bfloat16()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)


def build_tiny_model(
    model_dir: str | os.PathLike[str] | None = None, *, family: str = "llama", force: bool = False
) -> pathlib.Path:
    """Build the tiny model of ``family`` into ``model_dir`` unless a complete build is
    already there.

    ``model_dir`` defaults to :func:`model_dir_for` the family. With ``force`` the model is
    rebuilt even if present.
    Safe to call concurrently: each caller builds privately and renames into place.
    Returns the model directory, ready for ``vllm.LLM(model=str(path))``.
    """
    target = pathlib.Path(model_dir if model_dir is not None else model_dir_for(family))
    target = target.expanduser().absolute()
    if not force and _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        tok = _build_tokenizer(tmp)
        ids = {
            "vocab_size": len(tok),
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
        _build_model(tmp, family, ids)
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only modes
            f.chmod(0o644)
        tmp.chmod(0o755)
        (tmp / MARKER_NAME).write_text(BUILD_VERSION + "\n", encoding="utf-8")
        _install(tmp, target, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny %s model ready at %s (%.1fs)", family, target, time.perf_counter() - start)
    return target


def _install(tmp: pathlib.Path, target: pathlib.Path, *, force: bool) -> None:
    """Atomically move the finished build ``tmp`` to ``target``."""
    if target.exists() and (force or not _is_complete(target)):
        # Move the old (or incomplete) directory aside first; rename is atomic.
        trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        with contextlib.suppress(FileNotFoundError):  # a concurrent builder moved it
            target.rename(trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        # A concurrent builder installed its (identical) build first.
        if not _is_complete(target):
            raise
        logger.debug("tiny model at %s was installed concurrently", target)
