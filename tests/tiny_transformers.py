"""Tiny Hugging Face models (random weights, eager attention) the capture and export tests share."""

from __future__ import annotations

import warnings

import pytest


def quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with warnings silenced (transformers and torch.export are chatty)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def tiny_bert():
    """A 2-layer BertModel, hidden size 32, eager attention (it can return its weights)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, attn_implementation="eager")
    return transformers.BertModel(config).eval()


def tiny_gpt2():
    """A 2-layer GPT2Model, no key/value cache, eager attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2Model(config).eval()
