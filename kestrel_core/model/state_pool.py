"""The host's recurrent states of linear-attention layers (Gated DeltaNet, Qwen3.5): a slot per sequence.

A linear layer keeps no keys and values. Each sequence carries, per linear layer, the last ``kernel - 1`` inputs of
its causal convolution (``conv``) and its delta rule's state (``ssm``, [Hv, dk, dv]), float32, which every new
token updates in place. A state stands for all of a sequence's positions at once, so it cannot go back to an
earlier length: a model with linear layers shares no prefix blocks and guesses no draft tokens. The arrays grow
(doubling) when every slot is taken; a slot is zeroed when a sequence takes it.
"""

from __future__ import annotations

import numpy as np

from kestrel_core.model.config import ModelConfig

FIRST_SLOTS = 4


class StatePool:
    """``conv`` float32 [linear layers, slots, kernel - 1, C] and ``ssm`` [linear layers, slots, Hv, dk, dv]."""

    def __init__(self, config: ModelConfig, slots: int = FIRST_SLOTS) -> None:
        c = config
        self.config = config
        self.layer_index = {layer: j for j, layer in enumerate(c.linear_layers)}  # model layer -> first axis
        n = len(self.layer_index)
        self.conv = np.zeros((n, slots, c.linear_conv_kernel - 1, c.linear_conv_dim), np.float32)
        self.ssm = np.zeros((n, slots, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim), np.float32)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def slots(self) -> int:
        return self.conv.shape[1]

    @property
    def bytes_per_sequence(self) -> int:
        return (self.conv[:, 0].nbytes + self.ssm[:, 0].nbytes) if self.slots else 0

    def take(self) -> int:
        """A zeroed slot (the state of an empty sequence)."""
        if not self._free:
            old = self.slots
            self.conv = np.concatenate([self.conv, np.zeros_like(self.conv)], axis=1)
            self.ssm = np.concatenate([self.ssm, np.zeros_like(self.ssm)], axis=1)
            self._free = list(range(2 * old - 1, old - 1, -1))
        slot = self._free.pop()
        self.conv[:, slot] = 0
        self.ssm[:, slot] = 0
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
