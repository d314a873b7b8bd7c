"""The rolegate proxy: an OpenAI-compatible front door that routes each request by role."""
