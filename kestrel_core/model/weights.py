"""The in-memory model every backend sees: strip-caches for projections, float32 for the rest."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.model.config import ModelConfig
from kestrel_core.wkey import Proj, lm_head_wkey, wkey

LAYER_PROJS = (Proj.Q, Proj.K, Proj.V, Proj.O, Proj.GATE, Proj.UP, Proj.DOWN)


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [D]
    q: StripCache  # [H*hd, D]
    k: StripCache  # [KV*hd, D]
    v: StripCache  # [KV*hd, D]
    o: StripCache  # [D, H*hd]
    mlp_norm: np.ndarray  # [D]
    gate: StripCache  # [F, D]
    up: StripCache  # [F, D]
    down: StripCache  # [D, F]
    q_bias: np.ndarray | None = None  # Qwen2: [H*hd]
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # Qwen3: [hd]
    k_norm: np.ndarray | None = None

    def proj(self, p: Proj) -> StripCache:
        return {Proj.Q: self.q, Proj.K: self.k, Proj.V: self.v, Proj.O: self.o, Proj.GATE: self.gate,
                Proj.UP: self.up, Proj.DOWN: self.down}[p]


@dataclass
class Model:
    config: ModelConfig
    embedding: StripCache  # [V, D]; rows dequantized at lookup
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [D]
    lm_head: StripCache  # [V, D]; the embedding itself when tied

    def weights(self) -> list[tuple[int, StripCache]]:
        """Every (wkey, StripCache) the GEMMs use, in execution order."""
        out = [(wkey(i, p), layer.proj(p)) for i, layer in enumerate(self.layers) for p in LAYER_PROJS]
        return out + [(lm_head_wkey(), self.lm_head)]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.weights())
