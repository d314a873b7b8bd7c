"""A simulated OpenRouter-style LLM aggregator: a real HTTP server speaking OpenAI chat
completions, with scripted, deterministic misbehaviour per machine.

It is the upstream for rolegate's tests, demo and benchmark. See docs/sim-scenarios.md.
It must never import rolegate itself (an import-linter contract enforces it).
"""
