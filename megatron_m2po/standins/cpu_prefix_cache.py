"""The CPU worker's prefix cache: KV of token prefixes kept across requests, as SGLang 0.5.23's
radix cache keeps them (``srt/mem_cache/radix_cache.py``).

What it follows from SGLang (page size 1):

- A radix tree over token ids; each node holds the KV of its edge's tokens (here per layer,
  ``[kv_heads, n, head_dim]`` keys and values). ``match`` returns the longest cached prefix and
  splits a node when the match ends inside its edge (``match_prefix`` / ``_split_node``).
- A request matches at most ``len(context) - 1`` tokens (the last one is always computed, for its
  logits) and, when it asks for prompt log-probs, at most ``logprob_start_len``
  (``schedule_batch.py`` ``Req._compute_max_prefix_len``).
- After its prefill a request's whole context (prompt, plus the output of a retracted request) is
  inserted (``cache_unfinished_req`` / ``checkpoint``); only the part the tree lacks is stored.
- Entries are evicted least-recently-used leaf first when the tree holds more than its budget
  (``evict`` with the default LRU strategy).
- ``reset`` drops everything (``RadixCache.reset``, called by ``Scheduler.flush_cache``). Nothing
  else invalidates an entry: a weight update that does not flush leaves the KV the old weights
  computed in the tree, and later requests sharing the prefix reuse it, as in SGLang.

- A finished request's prompt and output (all but the last sampled token, whose KV was never
  computed) are inserted when it finishes (``mem_cache/common.py`` ``release_kv_cache`` with
  ``checkpoint``), so a multi-turn request that re-sends the conversation so far finds the previous
  turn cached (``cpu_worker.py`` ``_cache_finished``); aborted requests are not kept.

- Namespaces: a request's ``extra_key`` (its LoRA adapter's ``lora_id``; ``schedule_batch.py``
  ``Req.__init__`` appends it to ``extra_key``, and ``RadixKey.child_key`` namespaces the tree's
  children by it) keeps KV computed under one adapter away from every other adapter and from the
  base model. ``match`` / ``insert`` take it as ``key`` (None: the base model); each key has its
  own root here, all under one budget.

Departure: the budget is in bytes of KV rather than a fraction of GPU memory.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, n, head_dim]


class _Node:
    __slots__ = ("key", "kv", "children", "parent", "last_access")

    def __init__(self, key: tuple, kv: KV, parent: Optional["_Node"]) -> None:
        self.key, self.kv, self.parent = key, kv, parent
        self.children: dict[int, _Node] = {}
        self.last_access = 0

    def leaves(self) -> list["_Node"]:
        """The nodes below this one that have no children: what eviction may drop."""
        out, stack = [], list(self.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out


def _slice(kv: KV, a: int, b: Optional[int] = None) -> KV:
    return [(k[:, a:b], v[:, a:b]) for k, v in kv]


def _clone(kv: KV) -> KV:
    return [(k.clone(), v.clone()) for k, v in kv]


def _common(key: tuple, tokens: Sequence[int], start: int, stop: int) -> int:
    n = 0
    for a, b in zip(key, itertools.islice(tokens, start, stop)):
        if a != b:
            break
        n += 1
    return n


class PrefixCache:
    """Radix tree of prefix KV with an LRU byte budget (``max_bytes``; 0 disables the cache).

    Example::

        cache = PrefixCache(64 << 20)
        n, kv = cache.match(ctx, limit=len(ctx) - 1)   # kv: per layer [H, n, D] or None
        ...                                              # prefill ctx[n:] on top of kv
        cache.insert(ctx, kv_of_ctx_from_n, start=n)     # after the prefill
        cache.evict()                                    # once per scheduler step
        cache.reset()                                    # /flush_cache
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache budget {max_bytes} bytes: must be >= 0 (0 disables it)")
        self.max_bytes = int(max_bytes)
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.roots: dict[Optional[str], _Node] = {}
        self.bytes = 0
        self.tokens = 0

    @property
    def root(self) -> _Node:
        """The base model's root (namespace None)."""
        return self._root(None)

    def _root(self, key: Optional[str]) -> _Node:
        node = self.roots.get(key)
        if node is None:
            node = self.roots[key] = _Node((), [], None)
        return node

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper node (radix_cache.py _split_node)."""
        # Copies, so that evicting either half frees its memory (the byte count stays true).
        upper = _Node(node.key[:at], _clone(_slice(node.kv, 0, at)), node.parent)
        upper.last_access = node.last_access
        node.parent.children[node.key[0]] = upper
        node.key, node.kv, node.parent = node.key[at:], _clone(_slice(node.kv, at)), upper
        upper.children[node.key[0]] = node
        return upper

    def _walk(self, tokens: Sequence[int], limit: int, key: Optional[str]) -> tuple[_Node, int, list[_Node]]:
        """The deepest node of namespace ``key`` whose path is a prefix of ``tokens[:limit]``
        (splitting at the end)."""
        node, i, path = self._root(key), 0, []
        now = next(self._clock)
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            c = _common(child.key, tokens, i, limit)
            if c < len(child.key):
                child = self._split(child, c)
            child.last_access = now
            path.append(child)
            node, i = child, i + c
        return node, i, path

    def match(self, tokens: Sequence[int], limit: int, key: Optional[str] = None) -> tuple[int, Optional[KV]]:
        """The longest cached prefix of ``tokens[:limit]`` in namespace ``key``: (length, per-layer
        KV) or (0, None)."""
        root = self.roots.get(key)
        if self.max_bytes == 0 or limit <= 0 or root is None or not root.children:
            return 0, None
        _, n, path = self._walk(tokens, limit, key)
        if n == 0:
            return 0, None
        if len(path) == 1:
            return n, list(path[0].kv)
        return n, [(torch.cat([p.kv[j][0] for p in path], 1), torch.cat([p.kv[j][1] for p in path], 1))
                   for j in range(len(path[0].kv))]

    def insert(self, tokens: Sequence[int], kv: KV, start: int, key: Optional[str] = None) -> None:
        """Store the KV of ``tokens`` the tree of namespace ``key`` lacks; ``kv`` covers
        ``tokens[start:]`` (the prefix before ``start`` was matched in this scheduler step, and
        nothing is evicted within a step)."""
        if self.max_bytes == 0 or start >= len(tokens):
            return
        node, m, _ = self._walk(tokens, len(tokens), key)
        if m < start or m == len(tokens):
            return  # an earlier insert of this step already holds it (m >= start), or nothing to add
        # Copies: the slices are views of a batch's KV, which must not stay alive through the tree.
        leaf = _Node(tuple(tokens[m:]), _clone(_slice(kv, m - start)), node)
        leaf.last_access = next(self._clock)
        node.children[leaf.key[0]] = leaf
        self.tokens += len(leaf.key)
        self.bytes += sum(k.nbytes + v.nbytes for k, v in leaf.kv)

    def evict(self) -> int:
        """Drop least-recently-used leaves until the budget holds; returns the tokens evicted."""
        evicted = 0
        while self.bytes > self.max_bytes:
            leaves = [leaf for root in self.roots.values() for leaf in root.leaves()]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_access):
                if self.bytes <= self.max_bytes:
                    break
                del leaf.parent.children[leaf.key[0]]
                self.bytes -= sum(k.nbytes + v.nbytes for k, v in leaf.kv)
                self.tokens -= len(leaf.key)
                evicted += len(leaf.key)
        return evicted
