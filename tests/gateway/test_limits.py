"""API keys from a Secret file and their token buckets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ladle.gateway.apikeys import KeyFileError, KeyStore, parse_keys
from ladle.gateway.ratelimit import KeyLimiter, TokenBucket


def test_bucket_refills_at_its_rate_and_says_how_long_to_wait() -> None:
    bucket = TokenBucket(60, now=0.0)  # one per second, burst 60
    for _ in range(60):
        assert bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == pytest.approx(1.0)
    assert bucket.take(0.5) == pytest.approx(0.5)
    assert bucket.take(1.0) == 0.0


def test_token_debt_blocks_until_refilled() -> None:
    limiter = KeyLimiter(None, 600, now=0.0)  # 10 tokens/s
    assert limiter.admit(0.0) is None
    limiter.charge_tokens(0.0, 700)  # 100 over
    refusal = limiter.admit(1.0)
    assert refusal is not None
    assert refusal.limit == "tokens"
    assert refusal.retry_after == pytest.approx(9.0, abs=0.01)
    assert "600 tokens per minute" in refusal.message
    assert limiter.admit(10.1) is None


def test_requests_limit() -> None:
    limiter = KeyLimiter(2, None, now=0.0)
    assert limiter.admit(0.0) is None
    assert limiter.admit(0.0) is None
    refusal = limiter.admit(0.0)
    assert refusal is not None
    assert refusal.limit == "requests"
    assert refusal.retry_after == pytest.approx(30.0)


KEYS = """
keys:
  - name: team-a
    key: sk-team-a-0001
    requestsPerMinute: 2
  - name: batch
    key: sk-batch-0002
    tokensPerMinute: 1000
"""


def test_keys_file_parses_and_rejects_mistakes_with_their_place() -> None:
    specs = parse_keys(KEYS)
    assert [(s.name, s.requests_per_minute, s.tokens_per_minute) for s in specs] == [
        ("team-a", 2, None),
        ("batch", None, 1000),
    ]
    for text, words in [
        ("keys: []", "holds no key"),
        ("- a", "'keys' list"),
        ("keys: [{name: a, key: short}]", "at least 8"),
        ("keys: [{name: a, key: sk-00000001, requestsPerMinute: 0}]", "positive integer"),
        ("keys: [{name: a, key: sk-00000001}, {name: a, key: sk-00000002}]", "used twice"),
        ("keys: [{name: a, key: sk-00000001, rpm: 3}]", "unknown field 'rpm'"),
    ]:
        with pytest.raises(KeyFileError, match=words):
            parse_keys(text)


def test_store_reloads_a_rotated_secret_and_keeps_limiter_state(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    store = KeyStore(path, now=0.0)
    key = store.lookup("sk-team-a-0001", 0.0)
    assert key is not None
    assert key.name == "team-a"
    assert store.lookup("sk-wrong-000000", 0.0) is None
    key.limiter.admit(0.0)
    path.write_text(KEYS + "  - name: new\n    key: sk-new-key-0003\n")
    os.utime(path, ns=(1, 10**18))
    assert store.lookup("sk-new-key-0003", 0.5) is None  # rechecked at most once a second
    assert store.lookup("sk-new-key-0003", 1.5) is not None
    same = store.lookup("sk-team-a-0001", 1.5)
    assert same is key  # unchanged limits keep their bucket
    path.write_text("garbage: [")
    os.utime(path, ns=(1, 2 * 10**18))
    assert store.lookup("sk-team-a-0001", 3.0) is key  # a broken file keeps the old keys
