"""Rollout: engines that speak SGLang's HTTP API (built-in or SGLang), the client, and the rollout loop."""
