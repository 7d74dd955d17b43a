"""The EAGLE-3 training objective: the head unrolled on its own states ("training-time test"), soft cross-entropy
to the target's distribution over the draft vocabulary.

One sequence x_0 .. x_{T-1} (a prompt and the target's own answer) with the target's states at each
position. Step k (k = 0 .. steps - 1) puts the head at every anchor t = 0 .. T - 2 - k as the k-th draft
step after the verified token at t would: its input is the embedding of x_{t+1+k} (the ground-truth token)
beside a state — at step 0 ``fc`` of the target's states at t, at step k the head's own ``aux`` of step
k - 1 at t — at position t + k, and it predicts the token after x_{t+1+k}: its target is the target's
next-token distribution at position t + 1 + k, renormalised over the draft vocabulary (the loss is the KL
divergence: the soft cross-entropy less the target's entropy, the same gradient with a floor of 0). Attention is what
drafting at inference sees: the anchor's query attends the step-0 keys of positions 0 .. t (the verified
prefix, causal) and its own keys of steps 1 .. k (the tokens it drafted before). Step k's loss is weighted
``decay ** k``; only positions whose predicted token is at ``loss_from`` or later count (the answer, or the
prompt's too), and the head's logits are computed for those alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spectoolkit.models.eagle3_head import Eagle3Head


@dataclass
class Sequence:
    """One training sequence, from the target (:func:`spectoolkit.training.data.target_sequence`)."""

    ids: torch.Tensor  # int64 [T]
    states: torch.Tensor  # [T, 3H]: the residual stream entering the head's three target layers (any float dtype)
    final: torch.Tensor  # [T - loss_from + 1, H]: the target's last hidden state (after its final norm) at positions
    # loss_from - 1 .. T - 1 (the only ones a counted prediction is compared with; any float dtype)
    lm_rows: torch.Tensor  # [draft_vocab, H]: the target's output rows of the draft ids (shared between sequences)
    loss_from: int  # >= 1: predictions of x_j count for j >= it (the prompt's length: the answer only)

    def target_logits(self) -> torch.Tensor:
        """[T - loss_from + 1, draft_vocab] fp32: the target's next-token logits at the draft ids."""
        return self.final.float() @ self.lm_rows.T


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [1, Hq, L, D] of step k = len(keys) - 1 -> [1, Hq, L, D]: anchor t attends step 0's keys 0..t and
    steps 1..k's keys at t (each keys[j] [1, Hkv, >= L, D])."""
    length, rep = q.shape[2], q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t[:, :, :length].repeat_interleave(rep, dim=1)  # [1, Hq, L, D]

    prefix = q @ heads(keys[0]).transpose(-1, -2) * scale  # [1, Hq, L, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    own = [(q * heads(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [1, Hq, L, 1] each
    weights = torch.softmax(torch.cat([prefix.masked_fill(~causal, float("-inf")), *own], dim=-1), dim=-1)
    out = weights[..., :length] @ heads(values[0])
    for j, v in enumerate(values[1:]):
        out = out + weights[..., length + j : length + j + 1] * heads(v)
    return out


def ttt_loss(
    head: Eagle3Head, embeddings: torch.Tensor, seq: Sequence, steps: int, decay: float = 0.8
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(weighted loss, per step (top-1 agreements, positions counted)) of ``seq``; ``embeddings`` the
    target's input embedding table (frozen)."""
    attn = head.midlayer.self_attn
    length = seq.ids.shape[0]
    embeds = embeddings[seq.ids]  # [T, H]
    target = torch.softmax(seq.target_logits(), dim=-1)  # [T - loss_from + 1, Vd]: rows loss_from - 1 ..
    hidden = head.fc(seq.states[None].float())  # [1, T, H]
    keys, values, total, stats = [], [], torch.zeros(()), []
    for k in range(steps):
        rows = length - 1 - k  # anchors 0 .. rows - 1
        if rows <= 0:
            break
        state = hidden[:, :rows]
        positions = (torch.arange(rows) + k)[None]
        q, key, value = attn.qkv(head.layer_in(embeds[None, 1 + k : 1 + k + rows], state), positions)
        keys.append(key)
        values.append(value)
        normed, hidden = head.layer_out(attn.output(ttt_attention(q, keys, values)), state)
        first = max(0, seq.loss_from - 2 - k)  # anchors t >= first predict an answer token, x_{t+2+k}
        if first >= rows:
            stats.append((0, 0))
            continue
        log_probs = F.log_softmax(head.draft_logits(normed[0, first:]).float(), dim=-1)  # [rows - first, Vd]
        row = 1 + k + first - (seq.loss_from - 1)  # the target's row predicting x_{first+2+k}
        want = target[row : row + rows - first]
        per_position = (torch.xlogy(want, want) - want * log_probs).sum(-1)  # KL(target || head): CE - entropy
        total = total + decay**k * per_position.mean()
        agree = (log_probs.argmax(-1) == want.argmax(-1)).sum()
        stats.append((int(agree), rows - first))
    return total, stats
