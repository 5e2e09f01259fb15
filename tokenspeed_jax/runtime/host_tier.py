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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.host_tier import PageCopies


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
        self._programs: dict[tuple[int, bool], Any] = {}
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

    def _index(self, ids: np.ndarray | jax.Array) -> tuple[Any, ...]:
        return (slice(None),) * self.axis + (ids,)

    def _program(self, width: int, has_loads: bool) -> Any:
        fn = self._programs.get((width, has_loads))
        if fn is not None:
            return fn
        axis = self.axis

        def copy(leaves, loads, save_pages, load_pages):
            self.num_compiles += 1  # runs once per trace
            idx = (slice(None),) * axis
            saved = [jnp.take(x, save_pages, axis=axis, mode="clip") for x in leaves]
            if has_loads:
                leaves = [
                    x.at[(*idx, load_pages)].set(y.astype(x.dtype), mode="drop")
                    for x, y in zip(leaves, loads, strict=True)
                ]
            return leaves, saved

        out = (self._shardings, None) if len(jax.devices()) > 1 else None
        fn = jax.jit(copy, donate_argnums=(0,), out_shardings=out)
        self._programs[(width, has_loads)] = fn
        return fn

    def apply(self, caches: Any, copies: PageCopies) -> Any:
        """Enqueue `copies` on `caches` (donated); returns the caches the step must read."""
        t0 = time.perf_counter()
        pools = self.pools
        assert pools is not None, "host tier used while released"
        has_loads = copies.num_loads > 0
        loads: list[np.ndarray] | None = None
        if has_loads:
            self.flush()  # a load may read a page an earlier step's save is still bringing
            slots = np.minimum(copies.load_slots, self.host_pages - 1)  # padding: any page, dropped
            loads = [p[self._index(slots)] for p in pools]
            self.stats["host_bytes_loaded"] += copies.num_loads * self.page_bytes
        fn = self._program(copies.width, has_loads)
        leaves, saved = fn(jax.tree.leaves(caches), loads, copies.save_pages, copies.load_pages)
        if copies.num_saves:
            for x in saved:
                x.copy_to_host_async()
            self._pending.append((saved, copies.save_slots[: copies.num_saves].copy(), copies.num_saves))
            self.stats["host_bytes_saved"] += copies.num_saves * self.page_bytes
        self.stats["host_copy_s"] += time.perf_counter() - t0
        return jax.tree.unflatten(self._treedef, leaves)

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
