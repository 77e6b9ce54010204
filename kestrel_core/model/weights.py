"""The in-memory model every backend sees: strip-caches for projections, float32 for the rest.

This is the model view the whole-step hooks (``kestrel_preload``, ``kestrel_forward``,
``kestrel_forward_batch``, ``kestrel_decode_greedy``) receive, and what a backend may rely on: ``Model``'s
fields, ``LayerWeights``' fields and ``groups()``, ``engine_weights``, ``PREFILL_CHUNK`` and
``kestrel_core.model.rope.rope_inv_freq`` (docs/plugins.md lists them). The model math is
``kestrel_core.model.decoder``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_core.contract import StripCache
from kestrel_core.model.config import ModelConfig
from kestrel_core.wkey import PROJ_GROUPS, Proj, lm_head_wkey, wkey

PREFILL_CHUNK = 512  # tokens of one sequence the host decoder runs at once: MLP activations [T, F] stay bounded
LAYER_PROJS = tuple(p for group in PROJ_GROUPS for p in group.members)  # Q, K, V, O, GATE, UP, DOWN
PROJ_FIELDS = {Proj.Q: "q", Proj.K: "k", Proj.V: "v", Proj.O: "o", Proj.GATE: "gate", Proj.UP: "up",
               Proj.DOWN: "down"}  # the LayerWeights field of each projection
_GROUP_FIELDS = tuple(tuple(PROJ_FIELDS[p] for p in group.members) for group in PROJ_GROUPS)


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
        return getattr(self, PROJ_FIELDS[p])

    def groups(self) -> tuple[tuple[StripCache, ...], ...]:
        """The strips of each of ``PROJ_GROUPS``: (q, k, v), (o,), (gate, up), (down,)."""
        return tuple(tuple(getattr(self, name) for name in fields) for fields in _GROUP_FIELDS)


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


def engine_weights(model: Model) -> list[tuple[int, tuple[StripCache, ...]]]:
    """Every weight the decoder multiplies, grouped as it offers them on int8 activations: (wkey, strips) of
    each layer's groups (Q|K|V and gate|up under their fused wkey to ``kestrel_gemm_fused_q8``, O and down
    under their own to ``kestrel_gemm_q8``: ``ProjGroup.key``), then lm_head."""
    out = [(group.key(i), strips) for i, lw in enumerate(model.layers)
           for group, strips in zip(PROJ_GROUPS, lw.groups())]
    return out + [(lm_head_wkey(), (model.lm_head,))]
