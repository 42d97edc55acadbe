"""Conversation KV kept across turns (Pensieve): the tiers' block tree and
eviction policies, the block stores, and the vLLM KV connector that runs them."""

CONNECTOR_NAME = "PensieveConnector"
CONNECTOR_CLASS = "vllm_chunkattn.cache.connector.PensieveConnector"
