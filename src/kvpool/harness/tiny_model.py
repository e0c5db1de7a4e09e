"""A tiny random-weight Llama model that vLLM can serve fully offline.

kvpool's vLLM integration tests need a real model, but no model hub is reachable and
a real checkpoint is far too slow on a CPU. :func:`build_tiny_model` writes a ~8 MB
Llama (4 layers, hidden 256, GQA with 2 KV heads, head_dim 64, bf16) whose weights are
seeded, plus a ~2k-token byte-level BPE tokenizer trained on CPython's own stdlib
sources and a minimal chat template. The outputs are meaningless but, with greedy
sampling, deterministic -- so a KV connector that restores the right KV reproduces them
exactly, while wrong KV visibly changes them.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["DEFAULT_MODEL_DIR", "build_tiny_model"]

logger = logging.getLogger(__name__)

#: Bump whenever the recipe changes, so stale cached builds are rebuilt.
BUILD_VERSION = "1"
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


def _default_model_dir() -> str:
    cache = os.environ.get("KVPOOL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvpool"
    )
    return os.path.join(cache, "tiny-llama")


#: Where :func:`build_tiny_model` builds by default (``$KVPOOL_CACHE_DIR/tiny-llama``,
#: else ``~/.cache/kvpool/tiny-llama``), as seen at import time.
DEFAULT_MODEL_DIR: str = _default_model_dir()


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


def _build_model(out: pathlib.Path, vocab_size: int, bos: int, eos: int, pad: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        # Larger than Llama's 0.02 so that greedy continuations are varied and react to
        # any change in the context (e.g. wrong KV) instead of collapsing into repeats.
        initializer_range=0.1,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    model = model.bfloat16()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)


def build_tiny_model(
    model_dir: str | os.PathLike[str] | None = None, *, force: bool = False
) -> pathlib.Path:
    """Build the tiny model into ``model_dir`` unless a complete build is already there.

    ``model_dir`` defaults to ``$KVPOOL_CACHE_DIR/tiny-llama`` (else
    ``~/.cache/kvpool/tiny-llama``). With ``force`` the model is rebuilt even if present.
    Safe to call concurrently: each caller builds privately and renames into place.
    Returns the model directory, ready for ``vllm.LLM(model=str(path))``.
    """
    target = pathlib.Path(model_dir if model_dir is not None else _default_model_dir())
    target = target.expanduser().absolute()
    if not force and _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        tok = _build_tokenizer(tmp)
        _build_model(tmp, len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only modes
            f.chmod(0o644)
        tmp.chmod(0o755)
        (tmp / MARKER_NAME).write_text(BUILD_VERSION + "\n", encoding="utf-8")
        _install(tmp, target, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny model ready at %s (%.1fs)", target, time.perf_counter() - start)
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
