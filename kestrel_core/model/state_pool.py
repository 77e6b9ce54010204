"""The host's recurrent states of the layers that keep no keys and values: a slot per sequence.

A linear-attention layer (Gated DeltaNet: Qwen3.5, Qwen3-Next) keeps, per sequence, the last ``kernel - 1`` inputs
of its causal convolution (``conv``) and its delta rule's state (``ssm``, [Hv, dk, dv]); a Mamba-2 layer (Granite
4.0-H) its convolution's and its scan's ([heads, head_dim, state]); a short-convolution layer (LFM2) its
convolution's last inputs alone. Every new token updates them in place, float32. A state stands for all
of a sequence's positions at once, so it cannot go back to an earlier length: a model with such layers guesses no
draft tokens, and shares a prefix only where a copy of the state was kept at its end (``snapshot``: the prefix
cache keeps them where a prompt's steps end on whole blocks, kv_pool). The arrays grow (doubling) when every slot is
taken; a slot is zeroed when a sequence takes it.
"""

from __future__ import annotations

import numpy as np

from kestrel_core.model.config import ModelConfig

FIRST_SLOTS = 4


class StatePool:
    """Per layer with a state: ``conv[layer]`` float32 [slots, kernel - 1, C] (C: its convolution's channels) and,
    for a linear-attention or Mamba-2 layer, ``ssm[layer]`` [slots, Hv, dk, dv] / [slots, heads, head_dim, state]."""

    def __init__(self, config: ModelConfig, slots: int = FIRST_SLOTS) -> None:
        c = config
        self.config = config
        self.conv: dict[int, np.ndarray] = {}
        self.ssm: dict[int, np.ndarray] = {}
        for i in c.state_layers:
            if c.is_linear(i):
                self.conv[i] = np.zeros((slots, c.linear_conv_kernel - 1, c.linear_conv_dim), np.float32)
                self.ssm[i] = np.zeros((slots, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim),
                                       np.float32)
            elif c.is_mamba(i):
                self.conv[i] = np.zeros((slots, c.mamba_conv_kernel - 1, c.mamba_conv_dim), np.float32)
                self.ssm[i] = np.zeros((slots, c.mamba_heads, c.mamba_head_dim, c.mamba_state), np.float32)
            else:
                self.conv[i] = np.zeros((slots, c.short_conv_kernel - 1, c.hidden_size), np.float32)
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))

    @property
    def bytes_per_sequence(self) -> int:
        return sum(a[0].nbytes for a in (*self.conv.values(), *self.ssm.values())) if self.slots else 0

    def take(self) -> int:
        """A zeroed slot (the state of an empty sequence)."""
        if not self._free:
            for arrays in (self.conv, self.ssm):
                for i, a in arrays.items():
                    arrays[i] = np.concatenate([a, np.zeros_like(a)])
            self._free = list(range(2 * self.slots - 1, self.slots - 1, -1))
            self.slots *= 2
        slot = self._free.pop()
        for arrays in (self.conv, self.ssm):
            for a in arrays.values():
                a[slot] = 0
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def snapshot(self, slot: int) -> list[np.ndarray]:
        """Copies of ``slot``'s state, every layer's (``restore`` takes them)."""
        return [a[slot].copy() for arrays in (self.conv, self.ssm) for a in arrays.values()]

    def restore(self, slot: int, snapshot: list[np.ndarray]) -> None:
        """``slot``'s state set to a ``snapshot``'s."""
        for a, saved in zip((a for arrays in (self.conv, self.ssm) for a in arrays.values()), snapshot):
            a[slot] = saved
