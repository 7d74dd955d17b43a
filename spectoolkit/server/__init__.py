"""The OpenAI-compatible HTTP server over the continuous-batching engine (``python -m spectoolkit.serve``)."""
