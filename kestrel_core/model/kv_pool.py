"""The host KV cache: fixed-size blocks shared by every sequence (a page table each), and prefix caching.

A full block of prompt positions is content-addressed by its tokens and every token before it (a hash
chain), so a later sequence whose prompt starts the same way (the same system prompt, a conversation's
earlier turns sent again) attaches those blocks instead of recomputing them. That gives the very bits a
recomputation would: a row's result depends only on its tokens and position (``kernels``), and only blocks
wholly inside the prompt are shared, so their rows ran with the prompt's activation mode on both sides.
A shared block is never written again: a sequence only appends past its own length, and attaches no more
than its prompt's full blocks short of its last token. Blocks no sequence holds stay cached, oldest first
out when the pool needs room. Where a backend runs the whole steps (``Engine.device_prefixes``) the blocks are
the accounting of its pool, which holds their keys and values; the host computed none of them.

A model with recurrent layers also needs the state at the prefix's end: the pool keeps a copy of a sequence's
state where a step of its prompt ended on a whole block (``publish_prefix``'s ``keep_state``; the scheduler
ends a prompt's chunks on whole blocks, and one at its last whole block), and a prefix attaches only as far as
such a copy goes: a conversation sent again with one more turn starts from its earlier prompt's end, a long
system prompt from its last chunk's end. The copies take at most STATE_CACHE_MB, oldest first out.
"""

from __future__ import annotations

import hashlib
import math
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kestrel_core.errors import KestrelError
from kestrel_core.model.config import KV_TYPES, ModelConfig
from kestrel_core.model.paged_attention import BLOCK_MULTIPLE, KV_GROUP, padded_dims
from kestrel_core.model.state_pool import StatePool
from kestrel_core.model.validate import is_number

BLOCK_SIZE = 32  # positions per KV block
STATE_CACHE_MB = 1024  # recurrent-state copies the prefix cache keeps (Qwen3.5-9B's: 50 MiB each)
DEFAULT_KV_MB = 2048  # the host pool's default budget (at least one full context); pages are touched on use


class KVPool:
    """Host keys and values of many sequences in fixed-size blocks (a page table per sequence).

    Keys are stored transposed, ``kt`` float16 [La, blocks, KV, hd, BLOCK_SIZE], the layout the attention's
    dot products run over; values ``v`` float16 [La, blocks, KV, BLOCK_SIZE, vdp] (``ModelConfig.attention_dims``:
    a latent attention's latent and RoPE key; vdp the value dims padded to whole vectors,
    ``paged_attention.padded_dims``), over the La layers with attention (``kv_index``: model layer -> first axis);
    ``paged_attention`` writes and reads them. With ``kv_type`` "q8" they are int8 codes instead, each KV_GROUP
    dims of a key or value with a float32 scale (``ks`` [La, blocks, KV, hd/G, BLOCK_SIZE], ``vs`` [La, blocks,
    KV, BLOCK_SIZE, vdp/G]): about half the bytes. The arrays are allocated once, untouched: the OS maps a page
    only when a block is first written. A model with recurrent layers (linear attention, short convolutions, Mamba-2)
    also keeps each sequence's state (``states``).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = BLOCK_SIZE,
                 kv_type: str = "f16") -> None:
        check_kv_type(config, kv_type)
        if num_blocks < 1:
            raise KestrelError(f"the KV cache needs at least one block, got {num_blocks}")
        if block_size < 1 or block_size % BLOCK_MULTIPLE:
            raise KestrelError(f"a KV block holds a multiple of {BLOCK_MULTIPLE} positions, got {block_size}")
        c = config
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_type = kv_type
        self.kv_index = {layer: j for j, layer in enumerate(c.attention_layers)}
        layers = len(self.kv_index)
        kv_heads, key_dims, value_dims = c.attention_dims
        vdp = padded_dims(value_dims)
        dtype = np.int8 if kv_type == "q8" else np.float16
        self.kt = np.empty((layers, num_blocks, kv_heads, key_dims, block_size), dtype)
        self.v = np.empty((layers, num_blocks, kv_heads, block_size, vdp), dtype)
        if kv_type == "q8":
            self.ks = np.empty((layers, num_blocks, kv_heads, key_dims // KV_GROUP, block_size), np.float32)
            self.vs = np.empty((layers, num_blocks, kv_heads, block_size, vdp // KV_GROUP), np.float32)
        else:
            self.ks = self.vs = np.zeros((layers, 0, 0, 0, 0), np.float32)
        self.states = StatePool(c) if c.state_layers else None
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the most recently freed block first
        self._refs = [0] * num_blocks  # sequences holding each block
        self._prefix: dict[bytes, int] = {}  # chain hash of a full prompt block -> the block holding it
        self._hash_of: dict[int, bytes] = {}  # the reverse, for cached blocks
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, oldest first
        # the recurrent state at the end of a cached prefix: chain hash of its last block -> StatePool.snapshot
        self._states: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        self.prefix_hit_tokens = 0  # positions sequences attached instead of computing, on their first admission
        self.evictions = 0  # cached blocks given to other sequences

    @classmethod
    def for_budget(cls, config: ModelConfig, megabytes: float | None = None, kv_type: str = "f16") -> KVPool:
        """A pool of ``megabytes`` (``budget_blocks``)."""
        return cls(config, cls.budget_blocks(config, megabytes, kv_type), kv_type=kv_type)

    def layer_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Model layer ``layer``'s keys, values and their scales as ``paged_attention`` takes them: float16 as its
        bit patterns (numba has no float16) beside empty scales, or int8 codes and their scales."""
        j = self.kv_index[layer]
        kt, v = (self.kt[j], self.v[j]) if self.kv_type == "q8" else (self.kt[j].view(np.uint16),
                                                                       self.v[j].view(np.uint16))
        return kt, v, self.ks[j], self.vs[j]

    @staticmethod
    def budget_blocks(config: ModelConfig, megabytes: float | None = None, kv_type: str = "f16") -> int:
        """The blocks of a pool of ``megabytes`` (default: DEFAULT_KV_MB, and at least one sequence at the full
        context where half the machine's memory holds it: a context of 2^20, as llama.cpp writes for Granite
        4.0-H, would ask for tens of GiB the OS refuses at once)."""
        per_block = max(bytes_per_position(config, kv_type), 1) * BLOCK_SIZE
        if megabytes is None:
            full = min(-(-config.max_position // BLOCK_SIZE), _memory_bytes() // 2 // per_block)
            blocks = max(int(DEFAULT_KV_MB * 2 ** 20 // per_block), full)
        else:
            if not is_number(megabytes) or not megabytes > 0 or not math.isfinite(megabytes):
                raise KestrelError(f"the KV cache size must be a number of MB > 0, got {megabytes!r}")
            if megabytes * 2 ** 20 > _memory_bytes():
                raise KestrelError(f"a KV cache of {megabytes:g} MB is more than this machine's memory "
                                   f"({_memory_bytes() / 2 ** 20:.0f} MB)")
            blocks = int(megabytes * 2 ** 20 // per_block)
            if blocks < 1:
                raise KestrelError(f"a KV cache of {megabytes} MB holds no block of {BLOCK_SIZE} positions "
                                   f"({per_block / 2 ** 20:.2f} MB each)")
        return blocks

    @staticmethod
    def budget_for(config: ModelConfig, positions: int, kv_type: str = "f16") -> float:
        """The budget (MB) of a pool of ``config``'s that holds ``positions`` positions (a block over, for the
        rounding of MB to blocks), or the machine's memory where that is less: the most a budget may be."""
        per_block = max(bytes_per_position(config, kv_type), 1) * BLOCK_SIZE
        return min((-(-positions // BLOCK_SIZE) + 1) * per_block, _memory_bytes() >> 20 << 20) / 2 ** 20

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take: free ones, and cached ones no sequence holds."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def cached_states(self) -> int:
        return len(self._states)

    @property
    def capacity(self) -> int:
        """Positions the whole pool holds."""
        return self.num_blocks * self.block_size

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def new_sequence(self) -> SeqCache:
        return SeqCache(self)

    def reserve(self, seq: SeqCache, positions: int) -> bool:
        """Blocks for ``positions`` positions of ``seq``; False (and nothing taken) if the pool lacks them."""
        need = self.blocks_for(positions) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        for _ in range(need):
            seq.blocks.append(self._take())
        return True

    def release(self, seq: SeqCache) -> None:
        self.give_back(seq.blocks, seq.state)
        seq.length = 0

    def state_slot(self, seq: SeqCache) -> int:
        """The recurrent-state slot of ``seq`` (a model with recurrent layers), taken zeroed on first use."""
        if not seq.state:
            assert self.states is not None
            seq.state.append(self.states.take())
        return seq.state[0]

    def give_back(self, blocks: list[int], state: list[int] | None = None) -> None:
        """A sequence lets go of ``blocks`` and its recurrent-state slot ``state`` (both emptied): cached blocks
        stay cached, the others are free again."""
        if state:
            assert self.states is not None
            self.states.give_back(state.pop())
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)
        blocks.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the oldest cached block no sequence holds
            block, _ = self._idle.popitem(last=False)
            chain = self._hash_of.pop(block)
            del self._prefix[chain]
            self._states.pop(chain, None)
            self.evictions += 1
        self._refs[block] = 1
        return block

    # -- prefix caching ------------------------------------------------------------------------------

    def attach_prefix(self, seq: SeqCache, tokens: Sequence[int], limit: int, resumed: bool = False) -> int:
        """Attach to the empty ``seq`` the cached blocks of the longest prefix of ``tokens`` made of full blocks
        within the first ``limit`` positions (for a model with recurrent layers, the longest whose end state was
        kept, which becomes its state); its length becomes that prefix's (returned). They count as prefix-cache
        hits unless ``resumed``: a preempted request's, which mostly finds the blocks it computed itself (vLLM
        leaves those out of its hits too)."""
        if seq.blocks or seq.length:
            raise KestrelError("a prefix attaches only to an empty sequence")
        bs = self.block_size
        ids = np.asarray(tokens[:max(limit, 0) // bs * bs], np.int64)
        chain, found, ends = b"", [], 0  # ends: blocks of the longest prefix that can be attached
        for start in range(0, len(ids), bs):
            chain = _link(chain, ids[start:start + bs])
            block = self._prefix.get(chain)
            if block is None:
                break
            found.append(block)
            if self.states is None or chain in self._states:
                ends = len(found)
                state = chain
        for block in found[:ends]:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
            seq.blocks.append(block)
        if ends and self.states is not None:
            self._states.move_to_end(state)
            self.states.restore(self.state_slot(seq), self._states[state])
        seq.length = ends * bs
        if not resumed:
            self.prefix_hit_tokens += seq.length
        return seq.length

    def publish_prefix(self, seq: SeqCache, tokens: Sequence[int], written: int, keep_state: bool = False) -> None:
        """Make the full blocks of ``seq``'s first ``written`` positions (computed, and its prompt's) reusable,
        keyed by ``tokens`` (the sequence's tokens, position = index). A prefix another sequence published
        first keeps that one's block. With ``keep_state`` (``written`` whole blocks, where ``seq``'s step
        ended), a copy of its recurrent state is kept as that prefix's end; the oldest copies go past
        STATE_CACHE_MB."""
        bs = self.block_size
        full = min(written, len(tokens)) // bs
        ids = np.asarray(tokens[:full * bs], np.int64)
        chain = b""
        for i in range(full):
            chain = _link(chain, ids[i * bs:(i + 1) * bs])
            block = seq.blocks[i]
            if block in self._hash_of or chain in self._prefix:
                continue
            self._prefix[chain] = block
            self._hash_of[block] = chain
        if keep_state and self.states is not None and full and full * bs == written and chain not in self._states:
            self._states[chain] = self.states.snapshot(self.state_slot(seq))
            while len(self._states) > max(1, int(STATE_CACHE_MB * 2 ** 20 // max(self.states.bytes_per_sequence, 1))):
                self._states.popitem(last=False)


def _memory_bytes() -> int:
    """The machine's physical memory (where the OS does not say: as if it were unbounded)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _link(chain: bytes, block_tokens: np.ndarray) -> bytes:
    """The hash of a block of tokens after the blocks ``chain`` hashes."""
    return hashlib.blake2b(chain + block_tokens.tobytes(), digest_size=16).digest()


def bytes_per_position(config: ModelConfig, kv_type: str = "f16") -> int:
    """Host KV bytes one position takes over the layers with attention (keys and padded values, as ``kv_type``)."""
    kv_heads, key_dims, value_dims = config.attention_dims
    dims = key_dims + padded_dims(value_dims)
    per_dim = 1 + 4 / KV_GROUP if kv_type == "q8" else 2
    return int(len(config.attention_layers) * kv_heads * dims * per_dim)


def check_kv_type(config: ModelConfig, kv_type: str) -> None:
    """Raise unless the pool can hold ``config``'s keys and values as ``kv_type`` (``KV_TYPES``)."""
    if kv_type not in KV_TYPES:
        raise KestrelError(f"unknown KV cache type {kv_type!r}: one of {', '.join(KV_TYPES)}")
    _, key_dims, value_dims = config.attention_dims
    if kv_type == "q8" and (key_dims % KV_GROUP or padded_dims(value_dims) % KV_GROUP):
        raise KestrelError(f"an int8 KV cache quantizes blocks of {KV_GROUP} dims; this model's keys have {key_dims} "
                           f"and its values {value_dims}: use the float16 cache (--kv-cache-type f16)")


class SeqCache:
    """One sequence's page table in a ``KVPool``: ``length`` positions written. Its blocks go back to the
    pool on ``release()`` (or when it is garbage-collected)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.state: list[int] = []  # its recurrent-state slot in pool.states, once a recurrent layer ran (0 or 1)
        self.length = 0
        self.prompt_len = 0  # positions below it are the prompt (float32 activations in "mixed" mode)
        self._finalizer = weakref.finalize(self, pool.give_back, self.blocks, self.state)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def truncate(self, n: int) -> None:
        """Forget positions from ``n`` on (their blocks stay reserved). Not into an attached prefix, whose
        blocks other sequences read, nor at all where a recurrent state holds every position."""
        if n < self.length and self.state:
            raise KestrelError("cannot truncate a sequence of a model with recurrent layers (linear attention, "
                               "short convolutions, Mamba-2): its state holds every position")
        if n < self.length and n < self._shared_positions():
            raise KestrelError(f"cannot truncate to {n}: positions below {self._shared_positions()} are a "
                               "shared prefix")
        self.length = min(self.length, n)

    def _shared_positions(self) -> int:
        """Positions in blocks at the start of this sequence that are cached (others may hold them)."""
        n = 0
        for block in self.blocks:
            if block not in self.pool._hash_of:
                break
            n += self.pool.block_size
        return n

    def release(self) -> None:
        self.pool.release(self)
