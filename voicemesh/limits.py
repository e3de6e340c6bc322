"""Request limits that more than one process checks (the gateway up front, the service again): one definition."""

DEFAULT_MAX_TOKENS = 48
"""Reply length cap when a request leaves max_tokens at 0."""
MAX_TOKENS_LIMIT = 512
"""The most tokens one reply may ask for."""
