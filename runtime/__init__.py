"""The Ladle runtime: a paged-KV, continuous-batching LLM engine and its OpenAI server."""
