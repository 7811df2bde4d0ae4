"""Prefix-aware eviction by the chance of a read within the cache's horizon: O(1) per access.

The rule
--------
Blocks sit in two least-recently-used lists by *reuse class*: class 0 holds
blocks not read since they were stored (most of a chat trace's blocks are
never read again), class 1 blocks read at least once since. The victim is one
of the two list heads, whichever is less likely to be read within the cache's
*horizon* ``W`` (twice the mean age at which blocks have recently been
evicted):

    hazard_c(a) = P(next read at age in [a, a + W) | class c, unread at age a)

estimated online from the reuse distances the policy sees: the age of every
hit, and the age at which an evicted block came back while a *ghost* still
remembered it (ghosts are what let the estimate see past the policy's own
evictions). Ages count accesses, not seconds, so the policy is the same
whatever the clock. Histograms use log-spaced age bins (four per octave),
decay geometrically, and are folded into a hazard table every ``period``
accesses, so an eviction is two table lookups.

When both classes reuse alike the hazard falls with age and the rule is LRU;
when fresh blocks are mostly never read again (chat traces) their hazard
drops after a short age and they leave early, which is the probationary queue
of S3-FIFO or 2Q with its size learned from what comes back instead of fixed.
This is the reasoning of LHD (Beckmann et al., NSDI'18: evict the least
expected hits per unit of space-time), cut down to two candidates so that no
sampling is needed.

Prefix awareness
----------------
A reader needs a chain's whole prefix, so evicting a parent before its
children wastes the children. Blocks touched as one chain (each the child of
the one touched before) are re-ordered leaf first when the run ends, so within
a class a chain leaves from its tail. That is an ordering, not a rule: a head
with cached children is still taken when it is the victim. Passing such heads
over (to the back of their list) was measured and is far worse (-4 to -10
points of hit ratio on both traces): a finished chain then needs one trip
through the whole list per block to leave. A block superseded by a sibling
while never read (a session's partial last block, whose hash changes as the
session grows) goes before anything else.

Parameters and where they come from
-----------------------------------
Two classes, ghosts for 4x the peak number of tracked blocks, a histogram
decay of 0.95 per fold period and a horizon of twice the mean eviction age
were chosen by ``python -m memkv.bench.eviction_fit --trace
<synthetic_trace.jsonl>`` on *fit* traces (Mooncake's public synthetic trace
and the agent-fleet generator with seed 1), never on the traces ``memkv bench
eviction`` and ``eviction-agents`` score (Mooncake's conversation trace and
seed 0). Ghosts are capped at 4 per block by the cost budget (8 measured 3.3
us per access at 100k blocks). Tried on prototypes and not kept: a third
class for fresh blocks that extend a read chain (no gain on the fit traces),
more classes by read count (worse at 10-20%), a decay of 0.5 (-0.01 to -0.03
worst case on the fit traces).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic

from memkv.errors import InvalidInputError
from memkv.storage.eviction.policy import K, _already_tracked, _not_pinned, _still_pinned, _unknown

__all__ = ["HorizonPolicy", "age_bin"]

#: Age bins: ages 0-7 exactly, then four bins per octave up to ~2^33 accesses.
AGE_BINS = 128
#: Reuse classes: 0 = not read since stored, 1 = read since stored.
CLASSES = 2
#: Each histogram keeps this share of its weight per period (a memory of ~20 periods).
DECAY = 0.95
#: The horizon is this multiple of the mean eviction age.
HORIZON_SHARE = 2.0
#: Ghosts remembered per peak tracked block, and at least this many.
GHOSTS_PER_BLOCK = 4.0
GHOST_FLOOR = 1024
#: The hazard table is rebuilt every max(PERIOD_FLOOR, peak / 2) accesses.
PERIOD_FLOOR = 2048

# A block's state is one int, ``stamp << 2 | state`` (stamp: the clock of its last use),
# in a dict of ints: no per-block object, so nothing for the cyclic GC to walk and one
# lookup per access.
_FRESH, _READ, _SUPERSEDED, _PINNED = 0, 1, 2, 3  # the first two are the reuse classes
_STATE = 3


def age_bin(age: int) -> int:
    """The histogram bin of an age in accesses (log-spaced, four bins per octave)."""
    if age < 8:
        return age if age > 0 else 0
    b = age.bit_length()
    i = (b - 3) * 4 + ((age >> (b - 3)) & 3) + 4
    return i if i < AGE_BINS else AGE_BINS - 1


def _bin_middles() -> list[float]:
    mids = [float(a) for a in range(8)]
    for i in range(8, AGE_BINS):
        octave, step = (i - 4) // 4 + 3, (i - 4) % 4
        width = 1 << (octave - 3)
        mids.append((4 + step) * width + width / 2)
    return mids


_MIDDLES = _bin_middles()


class HorizonPolicy(Generic[K]):
    """Evict the list head least likely to be read within the horizon (module docstring).

    Args:
        decay: share of the histograms' weight kept per fold period.
        horizon_share: the horizon as a multiple of the mean eviction age.
        ghosts_per_block: ghosts remembered per peak tracked block.
        ghost_floor: ghosts kept at least, whatever the peak size.

    Example:
        >>> p = HorizonPolicy()
        >>> p.insert("a", 0.0); p.insert("b", 0.0); p.access("a", 0.0)
        >>> p.pop_victim(0.0)
        'b'
    """

    def __init__(
        self,
        *,
        decay: float = DECAY,
        horizon_share: float = HORIZON_SHARE,
        ghosts_per_block: float = GHOSTS_PER_BLOCK,
        ghost_floor: int = GHOST_FLOOR,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise InvalidInputError(f"decay must be in (0, 1], got {decay}")
        if not horizon_share > 0.0:
            raise InvalidInputError(f"horizon_share must be > 0, got {horizon_share}")
        if ghosts_per_block < 0 or ghost_floor < 0:
            raise InvalidInputError(
                f"ghosts_per_block and ghost_floor must be >= 0, got {ghosts_per_block} "
                f"and {ghost_floor}")
        self._decay, self._horizon_share = decay, horizon_share
        self._ghosts_per_block = ghosts_per_block
        # Unpinned blocks of each reuse class, least recently used first.
        self._lists: tuple[OrderedDict[K, None], ...] = tuple(OrderedDict() for _ in range(CLASSES))
        self._superseded: OrderedDict[K, None] = OrderedDict()
        self._meta: dict[K, int] = {}  # stamp << 2 | state
        self._parent: dict[K, K | None] = {}
        self._children: dict[K, int] = {}  # tracked children, for blocks that have some
        self._newest_child: dict[K, K] = {}
        self._pins: dict[K, int] = {}
        # Ghost: key -> stamp << 2 | class, at eviction.
        self._ghosts: OrderedDict[K, int] = OrderedDict()
        self._ghost_floor = ghost_floor
        self._peak = 0  # most blocks tracked at once
        self._clock = 0
        self._next_fold = PERIOD_FLOOR
        self._reuse = [[0.0] * AGE_BINS for _ in range(CLASSES)]
        self._entered = [0.0] * CLASSES
        # Until the first fold: hazard falls with age alike in both classes, i.e. LRU.
        self._hazard = [[1.0 / (i + 1) for i in range(AGE_BINS)] for _ in range(CLASSES)]
        self._evicted_age = 0.0
        self._evicted = 0.0
        self._horizon = 0.0
        # The chain being touched, root first: a block extends it when its parent is the
        # run's last block; anything else ends it (see _end_run).
        self._run: list[K] = []

    # ------------------------------------------------------------------ interface

    def insert(self, key: K, now: float, parent: K | None = None) -> None:
        """Track a newly cached block; ``parent`` precedes it in its chain.

        Raises:
            InvalidInputError: ``key`` is already tracked (use :meth:`access`).
        """
        meta = self._meta
        if key in meta:
            raise _already_tracked(key)
        clock = self._clock = self._clock + 1
        if clock >= self._next_fold:
            self._fold()
        cls = _FRESH
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:  # a comeback: what the policy let go was wanted again
            self._reuse[ghost & _STATE][age_bin(clock - (ghost >> 2))] += 1.0
            cls = _READ
        if parent is not None and parent in meta:
            children = self._children
            children[parent] = children.get(parent, 0) + 1
            newest = self._newest_child
            if parent in newest:
                self._supersede(newest[parent])
            newest[parent] = key
        meta[key] = clock << 2 | cls
        self._parent[key] = parent
        self._lists[cls][key] = None
        self._entered[cls] += 1.0
        if len(meta) > self._peak:  # ghosts and the fold period scale with the peak
            self._peak = len(meta)
        run = self._run  # _touch, inlined: this is the hot path
        if run and run[-1] != parent:
            self._end_run()
        run.append(key)

    def access(self, key: K, now: float) -> None:
        """Record a read of ``key``.

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        meta = self._meta
        m = meta.get(key)
        if m is None:
            raise _unknown("access", key)
        clock = self._clock = self._clock + 1
        if clock >= self._next_fold:
            self._fold()
        state = m & _STATE
        if state < CLASSES:  # a reuse at this age, in its class
            self._reuse[state][age_bin(clock - (m >> 2))] += 1.0
            if state == _FRESH:
                del self._lists[_FRESH][key]
                self._lists[_READ][key] = None
                state = _READ
        elif state == _SUPERSEDED:  # read after all: an ordinary block again
            del self._superseded[key]
            self._lists[_READ][key] = None
            state = _READ
        self._entered[_READ] += 1.0
        meta[key] = clock << 2 | state
        run = self._run
        if run and run[-1] != self._parent[key]:
            self._end_run()
        run.append(key)

    def remove(self, key: K) -> None:
        """Forget ``key`` (left for another reason); it leaves no ghost.

        Raises:
            InvalidInputError: ``key`` is not tracked, or is pinned (unpin it first).
        """
        m = self._meta.get(key)
        if m is None:
            raise _unknown("remove", key)
        if key in self._pins:
            raise _still_pinned(key, self._pins[key])
        self._unlist(key, m & _STATE)
        self._forget(key)

    def pin(self, key: K) -> None:
        """Protect ``key`` from eviction until as many :meth:`unpin` calls.

        Raises:
            InvalidInputError: ``key`` is not tracked.
        """
        m = self._meta.get(key)
        if m is None:
            raise _unknown("pin", key)
        pins = self._pins.get(key, 0)
        if not pins:
            self._unlist(key, m & _STATE)
            self._meta[key] = (m >> 2) << 2 | _PINNED
        self._pins[key] = pins + 1

    def unpin(self, key: K) -> None:
        """Drop one pin of ``key``; after the last it is the most recent of the read class.

        Raises:
            InvalidInputError: ``key`` is not tracked, or is not pinned.
        """
        if key not in self._meta:
            raise _unknown("unpin", key)
        pins = self._pins.get(key)
        if pins is None:
            raise _not_pinned(key)
        if pins > 1:
            self._pins[key] = pins - 1
            return
        del self._pins[key]  # a pinned block is one being read: it was used
        self._meta[key] = self._clock << 2 | _READ
        self._lists[_READ][key] = None

    def pop_victim(self, now: float) -> K | None:
        """Choose and forget the victim (a superseded tail first, then the lower hazard)."""
        if self._run:
            self._end_run()
        if self._superseded:
            key, _ = self._superseded.popitem(last=False)
            self._forget(key)
            return key
        fresh, read = self._lists
        meta, clock = self._meta, self._clock
        if fresh and read:
            kf, kr = next(iter(fresh)), next(iter(read))
            mf, mr = meta[kf], meta[kr]
            age_f, age_r = clock - (mf >> 2), clock - (mr >> 2)
            hf = self._hazard[_FRESH][age_bin(age_f)]
            hr = self._hazard[_READ][age_bin(age_r)]
            if hf < hr or (hf == hr and age_f >= age_r):
                key, m, age = kf, mf, age_f
                del fresh[kf]
            else:
                key, m, age = kr, mr, age_r
                del read[kr]
        elif fresh or read:
            key, _ = (fresh or read).popitem(last=False)
            m = meta[key]
            age = clock - (m >> 2)
        else:
            return None
        self._evicted_age += age
        self._evicted += 1.0
        ghosts = self._ghosts
        ghosts[key] = m  # its stamp and class
        if len(ghosts) > self._ghosts_per_block * self._peak and len(ghosts) > self._ghost_floor:
            ghosts.popitem(last=False)
        self._forget(key)
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    # ------------------------------------------------------------------ internals

    def _fold(self) -> None:
        """Rebuild the hazard tables from the histograms, then age the histograms."""
        self._next_fold = self._clock + max(PERIOD_FLOOR, self._peak // 2)
        if self._evicted:
            self._horizon = self._horizon_share * self._evicted_age / self._evicted
        decay = self._decay
        self._evicted_age *= decay
        self._evicted *= decay
        horizon = self._horizon
        if horizon <= 0:
            return  # nothing evicted yet: keep the LRU-like start
        for cls in range(CLASSES):
            reuse, entered = self._reuse[cls], self._entered[cls]
            below = [0.0] * (AGE_BINS + 1)  # below[i] = reuses at ages in bins < i
            for i in range(AGE_BINS):
                below[i + 1] = below[i] + reuse[i]
            hazard = self._hazard[cls]
            for i in range(AGE_BINS):
                survivors = entered - below[i]
                reach = age_bin(int(_MIDDLES[i] + horizon)) + 1
                hazard[i] = (below[reach] - below[i]) / survivors if survivors > 1e-9 else 0.0
                reuse[i] *= decay
            self._entered[cls] = entered * decay

    def _supersede(self, old: K) -> None:
        """A parent got a new child: ``old``, its previous newest, goes first if never read
        and childless (a session's partial last block, replaced as the session grew)."""
        m = self._meta.get(old)
        if m is not None and m & _STATE == _FRESH and old not in self._children:
            del self._lists[_FRESH][old]
            self._superseded[old] = None
            self._meta[old] = m ^ _FRESH ^ _SUPERSEDED

    def _end_run(self) -> None:
        """Re-order the run's blocks leaf first, so that a chain leaves from its tail."""
        run = self._run
        meta, lists = self._meta, self._lists
        for key in reversed(run):
            m = meta.get(key)
            if m is not None and m & _STATE < CLASSES:
                lists[m & _STATE].move_to_end(key)
        run.clear()

    def _unlist(self, key: K, state: int) -> None:
        if state < CLASSES:
            del self._lists[state][key]
        elif state == _SUPERSEDED:
            del self._superseded[key]

    def _forget(self, key: K) -> None:
        del self._meta[key]
        parent = self._parent.pop(key)
        self._children.pop(key, None)
        self._newest_child.pop(key, None)
        if parent is not None:
            children = self._children
            left = children.get(parent)
            if left is not None:
                if left > 1:
                    children[parent] = left - 1
                else:
                    del children[parent]
            if self._newest_child.get(parent) == key:
                del self._newest_child[parent]
