#!/usr/bin/env python3
"""Beam search in the engine (beams share KV blocks copy-on-write, one step a round) against
vLLM v1's way, driven from the entrypoint: each round, one request of ``max_tokens=1`` per
beam, prompt plus the beam's tokens so far, its full blocks found in the prefix cache.

Both arms run the same search (``BeamSearch`` decides the rounds in both, and the best
hypotheses are checked equal), on the default model, in interleaved rounds with the prefix
cache emptied before each run. Reported: the median wall time of each arm (spread: min-max),
and the ratio. This is why Ladle's beam search stays in the engine.

    .venv/bin/python bench/beam_search.py
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from ladle.runtime.beam_search import BeamCandidates, BeamSearch  # noqa: E402
from ladle.runtime.llm import LLM  # noqa: E402
from ladle.runtime.sampling_params import (  # noqa: E402
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)

TEXTS = [
    "The history of the Roman empire is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
]

Beam = tuple[list[int], float]


def in_engine(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> list[list[int]]:
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    return [o.sequences[0].tokens[len(p) :] for o, p in zip(outputs, prompts, strict=True)]


def from_entrypoint(
    llm: LLM, prompts: list[list[int]], params: BeamSearchParams
) -> list[list[int]]:
    """vLLM v1's ``beam_search``: the engine sees one-token requests only."""
    engine = llm.engine
    ids = itertools.count()
    eos = frozenset(engine.scheduler.eos_token_ids)
    searches = [BeamSearch(params, eos, params.max_tokens) for _ in prompts]
    beams: dict[int, list[Beam]] = {i: [([], 0.0)] for i in range(len(prompts))}
    k = searches[0].num_candidates
    step = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        ignore_eos=True,
        logprobs=k,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    while beams:
        asked: dict[str, tuple[int, int]] = {}
        for search, live in beams.items():
            for b, (tokens, _) in enumerate(live):
                rid = f"beam-{next(ids)}"
                asked[rid] = (search, b)
                engine.add_request(rid, {"prompt_token_ids": prompts[search] + tokens}, step)
        top: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    (logprobs,) = out.outputs[0].logprobs or []
                    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1].logprob)[:k]
                    top[asked[out.request_id]] = (
                        [t for t, _ in ranked],
                        [lp.logprob for _, lp in ranked],
                    )
        for search in list(beams):
            live = beams[search]
            runs_on = searches[search].step(
                [
                    BeamCandidates(tokens, cum, *top[(search, b)])
                    for b, (tokens, cum) in enumerate(live)
                ]
            )
            if searches[search].done:
                del beams[search]
            else:
                beams[search] = [
                    ([*live[c.parent][0], c.token_id], c.cumulative_logprob) for c in runs_on
                ]
    return [s.finished[0].token_ids for s in searches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(max_model_len=1024)
    prompts = [list(llm.engine.tokenizer.encode(t)) for t in TEXTS]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
    arms = {"in the engine": in_engine, "from the entrypoint": from_entrypoint}
    best = {name: arm(llm, prompts, params) for name, arm in arms.items()}  # warm-up
    if len({str(b) for b in best.values()}) != 1:
        sys.exit("the two arms found different best beams")
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(args.rounds):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for name in order:
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            arms[name](llm, prompts, params)
            times[name].append(time.perf_counter() - start)
    print(
        f"{len(prompts)} prompts, beam width {args.beam_width}, {args.max_tokens} tokens, "
        f"{args.rounds} rounds alternating"
    )
    for name, runs in times.items():
        print(f"  {name:<20} {statistics.median(runs):6.2f} s  ({min(runs):.2f}-{max(runs):.2f})")
    ratio = statistics.median(times["from the entrypoint"]) / statistics.median(
        times["in the engine"]
    )
    print(f"  entrypoint / engine: {ratio:.2f}x")


if __name__ == "__main__":
    main()
