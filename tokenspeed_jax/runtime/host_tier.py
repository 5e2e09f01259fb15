"""`HostKVPool`: the device side of the host KV tier (issue 49; `scheduler.host_tier` decides).

The host pool is one numpy array per cache leaf (K, V, scales, conv and recurrent-state pools),
the leaf's page axis sized to the host tier's pages. A step's `PageCopies` run as one small
jitted program before the step, on the same device queue:

    copy(caches, loads, save_pages, load_pages) -> (caches', saved)
      saved  = every leaf's pages `save_pages`    (read first: a saved page may be loaded into)
      caches' = every leaf with `loads` written at `load_pages` (mode="drop": padding is dropped)

`caches` is donated and the step that follows reads `caches'`, so the copies sit between the
previous step's writes and this step's reads without any host wait. `loads` are gathered from
the numpy pool when the step is dispatched; `saved` comes back asynchronously and is written
into the numpy pool when a step is collected (`flush`), or before a later step gathers loads.
The scheduler never loads a host page in the step that saves into it (a save joins the host
index only when its step is emitted), and a host page freed by a load may take a save of the
same step: the load was gathered at dispatch, the save lands later.

Every leaf is copied for every page, also the leaves of other cache groups at that page id
(one page id means the same index in every pool, as on the device): the host tier's bytes per
page equal the device pool's.
"""

from __future__ import annotations

import collections
import time
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.host_tier import COPY_WIDTHS, PageCopies


def host_pages_for(size_gib: float, device_bytes_per_page: int) -> int:
    """Pages of a host tier of `size_gib` GiB (vLLM's `kv_offloading_size`), one device page each."""
    return int(size_gib * (1 << 30)) // max(1, device_bytes_per_page)


class HostKVPool:
    """The host tier's storage and copy programs for one runner's device caches."""

    def __init__(self, caches: Any, num_pages: int, host_pages: int, page_axis: int) -> None:
        leaves, self._treedef = jax.tree.flatten(caches)
        self.num_pages = num_pages  # device pages (the drop sentinel of device page columns)
        self.host_pages = host_pages
        self.axis = page_axis  # 0, or 1 with scan_layers' stacked pools f[n, P, ...]
        self._shapes = [(x.shape, x.dtype) for x in leaves]
        self.pools: list[np.ndarray] | None = None
        self.allocate()
        self.page_bytes = sum(x.nbytes for x in leaves) // num_pages
        self._shardings = [x.sharding for x in leaves]
        self._pending: collections.deque[tuple[list[jax.Array], np.ndarray, int]] = collections.deque()
        self._programs: dict[tuple[int, str], Any] = {}
        self.num_compiles = 0
        self.stats = {"host_bytes_saved": 0, "host_bytes_loaded": 0, "host_copy_s": 0.0}

    def allocate(self) -> None:
        """The numpy pools (zeros: pages are read only once a save wrote them)."""
        if self.pools is None:
            self.pools = [np.zeros(self._host_shape(s), np.dtype(d)) for s, d in self._shapes]

    def release(self) -> int:
        """Free the numpy pools (`LLM.sleep`); returns the bytes freed. Pending saves are dropped:
        the scheduler forgets every host key with them."""
        self._pending.clear()
        freed = sum(p.nbytes for p in self.pools or [])
        self.pools = None
        return freed

    def _host_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[: self.axis], self.host_pages, *shape[self.axis + 1 :])

    def _index(self, ids: np.ndarray | jax.Array | slice) -> tuple[Any, ...]:
        return (slice(None),) * self.axis + (ids,)

    def _abstract(self, width: int, kind: str) -> tuple[Any, ...]:
        """The copy program's arguments for `width` and `kind`, as shapes (AOT compile)."""
        leaves = [
            jax.ShapeDtypeStruct(s, d, sharding=sh) for (s, d), sh in zip(self._shapes, self._shardings)
        ]
        loads = None
        if kind != "save":
            loads = [jax.ShapeDtypeStruct(self._host_shape(s)[: self.axis] + (width,) + s[self.axis + 1 :], d)
                     for s, d in self._shapes]  # fmt: skip
        ids = jax.ShapeDtypeStruct((width,), jnp.int32)
        return leaves, loads, ids, ids

    def program(self, width: int, kind: str) -> Any:
        """The compiled copy program of `width` pages: kind "save" (read pages out), "load"
        (write pages in) or "both" (read first, then write). Compiled once (`warmup`)."""
        fn = self._programs.get((width, kind))
        if fn is not None:
            return fn
        axis = self.axis

        def copy(leaves, loads, save_pages, load_pages):
            idx = (slice(None),) * axis
            saved = (
                [] if kind == "load" else [jnp.take(x, save_pages, axis=axis, mode="clip") for x in leaves]
            )
            if kind != "save":
                leaves = [
                    x.at[(*idx, load_pages)].set(y.astype(x.dtype), mode="drop")
                    for x, y in zip(leaves, loads, strict=True)
                ]
            return leaves, saved

        jitted = jax.jit(copy, donate_argnums=(0,), out_shardings=(self._shardings, None))
        fn = self._programs[(width, kind)] = jitted.lower(*self._abstract(width, kind)).compile()
        self.num_compiles += 1
        return fn

    def warmup(self) -> int:
        """Compile every copy program now (serving then never compiles one); returns how many
        were compiled."""
        before = self.num_compiles
        for width in COPY_WIDTHS:
            for kind in ("save", "load", "both"):
                self.program(width, kind)
        return self.num_compiles - before

    def apply(self, caches: Any, copies: PageCopies) -> Any:
        """Enqueue `copies` on `caches` (donated); returns the caches the step must read. Columns
        of one of `COPY_WIDTHS` run as one program; wider ones in chunks of the widest: every
        save chunk, then every load chunk (a page saved in a step may be the one a load of that
        step fills). Loads are gathered from the host pool first: this step's saves may go to
        host pages its loads free, and land only later."""
        t0 = time.perf_counter()
        pools = self.pools
        assert pools is not None, "host tier used while released"
        leaves = jax.tree.leaves(caches)
        c, ns, nl = copies, copies.num_saves, copies.num_loads
        loads = None
        if nl:
            self.flush()  # a load may read a page an earlier step's save is still bringing
            slots = np.minimum(c.load_slots, self.host_pages - 1)  # padding reads a page, dropped
            loads = [p[self._index(slots)] for p in pools]
            self.stats["host_bytes_loaded"] += nl * self.page_bytes
        if c.width in COPY_WIDTHS:
            leaves = self._run(leaves, c.width, ns, nl, c.save_pages, c.save_slots, loads, c.load_pages)
        else:
            top = COPY_WIDTHS[-1]
            assert c.width % top == 0, f"{c.width=} is no copy width (`scheduler.host_tier.copy_bucket`)"
            for i in range(0, ns, top):
                sl = slice(i, i + top)
                leaves = self._run(leaves, top, min(top, ns - i), 0, c.save_pages[sl], c.save_slots[sl])
            for i in range(0, nl, top):
                sl, part = slice(i, i + top), self._index(slice(i, i + top))
                chunk = [x[part] for x in cast(list, loads)]
                leaves = self._run(leaves, top, 0, min(top, nl - i), None, None, chunk, c.load_pages[sl])
        self.stats["host_copy_s"] += time.perf_counter() - t0
        return jax.tree.unflatten(self._treedef, leaves)

    def _run(
        self, leaves: list, width: int, ns: int, nl: int, save_pages, save_slots, loads=None, load_pages=None
    ) -> list:
        """One copy program of `width` over columns of that width (padding: the drop sentinels)
        and the gathered `loads`; `ns` saves and `nl` loads of them valid."""
        kind = "both" if ns and nl else ("save" if ns else "load")
        none = self._no_pages(width) if save_pages is None or load_pages is None else None
        save = none if save_pages is None else save_pages
        load = none if load_pages is None else load_pages
        leaves, saved = self.program(width, kind)(leaves, loads if nl else None, save, load)
        if ns:
            for x in saved:
                x.copy_to_host_async()
            self._pending.append((saved, np.array(save_slots[:ns], np.int64), ns))
            self.stats["host_bytes_saved"] += ns * self.page_bytes
        return leaves

    def _no_pages(self, width: int) -> np.ndarray:
        """An all-padding device page column (the unused side of a save- or load-only chunk)."""
        return np.full(width, self.num_pages, np.int32)

    def flush(self) -> None:
        """Write every dispatched save into the numpy pools (blocks on their copy programs,
        which ran before their steps)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        pools = self.pools
        assert pools is not None
        while self._pending:
            saved, slots, n = self._pending.popleft()
            keep = self._index(slice(0, n))
            for pool, x in zip(pools, saved, strict=True):
                pool[self._index(slots)] = np.asarray(x)[keep]
        self.stats["host_copy_s"] += time.perf_counter() - t0
