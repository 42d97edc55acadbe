"""Conversation KV kept across turns (Pensieve): the tiers' block tree and
eviction policies, the block stores, the vLLM KV connector that runs them, and
the same policy for vLLM's own OffloadingConnector (CUDA hosts)."""

CONNECTOR_NAME = "PensieveConnector"
CONNECTOR_CLASS = "vllm_chunkattn.cache.connector.PensieveConnector"
