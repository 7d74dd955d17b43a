"""Token-time metrics of one request, vLLM's conventions (DESIGN §6).

TPOT = (last token − first token) / (output_len − 1). Inter-token latency (ITL) = the gaps between
successive *distinct* emission times: the tokens one step emits (accepted drafts + one) reach the
client as one delivery, so a speculative round counts as one gap, not as k gaps of zero.
"""

from __future__ import annotations

import numpy as np


def delivery_gaps(token_times: list[float]) -> list[float]:
    """[deliveries − 1] seconds between successive distinct emission times of ``token_times`` [output_len]."""
    deliveries = [t for index, t in enumerate(token_times) if index == 0 or t != token_times[index - 1]]
    return [later - earlier for earlier, later in zip(deliveries, deliveries[1:], strict=False)]


def time_per_output_token(token_times: list[float]) -> float | None:
    """(last − first emission) / (tokens − 1); None below two tokens."""
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (numpy linear interpolation), None when ``values`` is empty."""
    return float(np.percentile(values, q)) if values else None
