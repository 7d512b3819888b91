"""Longest-shared-prefix index: one compressed radix tree over token ids per namespace.

Query: given a namespace and a token list, the row of that namespace sharing the longest
prefix with it, at any length (not only stride multiples), ties to the row with the fewest
bytes (then the smallest key, so answers are deterministic). Cost is O(len(tokens)) for
encoding the query plus one memcmp-backed comparison per tree node on the path; it does not
depend on the number of rows.

Structure. Each node holds ``edge``: the tokens from its parent's end to its own end, as native
u32 ``bytes`` (4 bytes a token, compared with memcmp, never one Python int per token). A row ends
exactly at one node (``row``), and every node records ``best``: the (bytes, key) minimum over all
rows in its subtree, kept up to date on insert (min along the path) and on removal (recomputed
upwards only while the removed row was the best). If the query walk stops after fully matching
node ``N`` every row under ``N`` shares exactly ``depth(N)`` tokens and every other row fewer; if
it stops part-way into child ``C``'s edge, every row under ``C`` shares exactly the matched
length. Either way the answer is one node's ``best``.

Tokens are stored once: a row's tokens are the concatenation of the edges on its root path
(``tokens(key)`` rebuilds them), so rows sharing a system prompt share its bytes.

Concurrency invariant: all mutation happens under the owner's lock (``Index``), but ``longest``
runs without it. Writers therefore never change an edge in place: splitting or merging builds
new nodes and publishes them with one dict assignment, so a reader holding an old node still
sees a consistent (if slightly stale) subtree. Any row a reader reports had, at some moment,
tokens starting with the matched path: the match is always token-exact.

Memory: per row at most two nodes (its own and one split point) of ~150 bytes each including
the edge ``bytes`` header, plus a children dict (~230 bytes) at branching nodes, plus 4 bytes
per token not shared with another row. ``bench/prefix_lookup.py`` measures it.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import Literal

__all__ = ["PrefixIndex", "encode_native"]

_CODE = next(c for c in ("I", "L") if array(c).itemsize == 4)

_Best = tuple[int, bytes]  # (size in bytes, key): tuple order is the tie-break order


def encode_native(tokens: Sequence[int]) -> array[int]:
    """Tokens as a native-endian u32 array; ``ValueError`` outside 0..2^32-1."""
    if isinstance(tokens, array) and tokens.typecode == _CODE:
        return tokens
    try:
        return array(_CODE, tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens must be ints in 0..2^32-1: {exc}") from None


class _Node:
    __slots__ = ("best", "children", "edge", "parent", "row")

    def __init__(
        self,
        edge: bytes,
        parent: _Node | None,
        children: dict[int, _Node] | None,
        row: _Best | None,
        best: _Best | None,
    ) -> None:
        self.edge = edge
        self.parent = parent
        self.children = children
        self.row = row
        self.best = best

    def first_token(self) -> int:
        return int.from_bytes(self.edge[:4], _BYTEORDER)


_BYTEORDER: Literal["little", "big"] = "little" if array(_CODE, [1]).tobytes()[0] == 1 else "big"


def _common_tokens(edge: bytes, query: bytes, start: int) -> int:
    """Number of leading tokens ``edge`` shares with ``query[start:]`` (both native u32)."""
    n = min(len(edge), len(query) - start) // 4
    if query[start : start + 4 * n] == edge[: 4 * n]:
        return n
    lo, hi = 0, n  # invariant: first lo tokens equal, first hi tokens differ somewhere
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if query[start : start + 4 * mid] == edge[: 4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _min_best(node: _Node) -> _Best | None:
    best = node.row
    if node.children:
        for child in node.children.values():
            b = child.best
            if b is not None and (best is None or b < best):
                best = b
    return best


class PrefixIndex:
    """Radix trees keyed by namespace. Not thread-safe for writers: the caller serialises
    ``insert``/``remove``; ``longest``/``tokens``/``__contains__`` may run concurrently."""

    __slots__ = ("_node_of", "_ns_of_root", "_roots", "version")

    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        self._ns_of_root: dict[int, Hashable] = {}  # id(root) -> namespace, to drop empty trees
        self._node_of: dict[bytes, _Node] = {}
        # Seqlock: odd while a mutation is under way. A lock-free reader that sees it odd, or
        # changed across its walk, may have walked a node a split or merge just replaced.
        self.version = 0

    def __len__(self) -> int:
        return len(self._node_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._node_of

    def insert(self, namespace: Hashable, key: bytes, tokens: Sequence[int], size: int) -> None:
        """Add a row. Re-inserting a key replaces it (and may move it)."""
        self.version += 1
        try:
            self._insert(namespace, key, tokens, size)
        finally:
            self.version += 1

    def _insert(self, namespace: Hashable, key: bytes, tokens: Sequence[int], size: int) -> None:
        if key in self._node_of:
            self.remove(key)
        arr = encode_native(tokens)
        enc = arr.tobytes()
        entry: _Best = (size, key)
        root = self._roots.get(namespace)
        if root is None:
            root = _Node(b"", None, None, None, None)
            self._roots[namespace] = root
            self._ns_of_root[id(root)] = namespace
        node = root
        pos = 0
        n = len(arr)
        path = [root]
        while pos < n:
            t = arr[pos]
            child = node.children.get(t) if node.children else None
            if child is None:
                leaf = _Node(enc[4 * pos :], node, None, entry, entry)
                self._node_of[key] = leaf
                if node.children is None:
                    node.children = {t: leaf}
                else:
                    node.children[t] = leaf
                break
            k = _common_tokens(child.edge, enc, 4 * pos)
            if 4 * k < len(child.edge):
                child = self._split(node, t, child, k)
            node = child
            pos += k
            path.append(node)
        else:
            # The row ends exactly at an existing (or freshly split) node.
            if node.row is not None:
                # Same namespace and tokens always give the same key; two keys here is a bug.
                raise ValueError("two keys for one (namespace, tokens)")
            node.row = entry
            self._node_of[key] = node
        for p in path:
            if p.best is None or entry < p.best:
                p.best = entry

    def _split(self, parent: _Node, t: int, child: _Node, k: int) -> _Node:
        """Replace ``child`` by ``mid`` (first k tokens) -> ``tail`` (the rest). Copy on write:
        ``child`` itself is left intact for readers already holding it."""
        tail = _Node(child.edge[4 * k :], None, child.children, child.row, child.best)
        mid = _Node(child.edge[: 4 * k], parent, {tail.first_token(): tail}, None, child.best)
        tail.parent = mid
        if tail.children:
            for c in tail.children.values():
                c.parent = tail
        if child.row is not None:
            self._node_of[child.row[1]] = tail
        assert parent.children is not None
        parent.children[t] = mid  # the publish step: one atomic dict store
        return mid

    def remove(self, key: bytes) -> bool:
        """Drop a row; False if unknown. Keeps the tree compressed (no row-less unary nodes)."""
        self.version += 1
        try:
            return self._remove(key)
        finally:
            self.version += 1

    def _remove(self, key: bytes) -> bool:
        node = self._node_of.pop(key, None)
        if node is None:
            return False
        removed = node.row
        node.row = None
        cur = node
        parent = cur.parent
        if parent is not None and not cur.children:
            # A row-less leaf disappears; its parent may now be a row-less unary node.
            assert parent.children is not None
            del parent.children[cur.first_token()]
            if not parent.children:
                parent.children = None
            cur = parent
        if cur.parent is not None and cur.row is None and cur.children and len(cur.children) == 1:
            cur = self._merge(cur)
            assert cur.parent is not None
            start = cur.parent
        else:
            start = cur
        # Only nodes whose best was the removed row can change: an ancestor's best is a min over
        # a superset, so once a node's best is something else, everything above is unaffected.
        n: _Node | None = start
        while n is not None and n.best is not None and n.best == removed:
            n.best = _min_best(n)
            n = n.parent
        root = start
        while root.parent is not None:
            root = root.parent
        if root.row is None and not root.children:
            ns = self._ns_of_root.pop(id(root))
            del self._roots[ns]
        return True

    def _merge(self, node: _Node) -> _Node:
        """Fuse a row-less unary non-root ``node`` with its only child (copy on write)."""
        assert node.children is not None and node.parent is not None
        (only,) = node.children.values()
        merged = _Node(node.edge + only.edge, node.parent, only.children, only.row, only.best)
        if merged.children:
            for c in merged.children.values():
                c.parent = merged
        if only.row is not None:
            self._node_of[only.row[1]] = merged
        assert node.parent.children is not None
        node.parent.children[node.first_token()] = merged
        return merged

    def longest(
        self, namespace: Hashable, tokens: Sequence[int], min_shared: int = 1
    ) -> tuple[bytes, int] | None:
        """(key, n_shared) of the best row, or None if no row shares ``min_shared`` tokens."""
        root = self._roots.get(namespace)
        if root is None:
            return None
        arr = encode_native(tokens)
        enc = arr.tobytes()
        n = len(arr)
        node = root
        pos = 0
        best = None
        while True:
            children = node.children
            child = children.get(arr[pos]) if children and pos < n else None
            if child is None:
                best = node.best
                break
            edge = child.edge
            k = _common_tokens(edge, enc, 4 * pos)
            if 4 * k < len(edge):
                best = child.best
                pos += k
                break
            node = child
            pos += k
        if best is None or pos < max(min_shared, 0):
            return None
        return best[1], pos

    def whole(
        self, namespace: Hashable, tokens: Sequence[int], limit: int
    ) -> list[tuple[bytes, int]]:
        """(key, n_tokens) of up to ``limit`` rows whose tokens are all a prefix of
        ``tokens``, longest first. A state that cannot be trimmed (``kvwarm.memory``) is
        usable only whole, and the longest such row may still be of no use (deterministic
        mode reuses only its aligned canonical part), so the caller weighs several."""
        root = self._roots.get(namespace)
        if root is None:
            return []
        arr = encode_native(tokens)
        enc = arr.tobytes()
        n = len(arr)
        node = root
        pos = 0
        found: list[tuple[bytes, int]] = []
        while pos < n:
            children = node.children
            child = children.get(arr[pos]) if children else None
            if child is None:
                break
            k = _common_tokens(child.edge, enc, 4 * pos)
            if 4 * k < len(child.edge):
                break
            node = child
            pos += k
            if node.row is not None:
                found.append((node.row[1], pos))
        return found[::-1][:limit]

    def lineage(self, key: bytes) -> list[tuple[bytes, bool]]:
        """The rows whose tokens are a prefix of ``key``'s, nearest first, each with whether
        a row outside that path also extends it (another conversation goes on from it: a
        branch below it). Rows extending ``key`` itself do not count: they are its own."""
        node = self._node_of.get(key)
        if node is None:
            return []
        out: list[tuple[bytes, bool]] = []
        branched = False
        cur = node.parent
        while cur is not None:
            # A node with a second child has rows off this path below it (every leaf of a
            # compressed tree is a row), and so has every node above it.
            branched = branched or bool(cur.children and len(cur.children) > 1)
            if cur.row is not None:
                out.append((cur.row[1], branched))
            cur = cur.parent
        return out

    def below(self, key: bytes) -> int:
        """How many rows extend ``key`` along one path (0 when none does; counted until the
        rows branch, where every row above is extended by two conversations anyway)."""
        node = self._node_of.get(key)
        n = 0
        while node is not None and node.children and len(node.children) == 1:
            (node,) = node.children.values()
            n += node.row is not None
        return n

    def tokens(self, key: bytes) -> tuple[int, ...] | None:
        """The row's tokens, rebuilt from its root path; None if unknown."""
        node = self._node_of.get(key)
        if node is None:
            return None
        parts: list[bytes] = []
        cur: _Node | None = node
        while cur is not None:
            parts.append(cur.edge)
            cur = cur.parent
        parts.reverse()
        out = array(_CODE)
        out.frombytes(b"".join(parts))
        return tuple(out)
