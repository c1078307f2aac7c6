"""Tensor parallelism over two CPU processes (gloo): the layout arithmetic, greedy output the
same token for token as one rank's on the default model and a random-weight model of each
architecture (one with fewer KV heads than ranks), the engine's features under it, and a rank
that dies failing the engine at once instead of hanging it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kube_harness import free_port
from random_weights import save_random_model, tiny_config
from transformers import AutoConfig

from ladle.runtime import LLM, SamplingParams
from ladle.runtime.async_engine import AsyncLLM
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.models.config import ModelConfig, model_config_from_hf
from ladle.runtime.parallel.group import RankFailure
from ladle.runtime.parallel.layout import check_tensor_parallel, shard_layout
from ladle.runtime.quantization.awq import Calibration
from ladle.runtime.sampling_params import BeamSearchParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Count: one, two, three, four, five, one, two, three,",
    "Write a short poem about the sea.",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _config(heads: int, kv_heads: int, vocab: int = 100) -> ModelConfig:
    hf = tiny_config("llama", vocab)
    hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim = heads, kv_heads, 8
    hf.architectures = ["LlamaForCausalLM"]
    return model_config_from_hf(hf)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"),
    [(9, 3, 2), (9, 3, 3), (9, 3, 9), (4, 2, 2), (4, 1, 2), (8, 2, 4), (32, 8, 8), (4, 2, 4)],
)
def test_each_query_head_is_on_one_rank_with_the_kv_head_it_reads(
    heads: int, kv_heads: int, size: int
) -> None:
    cfg = _config(heads, kv_heads)
    group = heads // kv_heads
    layouts = [shard_layout(cfg, size, rank) for rank in range(size)]
    assert sorted(h for layout in layouts for h in layout.q_heads) == list(range(heads))
    for layout in layouts:
        assert layout.kv_heads, "every rank reads at least one KV head"
        # Local GQA stays uniform: the i-th local query head reads local KV head i // g.
        local_group = len(layout.q_heads) // len(layout.kv_heads)
        for i, head in enumerate(layout.q_heads):
            assert head // group == layout.kv_heads[i // local_group]
    assert sorted(i for lo in layouts for i in lo.intermediate) == list(
        range(cfg.intermediate_size)
    )
    # Vocabulary slices tile the padded vocabulary.
    assert [lo.vocab_start for lo in layouts] == [r * layouts[0].vocab_rows for r in range(size)]
    assert layouts[0].vocab_rows * size >= cfg.vocab_size


def test_slices_put_back_together_are_the_weights() -> None:
    cfg = _config(4, 2, vocab=101)
    dim, hidden = cfg.head_dim, cfg.hidden_size
    q = torch.randn(cfg.num_heads * dim, hidden)
    o = torch.randn(hidden, cfg.num_heads * dim)
    down = torch.randn(hidden, cfg.intermediate_size)
    embed = torch.randn(cfg.vocab_size, hidden)
    layouts = [shard_layout(cfg, 2, rank) for rank in range(2)]
    cat = torch.cat
    assert torch.equal(cat([lo.shard("self_attn.q_proj.weight", q, dim) for lo in layouts]), q)
    assert torch.equal(cat([lo.shard("self_attn.o_proj.weight", o, dim) for lo in layouts], 1), o)
    assert torch.equal(
        cat([lo.shard("mlp.down_proj.weight", down, dim) for lo in layouts], 1), down
    )
    table = cat([lo.shard("model.embed_tokens.weight", embed, dim) for lo in layouts])
    assert table.shape[0] == 102
    assert torch.equal(table[:101], embed)
    assert not table[101:].any(), "the padding rows are zero"
    norm = torch.randn(hidden)
    assert layouts[1].shard("input_layernorm.weight", norm, dim) is norm


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "says"),
    [
        (9, 3, 4, "does not split the model's 9 attention heads over its 3 KV heads; sizes "
         "that do: 2, 3, 9"),
        (4, 1, 8, "sizes that do: 2, 4"),
        (4, 2, 3, "sizes that do: 2, 4"),
    ],
)  # fmt: skip
def test_a_size_the_heads_do_not_split_into_is_refused(
    heads: int, kv_heads: int, size: int, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        check_tensor_parallel(_config(heads, kv_heads), size)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"enable_lora": True}, "enable_lora does not work with tensor_parallel_size > 1"),
        (
            {"quantization": "int4", "quantization_method": "gptq"},
            "quantization_method gptq rounds each layer on the whole model's activations",
        ),
        ({"device": "cuda:1"}, "narrow them with CUDA_VISIBLE_DEVICES"),
    ],
)
def test_what_does_not_split_yet_is_refused_before_anything_starts(
    args: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        EngineArgs(tensor_parallel_size=2, **args)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
         default_model_path: Path) -> Callable[[str], Path]:  # fmt: skip
    """The tiny architectures, ``qwen2-mqa`` (one KV head, so two ranks replicate it) and
    ``llama-mha`` (as many KV heads as query heads: AWQ scales O's input too)."""
    kv_heads = {"qwen2-mqa": ("qwen2", 1), "llama-mha": ("llama", 4)}

    def build(name: str) -> Path:
        if name not in kv_heads:
            return tiny_model_factory(name)
        arch, kv = kv_heads[name]
        vocab: int = AutoConfig.from_pretrained(default_model_path).vocab_size
        cfg = tiny_config(arch, vocab)
        cfg.num_key_value_heads = kv
        return Path(save_random_model(cfg, tmp_path_factory.mktemp(name), default_model_path))

    return build


def _split(model: Path | str, **args: Any) -> Iterator[LLM]:
    llm = LLM(str(model), tensor_parallel_size=2, **{"kv_cache_memory": "64Mi", **args})
    try:
        yield llm
    finally:
        llm.engine.shutdown()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
INT4 = {"quantization": "int4", "quantization_method": "rtn", "quantization_group_size": 32}
AWQ_INT4 = {"quantization": "int4", "quantization_group_size": 32}  # awq: the default method


@pytest.mark.parametrize(
    ("arch", "args"),
    [
        ("llama", {}),
        ("mistral", {}),
        ("qwen2", {}),
        ("qwen2-mqa", {}),
        ("qwen3", INT4),
    ],
    ids=["llama", "mistral", "qwen2", "qwen2-mqa", "qwen3-int4"],
)
def test_greedy_output_split_over_two_ranks_is_one_ranks(
    tiny: Callable[[str], Path], arch: str, args: dict[str, Any]
) -> None:
    """Split at group boundaries, int4 groups quantize alike (qwen3 runs int4 only: its
    quantized run covers its layout too)."""
    path = tiny(arch)
    expected = _tokens(LLM(str(path), kv_cache_memory="64Mi", **args), PROMPTS, GREEDY)
    for llm in _split(path, **args):
        assert _tokens(llm, PROMPTS, GREEDY) == expected


def test_awq_clips_that_a_rank_would_cut_mid_group_are_refused_by_name() -> None:
    """Rank 1 of the default model's shape (9 query heads over 3 KV heads, here of 8 dims)
    holds O's input columns 24..72, which groups of 32 cannot start at."""
    cfg = _config(9, 3)
    layout = shard_layout(cfg, 2, 1)
    whole = Calibration(
        scales={(0, "o_proj"): torch.ones(cfg.q_size)},
        clips={(0, "o_proj"): torch.ones(cfg.hidden_size, cfg.q_size // 8)},
    )
    assert whole.shard(layout, cfg, 8).scales[(0, "o_proj")].shape == (48,)
    with pytest.raises(ConfigError, match="quantization_group_size 32 does not divide"):
        whole.shard(layout, cfg, 32)


@pytest.mark.parametrize("arch", ["llama", "llama-mha"])
def test_awq_split_over_two_ranks_is_one_ranks_from_one_calibration(
    tiny: Callable[[str], Path], arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWQ calibrates on the whole model, which no rank holds: the first rank to load
    calibrates an unsplit copy, once (the others wait, then read the cache), each takes its
    slice of the scales and clip ratios, and the greedy output is one rank's."""
    monkeypatch.setenv("LADLE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LADLE_CALIBRATION_DIR", raising=False)
    path = tiny(arch)
    for llm in _split(path, **AWQ_INT4):
        split = _tokens(llm, PROMPTS, GREEDY)
    assert len(list((tmp_path / "calibration").glob("awq-*.safetensors"))) == 1
    assert _tokens(LLM(str(path), kv_cache_memory="64Mi", **AWQ_INT4), PROMPTS, GREEDY) == split


def test_the_default_model_split_keeps_every_feature(default_model_path: Path) -> None:
    """The default model (9 query heads over 3 KV heads: ranks of 1 and 2 KV heads) on one
    rank and on two, drafting n-grams, with KV caches small enough that the prompts preempt
    one another. Only rank 0 samples, from gathered logits: seeded samples, beams and
    logprobs are one rank's."""
    common: dict[str, Any] = {
        "num_gpu_blocks_override": 20,
        "max_num_seqs": 8,
        "speculative_config": NGRAM,
    }
    one = LLM(str(default_model_path), **common)
    for split in _split(default_model_path, **common):
        prompts = [p + f" {i}" for i in range(2) for p in PROMPTS]
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        assert _tokens(split, prompts, params) == _tokens(one, prompts, params)
        stats = split.engine.stats()
        assert stats.num_preemptions > 0, "nothing was preempted"
        assert stats.spec_decode.accepted_tokens > 0, "no draft was accepted"

        sampled = SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=7, prompt_logprobs=1)
        a, b = (llm.generate(PROMPTS[:2], sampled, use_tqdm=False) for llm in (one, split))
        for x, y in zip(a, b, strict=True):
            assert [o.token_ids for o in y.outputs] == [o.token_ids for o in x.outputs]
            assert x.prompt_logprobs is not None
            assert y.prompt_logprobs is not None
            for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
                assert p is not None
                assert q is not None
                for token in p:
                    assert q[token].logprob == pytest.approx(p[token].logprob, abs=1e-3)

        # Prompt logprobs need every prompt position computed; without them a prompt is cached.
        seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
        first = _tokens(split, PROMPTS[1:2], seeded)
        hits = split.engine.stats().prefix_cache_hits
        assert _tokens(split, PROMPTS[1:2], seeded) == first
        assert split.engine.stats().prefix_cache_hits > hits, "the repeated prompt hit no cache"

        beams = {"beam_width": 2, "max_tokens": 8}
        assert _beams(split, beams) == _beams(one, beams)


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _beams(llm: LLM, params: dict[str, Any]) -> list[list[int]]:
    results = llm.beam_search([PROMPTS[0]], BeamSearchParams(**params))
    return [list(seq.tokens) for seq in results[0].sequences]


def test_ranks_on_two_nodes_give_one_ranks_output(
    tiny: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's multi-node flags, on loopback: node 1 is ``ladle serve --node-rank 1`` (headless,
    its rank connecting to node 0 with the shared secret); node 0 is the engine here. When node
    1 dies, its rank dies with it, and node 0 notices while idle."""
    path = tiny("qwen2")
    port = free_port(consecutive=2)
    monkeypatch.setenv("LADLE_PARALLEL_SECRET", "a secret both nodes hold")
    node = subprocess.Popen(
        [sys.executable, "-m", "ladle.cli", "serve", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--log-level", "warning"],
    )  # fmt: skip
    try:
        expected = _tokens(LLM(str(path), kv_cache_memory="64Mi"), PROMPTS, GREEDY)
        for llm in _split(path, nnodes=2, master_port=port):
            assert _tokens(llm, PROMPTS, GREEDY) == expected
            llm.engine.check_health()
            node.kill()
            with pytest.raises(RankFailure, match="rank 1, on another node, disconnected"):
                _check_for(llm, 10)
    finally:
        node.kill()


def _check_for(llm: LLM, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        llm.engine.check_health()
        time.sleep(0.1)


def test_a_rank_that_dies_fails_the_engine_instead_of_hanging_it(
    tiny: Callable[[str], Path],
) -> None:
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(tiny("llama")), tensor_parallel_size=2, kv_cache_memory="64Mi")
    )
    try:
        peers = llm.engine.peers
        assert peers is not None
        os.kill(peers.processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.is_running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not llm.is_running, "the engine loop ignored a dead rank"
        assert isinstance(llm.error, RankFailure)
        assert "rank 1 exited (-9)" in str(llm.error)
    finally:
        llm.shutdown()
