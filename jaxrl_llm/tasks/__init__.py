"""Tasks: prompts + verifiable rewards. Embedded: arithmetic (no download)."""
