"""The contract between a runtime pod's ``/metrics`` and its readers: the names that the
gateway (picking), the autoscaler and the canary analysis read, and the one parser they read
them with. The runtime exports them (``ladle.runtime.server.metrics``, vLLM's set under
``ladle:``); a test reads a real runtime's page through every reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

# Gauges: the engine's load now.
RUNNING = "ladle:num_requests_running"
WAITING = "ladle:num_requests_waiting"
KV_USAGE = "ladle:kv_cache_usage_perc"
# The Gateway API Inference Extension's model-server protocol: the names under which every
# endpoint picker (GAIE's, llm-d's) reads a pod's load, vLLM's own. The runtime exports each
# of these gauges under both names, and the engine's cache layout as an info gauge whose
# labels (block_size, num_gpu_blocks) the pickers' prefix-cache scorers read.
PROTOCOL_GAUGES = {
    RUNNING: "vllm:num_requests_running",
    WAITING: "vllm:num_requests_waiting",
    KV_USAGE: "vllm:kv_cache_usage_perc",
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# With LoRA on: the adapters in device slots, those of waiting requests, and max_lora, as
# labels on the time of the scrape (vLLM's gauge, which pickers read to prefer pods that hold
# a request's adapter), under our prefix and under vLLM's name.
LORA_INFO = "ladle:lora_requests_info"
# With LoRA on: 1 per adapter and state (loaded, or failed to load from the modules file).
LORA_ADAPTERS = "ladle:lora_adapters"
PROTOCOL_LORA_INFO = "vllm:lora_requests_info"
# Histograms (read as their _bucket, _sum and _count samples).
ITL = "ladle:inter_token_latency_seconds"
TTFT = "ladle:time_to_first_token_seconds"
TPOT = "ladle:request_time_per_output_token_seconds"
# Counters: every finished request by finish reason, and every refused one.
SUCCESS = "ladle:request_success_total"
REJECTED = "ladle:request_rejected_total"
# The process's own start (restarts between two scrapes).
STARTED = "process_start_time_seconds"

Sample = tuple[Mapping[str, str], float]


def samples(text: str, names: Iterable[str]) -> dict[str, list[Sample]]:
    """The samples of each named series (sample names: ``_total``, ``_bucket``, ``_sum`` and
    ``_count`` included), empty for one the page lacks. Lines that hold a wanted sample where
    the page does not parse raise ValueError.

    Only the wanted lines are parsed: the gateway reads every pod's page every few seconds on
    its request loop, and a whole page (about 280 lines) costs some 50 times more."""
    wanted = set(names)
    found: dict[str, list[Sample]] = {name: [] for name in wanted}
    lines = [line for line in text.splitlines() if _series(line) in wanted]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name].append((sample.labels, float(sample.value)))
    return found


def _series(line: str) -> str:
    """A sample line's series name (comments and blank lines give names no one wants)."""
    return line.partition("{")[0].partition(" ")[0]
