"""The built-in tiny model: a deterministic random Llama and a character-level tokenizer.

``build_tiny_model`` writes a normal Hugging Face directory (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) that ``transformers.AutoModelForCausalLM``/``AutoTokenizer`` and
``vllm.LLM`` both load. Nothing is downloaded: the weights come from a seeded generator.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from runtime.config import TinyModelConfig

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
"""Ids 0..3, in this order."""

CHARACTERS = (*string.printable[:95], "\n")
"""Every printable ASCII character (digits, letters, punctuation, space) plus newline; anything
else maps to ``<unk>``."""

# vLLM's CPU attention kernels only accept head sizes >= 32 (cpu_attn.get_supported_head_sizes),
# so a 64-wide model with 4 heads gets 32-wide heads (Llama allows head_dim != hidden/heads).
_MIN_HEAD_DIM = 32


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens first, then the characters."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_tokenizer():
    """A character-level ``tokenizers.Tokenizer`` that prepends ``<bos>`` to every encoding.

    A BPE model with no merges splits text into single characters; the ``Fuse`` decoder joins
    them back without separators, so ``decode(encode(s)) == s`` for every ASCII string.
    """
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = vocabulary()
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.decoder = decoders.Fuse()
    # The post-processor adds <bos> whenever special tokens are requested, so HF and vLLM
    # (which tokenizes with add_special_tokens=True) produce the same prompt ids.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tokenizer


def _head_dim(cfg: TinyModelConfig) -> int:
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"model.tiny.num_heads: {cfg.num_heads} does not divide model.tiny.hidden_size "
            f"({cfg.hidden_size})"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"model.tiny.num_kv_heads: {cfg.num_kv_heads} does not divide model.tiny.num_heads "
            f"({cfg.num_heads})"
        )
    return max(_MIN_HEAD_DIM, cfg.hidden_size // cfg.num_heads)


def llama_config(cfg: TinyModelConfig):
    """The ``LlamaConfig`` of the tiny model."""
    from transformers import LlamaConfig

    vocab = vocabulary()
    return LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=_head_dim(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
        torch_dtype="float32",
    )


def save_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.json`` and the transformers side files into ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=None,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(out_dir))


def build_tiny_model(out_dir: Path, cfg: TinyModelConfig, seed: int = 0) -> Path:
    """Write a random float32 ``LlamaForCausalLM`` and its character tokenizer into ``out_dir``.

    The same ``cfg`` and ``seed`` give bit-identical weights: initialisation runs on a private
    CPU generator under ``torch.random.fork_rng``, so the caller's RNG state is left alone.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = llama_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(out_dir)
    return out_dir


def tiny_model_info(out_dir: Path) -> dict[str, object]:
    """Shape summary of a built tiny model (for logs)."""
    config = json.loads((Path(out_dir) / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
    return {key: config.get(key) for key in keys}
