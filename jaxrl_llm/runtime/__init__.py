"""Asynchronous runtime pieces: version-aware queue, delay models (orchestrator: issue #5)."""
