"""The cluster prefix index: which worker holds which cached KV block (pure: no I/O).

Fed by every worker's KV events (``worker.<id>.kv``), it answers, for one prompt, how many
leading blocks each worker has cached, in one pass over the prompt's block hashes. A
block's hash chains the hashes before it (``libs/block_hash.py``), so a worker that has
block ``i`` of a prompt cached has the whole prefix up to it in the same sequence; the
walk stops for a worker at its first miss.

Each cached block is one entry, ``hash -> bitmask of worker slots``, per block size, and
each worker keeps the hashes it holds (to clear them when it resets its cache, dies or
restarts), each with the media it holds it in (its device pool, its host tier, its disk
tier: a worker holds a block while it has it in any). A worker's events are applied in ``event_id``
order; a gap means events were lost, and the worker is marked unsynced: its entries are
dropped, and the service asks it for a snapshot (``KvSnapshot``), buffering the events
that arrive meanwhile and applying those the snapshot does not already cover.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lamina.libs.block_hash import ROOT_HASH, hash_block
from lamina.schemas.v1.kv import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium

MAX_BUFFERED_EVENTS = 10_000
"""Events kept per worker while its snapshot is awaited; beyond this it resyncs again."""
_DEVICE, _HOST = 1, 2
_MEDIA = {Medium.DEVICE: _DEVICE, Medium.HOST: _HOST, Medium.DISK: 4}
_ELSEWHERE = 8
"""The bit of a medium this index does not know (a newer worker's): kept apart."""


@dataclass
class WorkerKv:
    """One worker's share of the index."""

    slot: int
    """Its bit in the index's masks."""
    block_size: int
    incarnation: str
    next_event_id: int = 0
    hashes: dict[int, int] = field(default_factory=dict)
    """Each block it holds -> the media it holds it in (a bitmask)."""
    synced: bool = True
    """False from a gap until its snapshot is applied."""
    buffered: list[KvEvent] = field(default_factory=list)


class PrefixIndex:
    """Cached blocks per worker, for the whole cluster."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerKv] = {}
        self._owners: dict[int, dict[int, int]] = {}  # block size -> hash -> worker mask
        self._device_owners: dict[int, dict[int, int]] = {}  # the same, on their devices
        self._free_slots: list[int] = []
        self._next_slot = 0

    # ------------------------------------------------------------------------- updates
    def apply(
        self, worker_id: str, incarnation: str, block_size: int, events: list[KvEvent]
    ) -> bool:
        """Apply a worker's event batch. Returns False when the worker needs a snapshot
        (a gap, or a worker not seen from its first event)."""
        kv = self._worker(worker_id, incarnation, block_size)
        if not kv.synced:
            kv.buffered += events
            if len(kv.buffered) > MAX_BUFFERED_EVENTS:
                kv.buffered.clear()
                return False
            return True
        for event in events:
            if event.event_id < kv.next_event_id:
                continue  # already covered (by a snapshot)
            if event.event_id > kv.next_event_id:
                self._desync(kv)
                kv.buffered = [e for e in events if e.event_id >= event.event_id]
                return False
            self._apply_one(kv, event)
            kv.next_event_id += 1
        return True

    def restore(
        self,
        worker_id: str,
        incarnation: str,
        block_size: int,
        block_hashes: list[int],
        next_event_id: int,
        host_block_hashes: list[int] = (),  # type: ignore[assignment]
        disk_block_hashes: list[int] = (),  # type: ignore[assignment]
    ) -> None:
        """Replace a worker's entries with its snapshot (its cache as of ``next_event_id``:
        its device's blocks and its lower tiers'), then apply what was buffered after
        it."""
        kv = self._worker(worker_id, incarnation, block_size)
        self._clear(kv)
        self._store(kv, block_hashes, _MEDIA[Medium.DEVICE])
        self._store(kv, host_block_hashes, _MEDIA[Medium.HOST])
        self._store(kv, disk_block_hashes, _MEDIA[Medium.DISK])
        kv.next_event_id = next_event_id
        kv.synced = True
        buffered, kv.buffered = kv.buffered, []
        if buffered:
            self.apply(worker_id, incarnation, block_size, buffered)

    def assume_synced(self, worker_id: str, incarnation: str, block_size: int) -> None:
        """Trust a worker's events from the next one on, without a snapshot (a worker that
        cannot send one); what it cached before is unknown to the index."""
        kv = self._worker(worker_id, incarnation, block_size)
        if not kv.synced:
            kv.synced = True
            if kv.buffered:
                kv.next_event_id = kv.buffered[0].event_id
                buffered, kv.buffered = kv.buffered, []
                self.apply(worker_id, incarnation, block_size, buffered)

    def drop(self, worker_id: str) -> None:
        """Forget a worker (dead, or gone)."""
        kv = self.workers.pop(worker_id, None)
        if kv is not None:
            self._clear(kv)
            self._free_slots.append(kv.slot)

    def _worker(self, worker_id: str, incarnation: str, block_size: int) -> WorkerKv:
        kv = self.workers.get(worker_id)
        if kv is not None and (kv.incarnation != incarnation or kv.block_size != block_size):
            self.drop(worker_id)  # restarted: a new cache, numbered from 0 again
            kv = None
        if kv is None:
            slot = self._free_slots.pop() if self._free_slots else self._take_slot()
            kv = self.workers[worker_id] = WorkerKv(slot, block_size, incarnation)
        return kv

    def _take_slot(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def desync(self, worker_id: str) -> None:
        """Distrust a worker's entries until its next snapshot (events may be lost)."""
        kv = self.workers.get(worker_id)
        if kv is not None:
            self._desync(kv)

    def _desync(self, kv: WorkerKv) -> None:
        self._clear(kv)
        kv.synced = False

    def _apply_one(self, kv: WorkerKv, event: KvEvent) -> None:
        match event:
            case BlockStored(block_hashes=hashes, medium=medium):
                self._store(kv, hashes, _MEDIA.get(medium, _ELSEWHERE))
            case BlockRemoved(block_hashes=hashes, medium=medium):
                owners, bit = self._owners.setdefault(kv.block_size, {}), 1 << kv.slot
                on_device = self._device_owners.setdefault(kv.block_size, {})
                gone = _MEDIA.get(medium, _ELSEWHERE)
                for block_hash in hashes:
                    if block_hash not in kv.hashes:
                        continue
                    if gone == _DEVICE:
                        self._unset(on_device, block_hash, bit)
                    media = kv.hashes[block_hash] & ~gone
                    if media:
                        kv.hashes[block_hash] = media
                    else:
                        del kv.hashes[block_hash]
                        self._unset(owners, block_hash, bit)
            case AllBlocksCleared():
                self._clear(kv)

    def _store(self, kv: WorkerKv, hashes: list[int], media: int) -> None:
        owners, bit = self._owners.setdefault(kv.block_size, {}), 1 << kv.slot
        on_device = self._device_owners.setdefault(kv.block_size, {})
        for block_hash in hashes:
            owners[block_hash] = owners.get(block_hash, 0) | bit
            kv.hashes[block_hash] = kv.hashes.get(block_hash, 0) | media
            if media == _DEVICE:
                on_device[block_hash] = on_device.get(block_hash, 0) | bit

    def _clear(self, kv: WorkerKv) -> None:
        owners, bit = self._owners.get(kv.block_size, {}), 1 << kv.slot
        on_device = self._device_owners.get(kv.block_size, {})
        for block_hash in kv.hashes:
            self._unset(owners, block_hash, bit)
            self._unset(on_device, block_hash, bit)
        kv.hashes = {}

    @staticmethod
    def _unset(owners: dict[int, int], block_hash: int, bit: int) -> None:
        mask = owners.get(block_hash, 0) & ~bit
        if mask:
            owners[block_hash] = mask
        else:
            owners.pop(block_hash, None)

    # ------------------------------------------------------------------------- lookups
    def overlap(
        self, token_ids: list[int], worker_ids: list[str], root: int = ROOT_HASH
    ) -> dict[str, int]:
        """Leading blocks of ``token_ids`` each of ``worker_ids`` has cached (0 for a
        worker the index does not know, or has not synced)."""
        hits = self.overlap_by_medium(token_ids, worker_ids, root)
        return {w: hit[0] for w, hit in hits.items()}

    def overlap_by_medium(
        self, token_ids: list[int], worker_ids: list[str], root: int = ROOT_HASH
    ) -> dict[str, tuple[int, int, int]]:
        """For each of ``worker_ids``: the leading blocks of ``token_ids`` it has cached,
        how many of them its host tier holds and its device does not, and how many only
        its disk tier (or a tier this index does not know) holds: a hit loads those back
        from the fastest tier holding them. One pass over the prompt per block size in
        use, hashing a block only while some worker still matches. ``root``: the parent
        of the first block's hash (``block_hash.root_hash``: a LoRA adapter's own)."""
        result = dict.fromkeys(worker_ids, (0, 0, 0))
        by_size: dict[int, dict[int, str]] = {}  # block size -> slot -> worker id
        for worker_id in worker_ids:
            kv = self.workers.get(worker_id)
            if kv is not None and kv.synced and kv.hashes:
                by_size.setdefault(kv.block_size, {})[kv.slot] = worker_id
        for block_size, slots in by_size.items():
            owners = self._owners.get(block_size, {})
            on_device = self._device_owners.get(block_size, {})
            matching = sum(1 << slot for slot in slots)
            lower = {slot: [0, 0] for slot in slots}  # host, disk
            parent, blocks = root, 0
            for start in range(0, len(token_ids) - block_size + 1, block_size):
                parent = hash_block(parent, token_ids[start : start + block_size])
                still = matching & owners.get(parent, 0)
                if still != matching:
                    _settle(result, slots, matching & ~still, blocks, lower)
                    matching = still
                    if not matching:
                        break
                elsewhere = matching & ~on_device.get(parent, 0)
                while elsewhere:  # the workers holding this block only in lower tiers
                    slot = elsewhere.bit_length() - 1
                    media = self.workers[slots[slot]].hashes[parent]
                    lower[slot][0 if media & _HOST else 1] += 1
                    elsewhere &= ~(1 << slot)
                blocks += 1
            _settle(result, slots, matching, blocks, lower)
        return result

    def __len__(self) -> int:
        """Cached (block, worker) entries in the index."""
        return sum(len(kv.hashes) for kv in self.workers.values())


def _settle(
    result: dict[str, tuple[int, int, int]],
    slots: dict[int, str],
    mask: int,
    blocks: int,
    lower: dict[int, list[int]],
) -> None:
    """Record ``blocks`` (and its host and disk counts) for every worker set in ``mask``."""
    for slot, worker_id in slots.items():
        if mask >> slot & 1:
            result[worker_id] = (blocks, *lower[slot])  # type: ignore[assignment]
