"""``ladle serve --speculative-config`` through the OpenAI client: greedy answers, streamed or
not, equal the plain server's, and vLLM's ``spec_decode`` counters count what was verified."""

from __future__ import annotations

import json
from pathlib import Path

import openai

from .conftest import Server, start_server

PASSAGE = (
    "The river flows through the old town, past the mill and the church, and under the stone "
    "bridge where the children fish in summer. In winter the river freezes and the people "
    "skate on it from the mill to the bridge."
)
PROMPT = f"Repeat this passage exactly.\n\nPassage: {PASSAGE}\n\nRepeated: {PASSAGE[:30]}"
CONFIG = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4,
          "prompt_lookup_min": 2}  # fmt: skip


def complete(url: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    args = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 48,
            "temperature": 0}  # fmt: skip
    if not stream:
        return client.completions.create(**args).choices[0].text  # type: ignore[call-overload,no-any-return]
    chunks = client.completions.create(**args, stream=True)  # type: ignore[call-overload]
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_greedy_answers_are_the_plain_servers_and_the_drafts_are_counted(
    server: Server, tmp_path: Path
) -> None:
    spec = start_server(tmp_path, "--speculative-config", json.dumps(CONFIG))
    try:
        for stream in (False, True):
            assert complete(spec.url, stream) == complete(server.url, stream)
        drafts = spec.metric("ladle:spec_decode_num_drafts_total")
        proposed = spec.metric("ladle:spec_decode_num_draft_tokens_total")
        accepted = spec.metric("ladle:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= proposed <= 6 * drafts
        first = spec.metric("ladle:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        assert 0 < first <= drafts
        assert server.metric("ladle:spec_decode_num_drafts_total") == 0
    finally:
        assert spec.stop() == 0
