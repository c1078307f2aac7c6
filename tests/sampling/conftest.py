"""Fixtures for the sampling tests: the default tokenizer, one tiny random-weight model that
uses it (fast engine tests), and a way to build sequences for sampler unit tests."""

from __future__ import annotations

import shutil
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from ladle.runtime.config import EngineArgs
from ladle.runtime.engine import LLMEngine
from ladle.runtime.llm import LLM
from ladle.runtime.models.loader import resolve_model
from ladle.runtime.sampling_params import SamplingParams
from ladle.runtime.sequence import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """A 2-layer random Llama with the default model's tokenizer: real text, fast steps."""
    folder = tmp_path_factory.mktemp("tiny-sampling")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(4321)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), kv_cache_memory="32MiB", max_model_len=256)


@pytest.fixture(scope="session")
def tiny_chunked_engine(tiny_model_path: Path) -> LLMEngine:
    """The tiny model with a 6-token step budget: prompts are chunked, decodes crowd out."""
    args = EngineArgs(
        model=str(tiny_model_path),
        max_num_batched_tokens=6,
        kv_cache_memory=32 << 20,
        max_model_len=256,
    )
    return LLMEngine(args)


def make_seq(
    params: SamplingParams,
    prompt: SequenceOf[int] = (0,),
    output: SequenceOf[int] = (),
    all_stop_token_ids: SequenceOf[int] = (),
    bad_words_token_ids: SequenceOf[SequenceOf[int]] = (),
) -> Sequence:
    """A sequence as the sampler sees it, with the engine-bound token data set by hand."""
    params = params.clone()
    params.all_stop_token_ids = frozenset(all_stop_token_ids)
    params.bad_words_token_ids = [list(w) for w in bad_words_token_ids]
    seq = Sequence("r", list(prompt), params, arrival_time=0.0)
    for token in output:
        seq.append_token(token)
    return seq


def assert_no_blocks_leaked(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_allocated_blocks() == 0
    assert not engine.kv.block_tables
