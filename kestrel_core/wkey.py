"""Weight identity: ``wkey = (layer << 32) | (expert + 1) << 16 | (proj + 1)``, and which projections share
one fused GEMM.

The +1s keep wkey 0 free for "do not cache" and expert field 0 for "not an expert" (a dense projection's wkey
is ``(layer << 32) | (proj + 1)``); the layer stays verbatim in the high 32 bits so that a residency window
can decode it, experts included. lm_head and fused weights live on sentinel layers above every real layer.
"""

from __future__ import annotations

from enum import IntEnum

NO_CACHE = 0
LM_HEAD_LAYER = 0xFFFF_FFFF
FUSED_LAYER_BASE = 0x8000_0000  # fused weights of layer L use sentinel layer FUSED_LAYER_BASE + L


class Proj(IntEnum):
    Q = 0
    K = 1
    V = 2
    O = 3  # noqa: E741
    GATE = 4
    UP = 5
    DOWN = 6
    LM_HEAD = 7
    EMBED = 8
    QKV = 9  # fused Q|K|V
    GATE_UP = 10  # fused gate|up
    ATTN_GATE = 11  # gated attention (Qwen3.5): sigmoid(x . W) scales the attention's output
    QKV_GATE = 12  # fused Q|K|V|ATTN_GATE
    LIN_QKV = 13  # a linear-attention layer's q|k|v, before its convolution
    LIN_Z = 14  # its output gate
    LIN_BETA = 15  # its delta rule's step size, per value head
    LIN_ALPHA = 16  # its decay's input, per value head
    LIN_IN = 17  # fused LIN_QKV|LIN_Z|LIN_BETA|LIN_ALPHA (its output projection is O)
    CONV_IN = 18  # a short-convolution layer's B|C|x (LFM2; its output projection is O)
    MAMBA_IN = 19  # a Mamba-2 layer's z|x|B|C|dt (Granite 4.0-H; its output projection is O)
    Q_A = 20  # multi-head latent attention (DeepSeek-V2/V3): the query's low-rank down projection
    KV_A = 21  # the keys' and values' latent, then the shared RoPE key
    MLA_IN = 22  # fused Q_A|KV_A, or Q|KV_A where the query has no low rank
    Q_B = 23  # the query's up projection from the normed Q_A
    KV_B = 24  # each head's key (its part without RoPE) and value from the latent: absorbed by the host, not a GEMM


MAX_EXPERT = 0xFFFE


def wkey(layer: int, proj: Proj | int, expert: int | None = None) -> int:
    """The wkey of ``proj`` in ``layer`` (of expert ``expert`` in a mixture-of-experts layer)."""
    if not 0 <= layer <= 0xFFFF_FFFF:
        raise ValueError(f"layer {layer} does not fit in 32 bits")
    if expert is None:
        return (layer << 32) | (int(proj) + 1)
    if not 0 <= expert <= MAX_EXPERT:
        raise ValueError(f"expert {expert} does not fit in 16 bits")
    return (layer << 32) | ((expert + 1) << 16) | (int(proj) + 1)


def decode_wkey(key: int) -> tuple[int, Proj]:
    """(layer, proj) of a wkey (an expert's too: ``wkey_expert`` says which); raises on wkey 0."""
    if key == NO_CACHE:
        raise ValueError("wkey 0 means 'do not cache' and names no weight")
    return key >> 32, Proj((key & 0xFFFF) - 1)


def wkey_expert(key: int) -> int | None:
    """The expert a wkey belongs to; None for a dense weight."""
    field = (key >> 16) & 0xFFFF
    return field - 1 if field else None


def lm_head_wkey() -> int:
    return wkey(LM_HEAD_LAYER, Proj.LM_HEAD)


def fused_wkey(layer: int, proj: Proj, expert: int | None = None) -> int:
    return wkey(FUSED_LAYER_BASE + layer, proj, expert)


def is_sentinel_layer(layer: int) -> bool:
    return layer >= FUSED_LAYER_BASE


def model_layer(layer: int) -> int | None:
    """The model layer a (possibly fused) weight belongs to; None for lm_head."""
    if layer == LM_HEAD_LAYER:
        return None
    return layer - FUSED_LAYER_BASE if layer >= FUSED_LAYER_BASE else layer


class ProjGroup:
    """Projections of a layer that read the same input, so one fused GEMM may compute them all.

    ``fused`` names the fused weight (its wkey is ``fused_wkey(layer, fused)``); None for a group of one. A
    plain class: ``kestrel_core`` imports this module first thing, and dataclasses would pull in inspect.
    """

    __slots__ = ("members", "fused")

    def __init__(self, members: tuple[Proj, ...], fused: Proj | None = None) -> None:
        self.members = members
        self.fused = fused

    def __repr__(self) -> str:
        return f"ProjGroup({'|'.join(p.name for p in self.members)})"

    def keys(self, layer: int, expert: int | None = None) -> tuple[int, ...]:
        """Each member's wkey."""
        return tuple(wkey(layer, p, expert) for p in self.members)

    def fused_key(self, layer: int, expert: int | None = None) -> int:
        """The fused weight's wkey; NO_CACHE for a group of one."""
        return NO_CACHE if self.fused is None else fused_wkey(layer, self.fused, expert)

    def key(self, layer: int, expert: int | None = None) -> int:
        """The wkey the decoder offers the whole group under: the fused weight's, or its one member's."""
        return self.keys(layer, expert)[0] if self.fused is None else fused_wkey(layer, self.fused, expert)


# A layer's projections in execution order, grouped by input: Q|K|V (the attention input), O, gate|up (the
# MLP input), down. Every fused offer (kestrel_gemm_fused_q8, a device's fused weights) follows these groups, or a
# hybrid layer's token mixer's below (weights.LayerWeights.proj_groups says which a layer has).
PROJ_GROUPS = (
    ProjGroup((Proj.Q, Proj.K, Proj.V), Proj.QKV),
    ProjGroup((Proj.O,)),
    ProjGroup((Proj.GATE, Proj.UP), Proj.GATE_UP),
    ProjGroup((Proj.DOWN,)),
)
ATTENTION_GROUPS = PROJ_GROUPS[:2]
MLP_GROUPS = PROJ_GROUPS[2:]  # a dense layer's MLP, or each expert's (under the expert's wkeys)
# the token mixer of a gated attention layer (Qwen3.5): its output gate reads the attention's input
GATED_ATTENTION_GROUPS = (ProjGroup((Proj.Q, Proj.K, Proj.V, Proj.ATTN_GATE), Proj.QKV_GATE), PROJ_GROUPS[1])
# the token mixer of a linear-attention layer (Gated DeltaNet): its four input projections, then O
LINEAR_GROUPS = (ProjGroup((Proj.LIN_QKV, Proj.LIN_Z, Proj.LIN_BETA, Proj.LIN_ALPHA), Proj.LIN_IN), PROJ_GROUPS[1])
# the token mixer of a short-convolution layer (LFM2): its input projection, then O
CONV_GROUPS = (ProjGroup((Proj.CONV_IN,)), PROJ_GROUPS[1])
# the token mixer of a Mamba-2 layer (Granite 4.0-H): its input projection, then O
MAMBA_GROUPS = (ProjGroup((Proj.MAMBA_IN,)), PROJ_GROUPS[1])
# multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): the query's down projection and the latent from the
# layer's input, the query's up projection, then O (KV_B is absorbed into the query and the output on the host:
# decoder._latent_attention); without a low-rank query (DeepSeek-V2-Lite) Q reads the layer's input beside the latent
MLA_GROUPS = (ProjGroup((Proj.Q_A, Proj.KV_A), Proj.MLA_IN), ProjGroup((Proj.Q_B,)), PROJ_GROUPS[1])
MLA_DIRECT_GROUPS = (ProjGroup((Proj.Q, Proj.KV_A), Proj.MLA_IN), PROJ_GROUPS[1])
