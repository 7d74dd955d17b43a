"""Serving engines that are not ours: any OpenAI-compatible endpoint, and vLLM servers we start (issue 17)."""
