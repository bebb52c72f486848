"""Hybrid prefix cache: what is cached, and where a new request can resume.

A hybrid model resumes at position p only with BOTH the KV of tokens [0, p) (attention
layers) and the Mamba conv + SSM state after token p-1. So the cache has two parts:

- **KV blocks**, content-addressed by a trie: a node is one full block whose key is its
  tokens under its parent node, so a node stands for the whole prefix up to its block's
  end (a hash chain with exact keys: no collision can match a wrong prefix). Blocks are
  shared read-only: a request that resumes holds the matched blocks
  (`KVBlockAllocator.hold`); blocks nobody holds stay cached until the pool needs them.
- **State checkpoints**: the Mamba state at position p, in a checkpoint slot of the state
  pool, attached to the node of the full blocks below p. When p is inside a block, the
  checkpoint also keeps a copy of that partial block (its *tail block*; tokens
  [p - p % block_size, p) valid); a resuming request copies it into a block of its own
  (copy-on-write: a shared block is never written).

Checkpoints are taken at the end of every prompt, every `checkpoint_interval` tokens of a
long prefill (at multiples of the interval, from one interval past where the prefill
began), and when a request finishes or is evicted (its committed state: the next chat turn
resends prompt + answer and resumes there; a recomputed request resumes where it was
evicted). A request may place its prompt-end checkpoint later, inside its output
(`Request.checkpoint_at`: a draft model's proposal, at the end of the target's committed
tokens, where the next proposal resumes; it leaves no finish checkpoint: its end holds
drafts). A state exists at a chunk's end, so the scheduler ends a chunk at the prompt-end
checkpoint when tokens follow it (`chunk_limit`). Interval checkpoints do not cut chunks:
when a chunk is launched, a checkpoint slot is reserved for each interval position inside
it (`reserve_saves`; none where a checkpoint exists, only a free spare where another chunk
in flight reserved the same prefix), the Mamba kernels write the state there from inside
the chunk (`layers.kernels.ops.StateSaves`), and `commit` attaches it once the chunk
retires. (Cut chunks would turn first-come-first-served prefill into round robin: a long
prompt would take one step per interval, and a burst of them would all finish late.) A
checkpoint at a chunk's end takes the request's committed state slot itself, with no copy
(`MambaStateAllocator.hand_over`); the tail-block copies are device ops issued at once:
stream order puts them after every launched step (whose writes they read) and before every
later one.

Nothing of a request at or past its `Request.cache_limit` is registered: there a generated
token had a Mamba dt that a prefill of the same text (as a prompt) would have clamped, so
what the request computed is not what an uncached request computes (docs/cache.md,
"Exactness"; the scheduler also caps a recomputed request's lookup there).

A hit (`acquire`) is the deepest checkpoint whose prefix the request's tokens match, at
most `len(tokens) - 1` (the last token is always computed: it yields the first logits).
The resumed request's first row reads the checkpoint's state in place (no copy).
Eviction is least recently used: checkpoints when the checkpoint slots run out (a
finished request's own checkpoints that nobody used go first: its finish checkpoint is
deeper on the same prefix; one a request still reads in place is passed over), blocks
when the KV pool runs short (a block's eviction drops the nodes under it and every
checkpoint attached there).
"""
from collections import OrderedDict
from dataclasses import dataclass, field

from cache.kv_cache import KVBlockAllocator
from cache.mamba_cache import MambaStateAllocator

NEVER = 1 << 62  # a committed length no request reaches: "no need to call `commit` again"


@dataclass(eq=False, slots=True)
class Checkpoint:
    """The Mamba state after `position` tokens, attached to `node` (the full blocks below
    it); `tail`: the tokens from the node's end to `position`, whose KV `tail_block` keeps
    (-1: `position` is block-aligned)."""

    position: int
    node: "CachedBlock"
    tail: tuple[int, ...]
    tail_block: int
    slot: int
    used: bool = False  # a request resumed from it (its creator too, readmitted after an eviction)


@dataclass(eq=False, slots=True)
class CachedBlock:
    """A trie node: KV block `block` holds `tokens`, the block after `parent`'s prefix."""

    block: int  # -1 for the root (the empty prefix)
    tokens: tuple[int, ...]
    parent: "CachedBlock | None"
    depth: int  # full blocks from the root through this one
    children: dict[tuple[int, ...], "CachedBlock"] = field(default_factory=dict)
    checkpoints: dict[tuple[int, ...], Checkpoint] = field(default_factory=dict)
    alive: bool = True


@dataclass(frozen=True, slots=True)
class PendingSave:
    """A checkpoint slot reserved for the state after `position` tokens, which a launched
    prefill chunk writes from inside itself; attached by `commit` once the chunk retires.
    `key`: the hash of the tokens before `position` (`_Progress.prefix_key`)."""

    position: int
    slot: int
    key: int


@dataclass(slots=True)
class PrefixHit:
    """A resume point taken by `acquire`: the request starts with `blocks` (the shared full
    blocks, then `tail_copy`, its own block for the checkpoint's tail block, if it has one)
    and the checkpoint's state, at `position`."""

    position: int
    blocks: list[int]
    checkpoint: Checkpoint
    tail_copy: int = -1


@dataclass(eq=False, slots=True)
class _Progress:
    """How far a request's KV is registered: its prefix's node (canonical: an identical
    block registered first wins), the checkpoints it saved, and the slots its launched
    chunks write checkpoints into (`reserved`, in launch order)."""

    node: CachedBlock
    saved: list[Checkpoint] = field(default_factory=list)
    resumed: Checkpoint | None = None  # the checkpoint it resumed from
    reserved: list[PendingSave] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # `prefix_key` of each block end so far

    @property
    def begin(self) -> int:
        """Where its prefill began: the hit's position, else 0."""
        return 0 if self.resumed is None else self.resumed.position

    def prefix_key(self, request, position: int, block_size: int) -> int:
        """A hash of the request's tokens before `position` (block aligned), chained block
        by block and computed once per block. Two requests whose keys are equal have the
        same prefix but for a hash collision, which costs at most a checkpoint not taken
        (a key only makes a reservation a spare; what is attached is matched token by token)."""
        hashes = self.block_hashes
        for i in range(len(hashes), position // block_size):
            hashes.append(hash((hashes[-1] if hashes else 0, _token_slice(request, i * block_size,
                                                                           (i + 1) * block_size))))
        return hashes[position // block_size - 1]


class PrefixCache:
    """Owner of the prefix cache's content: the block trie, the checkpoints, their LRUs.

    The scheduler calls `acquire` / `cancel` / `resume` when it admits a request,
    `chunk_limit` to end a prefill chunk at the prompt-end checkpoint, `reserve_saves` when
    it launches a prefill chunk (`release_saves` if that launch is rejected), `commit` when
    a request's committed length reaches `commit_at`, and `finish` when it ends or is
    evicted.
    """

    def __init__(self, kv: KVBlockAllocator, mamba: MambaStateAllocator, checkpoint_interval: int):
        if checkpoint_interval <= 0 or checkpoint_interval % kv.block_size:
            raise ValueError(f"prefix_cache_checkpoint_interval must be a positive multiple of kv_block_size "
                             f"({kv.block_size}), got {checkpoint_interval}")
        self.kv, self.mamba, self.interval = kv, mamba, checkpoint_interval
        self.block_size = kv.block_size
        self.root = CachedBlock(block=-1, tokens=(), parent=None, depth=0)
        self._by_block: dict[int, CachedBlock | Checkpoint] = {}  # what each cached block holds
        self._checkpoints: OrderedDict[Checkpoint, None] = OrderedDict()  # least recently used first
        self._progress: dict[object, _Progress] = {}  # by request
        # Every reserved save by prefix key: while a chunk in flight will checkpoint a prefix,
        # another request with the same prefix (a burst of one system prompt, admitted before
        # any of it commits) evicts no checkpoint to reserve it again (a free slot it takes).
        self._pending: dict[int, list[PendingSave]] = {}
        kv.set_evict_callback(self._on_block_evicted)

    @property
    def num_checkpoints(self) -> int:
        """Checkpoints held now."""
        return len(self._checkpoints)

    # ---- resuming --------------------------------------------------------------------
    def acquire(self, tokens: list[int]) -> PrefixHit | None:
        """The deepest checkpoint at a position <= len(tokens) - 1 whose prefix `tokens`
        start with, taken: its full blocks are held, and a block for the copy of its tail
        is allocated. The caller then `resume`s (admitted) or `cancel`s (not admitted)."""
        limit, bs = len(tokens) - 1, self.block_size
        node, best = self.root, None
        while True:
            base = node.depth * bs
            for tail, checkpoint in node.checkpoints.items():
                end = base + len(tail)
                if end <= limit and (best is None or end > best.position) and tuple(tokens[base:end]) == tail:
                    best = checkpoint
            if base + bs > limit:
                break
            child = node.children.get(tuple(tokens[base:base + bs]))
            if child is None:
                break
            node = child
        if best is None:
            return None
        full = self._chain(best.node)
        self.kv.hold(full)
        hit = PrefixHit(best.position, full, best)
        if best.tail_block >= 0:
            self.kv.hold((best.tail_block,))  # (so allocating its copy cannot evict it)
            if self.kv.num_free == 0:
                self.kv.release(full + [best.tail_block])
                return None
            hit.tail_copy = self.kv.allocate(1)[0]
            hit.blocks = full + [hit.tail_copy]
        return hit

    def cancel(self, hit: PrefixHit) -> None:
        """Undo an `acquire` whose request was not admitted (`hit.blocks` may have grown by
        blocks the caller reserved: they are released too)."""
        checkpoint = hit.checkpoint
        if checkpoint.tail_block >= 0:
            self.kv.release((checkpoint.tail_block,))
        self.kv.release(reversed(hit.blocks))

    def resume(self, request, hit: PrefixHit) -> int:
        """The request was admitted at `hit`: copy the tail block into its own, and track
        its registration from the hit's node. (The caller starts its Mamba state from
        `hit.checkpoint.slot`, `MambaStateAllocator.allocate(resume_from=...)`: its first
        row reads the checkpoint in place.) Returns the committed length at which to call
        `commit`."""
        checkpoint = hit.checkpoint
        if checkpoint.tail_block >= 0:
            self.kv.copy_block(checkpoint.tail_block, hit.tail_copy)
            self.kv.release((checkpoint.tail_block,))
        checkpoint.used = True
        self._checkpoints.move_to_end(checkpoint)
        progress = self._progress[request] = _Progress(checkpoint.node, resumed=checkpoint)
        return self._next_commit(progress, hit.position, request.prompt_checkpoint)

    def start(self, request) -> int:
        """The request was admitted without a hit: its registration starts at the root.
        Returns the committed length at which to call `commit`."""
        progress = self._progress[request] = _Progress(self.root)
        return self._next_commit(progress, 0, request.prompt_checkpoint)

    @staticmethod
    def chunk_limit(request, start: int, num_tokens: int) -> int:
        """`num_tokens`, shortened so the request's prefill chunk from `start` ends at its
        prompt-end checkpoint (`Request.prompt_checkpoint`) when tokens follow it: its
        state is saved by handing over the committed slot, which exists at a chunk's end
        only. (Interval checkpoints are written from inside chunks: `reserve_saves`.)"""
        boundary = request.prompt_checkpoint
        if start < boundary < start + num_tokens:
            return boundary - start
        return num_tokens

    def reserve_saves(self, request, start: int, num_tokens: int) -> tuple[PendingSave, ...]:
        """Checkpoint slots for the interval positions strictly inside a prefill chunk being
        launched, tokens [start, start + num_tokens) (before its prompt-end checkpoint):
        the chunk's kernels write its state there. A position already checkpointed takes no
        slot; one another chunk in flight has reserved (the same prefix) takes a free slot
        only, never evicting for it (a spare, should that chunk's request end before it
        retires); one for which no slot can be had gets no checkpoint."""
        progress = self._progress[request]
        if not progress.node.alive:
            return ()
        end = min(start + num_tokens, request.prompt_checkpoint)
        position = self._next_interval(progress.begin, start)
        saves = []
        while position < end:
            if not self._has_checkpoint(request, progress, position):
                key = progress.prefix_key(request, position, self.block_size)
                spare = key in self._pending
                slot = self.mamba.take_checkpoint_slot() if spare else self._free_slot()
                if slot is None and not spare:
                    break
                if slot is not None:
                    saves.append(PendingSave(position, slot, key))
                    self._pending.setdefault(key, []).append(saves[-1])
            position += self.interval
        progress.reserved += saves
        return tuple(saves)

    def _has_checkpoint(self, request, progress: _Progress, position: int) -> bool:
        """Whether the trie holds a checkpoint at block-aligned `position` of the request's
        tokens (walking down from its registered prefix through blocks others registered);
        one found is marked recently used, as the chunk passes it."""
        node, bs = progress.node, self.block_size
        while node is not None and node.depth < position // bs:
            node = node.children.get(_token_slice(request, node.depth * bs, (node.depth + 1) * bs))
        return node is not None and self._existing(node, ()) is not None

    def release_saves(self, request, saves: tuple[PendingSave, ...]) -> None:
        """A launched chunk was rejected: give its reserved slots back (its relaunch
        reserves again). Whatever the rejected chunk still writes there lands before any
        later launch's write, in stream order."""
        reserved = self._progress[request].reserved
        for save in saves:
            reserved.remove(save)
            self._unreserve(save)

    def _unreserve(self, save: PendingSave) -> None:
        """A reserved slot goes back to the pool, and its prefix may be reserved again."""
        self._forget_pending(save)
        self.mamba.free_checkpoint_slot(save.slot)

    def _forget_pending(self, save: PendingSave) -> None:
        """The save no longer marks its prefix reserved (its slot is attached or freed)."""
        saves = self._pending[save.key]
        saves.remove(save)
        if not saves:
            del self._pending[save.key]

    def _next_interval(self, begin: int, position: int) -> int:
        """The first interval position after `position` for a prefill that began at
        `begin`: a multiple of the interval at least one interval past `begin`. So a long
        prefill leaves a checkpoint every interval, aligned to the same positions for every
        request, and a short one (a chat turn resuming at the previous turn's end) is not
        split for a checkpoint a few tokens past the one it resumed from."""
        n = self.interval
        return max(position // n + 1, -(-(begin + n) // n)) * n

    # ---- registering -----------------------------------------------------------------
    def commit(self, request, num_computed: int) -> int:
        """The request's KV and state (`request.state`) are committed through `num_computed`
        tokens: attach the checkpoints its retired chunks wrote from inside themselves
        (`reserve_saves`), register its newly full blocks, and checkpoint the state if this
        is the prompt's end or an interval position inside the prompt. Returns the committed
        length at which to call again."""
        progress = self._progress[request]
        reserved = progress.reserved
        while reserved and reserved[0].position <= num_computed:
            self._attach(request, progress, reserved.pop(0))
        self._register_blocks(request, progress, num_computed)
        prompt_end = request.prompt_checkpoint
        interval_position = num_computed == self._next_interval(progress.begin, num_computed - 1)
        if num_computed == prompt_end or (num_computed < prompt_end and interval_position):
            self._save(request, progress, num_computed)
        return self._next_commit(progress, num_computed, prompt_end)

    def _next_commit(self, progress: _Progress, num_computed: int, prompt_end: int) -> int:
        """The committed length at which the request next has a block to register or a
        state to checkpoint."""
        if not progress.node.alive:
            # Its prefix was evicted: nothing more of it is cached (reserved slots are
            # given back when the chunks that write them retire).
            return progress.reserved[0].position if progress.reserved else NEVER
        next_block = (progress.node.depth + 1) * self.block_size
        if num_computed < prompt_end:
            return min(next_block, self._next_interval(progress.begin, num_computed), prompt_end)
        return next_block

    def finish(self, request, num_computed: int, save_state: bool = True) -> None:
        """The request ends (or is evicted): checkpoint its committed state at
        `num_computed` (unless `save_state` is False: its state is not trusted, e.g. a
        failed step), and stop tracking it. Its own earlier checkpoints that nobody used
        become the first to evict: this one is deeper on the same prefix."""
        progress = self._progress.pop(request, None)
        if progress is None:
            return
        for save in progress.reserved:  # (its chunks in flight are dropped)
            self._unreserve(save)
        if not save_state or num_computed == 0:
            return
        self._register_blocks(request, progress, num_computed)
        if request.checkpoint_at is not None:
            # A draft model's proposal: its end holds drafts. The next proposal resumes at
            # the checkpoint it saved at `checkpoint_at`, so the one it resumed from
            # (shallower on the same prefix) is the first to evict.
            resumed = progress.resumed
            if progress.saved and resumed is not None and resumed not in progress.saved and \
                    resumed in self._checkpoints:
                self._checkpoints.move_to_end(resumed, last=False)
            return
        if num_computed > min(request.num_tokens, request.cache_limit):
            # A stop among accepted drafts: the state includes drafts after the stop token,
            # which are not the request's tokens. Or the state holds content past the
            # request's `cache_limit`, which an uncached request would not compute.
            return
        final = self._save(request, progress, num_computed, goes_on=False)
        if final is None:
            return
        for checkpoint in progress.saved:
            if checkpoint is not final and not checkpoint.used and checkpoint in self._checkpoints:
                self._checkpoints.move_to_end(checkpoint, last=False)

    def _register_blocks(self, request, progress: _Progress, num_computed: int) -> None:
        """Add the request's full blocks below `num_computed` (and below its known tokens
        and its `cache_limit`) to the trie (an identical block already there stays the
        canonical one; the request keeps its own copy)."""
        node, bs = progress.node, self.block_size
        end = min(num_computed, request.num_tokens, request.cache_limit)
        while node.alive and (node.depth + 1) * bs <= end:
            i = node.depth
            tokens = _token_slice(request, i * bs, (i + 1) * bs)
            child = node.children.get(tokens)
            if child is None:
                block = request.blocks[i]
                child = CachedBlock(block=block, tokens=tokens, parent=node, depth=i + 1)
                node.children[tokens] = child
                self._by_block[block] = child
                self.kv.set_cached(block, True)
            node = child
        progress.node = node

    def _save(self, request, progress: _Progress, position: int, goes_on: bool = True) -> Checkpoint | None:
        """Checkpoint the request's committed state at `position`, unless one is there
        (then that one is returned, as recently used); None if none can be made. The
        checkpoint takes the committed slot itself (`MambaStateAllocator.hand_over`; a
        request that `goes_on` reads it in place until its next row commits)."""
        node = progress.node
        if not node.alive or node.depth != position // self.block_size:
            return None
        tail = _token_slice(request, node.depth * self.block_size, position)
        existing = self._existing(node, tail)
        if existing is not None:
            return existing
        slot = self._free_slot()
        if slot is None:
            return None
        tail_block = -1
        if tail:
            if self.kv.num_free == 0:
                self.mamba.free_checkpoint_slot(slot)
                return None
            tail_block = self.kv.allocate(1)[0]
            if not node.alive:  # allocating evicted the very prefix this would attach to
                self.kv.release((tail_block,))
                self.mamba.free_checkpoint_slot(slot)
                return None
            self.kv.copy_block(request.blocks[node.depth], tail_block)
        slot = self.mamba.hand_over(request.state, slot, goes_on)
        checkpoint = self._add_checkpoint(progress, Checkpoint(position, node, tail, tail_block, slot))
        if tail_block >= 0:
            self._by_block[tail_block] = checkpoint
            self.kv.set_cached(tail_block, True)
            self.kv.release((tail_block,))
        return checkpoint

    def _attach(self, request, progress: _Progress, save: PendingSave) -> None:
        """A retired chunk wrote its state at `save.position` (an interval position, block
        aligned) into `save.slot`: make it a checkpoint there, unless one is there already or
        the prefix was evicted (then the slot goes back)."""
        self._register_blocks(request, progress, save.position)
        node = progress.node
        if not node.alive or node.depth * self.block_size != save.position or self._existing(node, ()) is not None:
            self._unreserve(save)
            return
        self._forget_pending(save)
        self._add_checkpoint(progress, Checkpoint(save.position, node, (), -1, save.slot))

    def _existing(self, node: CachedBlock, tail: tuple[int, ...]) -> Checkpoint | None:
        """The checkpoint with `tail` under `node`, if there is one (now recently used)."""
        existing = node.checkpoints.get(tail)
        if existing is not None:
            self._checkpoints.move_to_end(existing)
        return existing

    def _add_checkpoint(self, progress: _Progress, checkpoint: Checkpoint) -> Checkpoint:
        """Make `checkpoint` findable under its node, newest in the LRU, one of `progress`'s."""
        checkpoint.node.checkpoints[checkpoint.tail] = checkpoint
        self._checkpoints[checkpoint] = None
        progress.saved.append(checkpoint)
        return checkpoint

    def _free_slot(self) -> int | None:
        """A free checkpoint slot, if need be by evicting the least recently used checkpoint
        that no resuming request still reads; None if there is none."""
        slot = self.mamba.take_checkpoint_slot()
        if slot is None:
            victim = next((c for c in self._checkpoints if not self.mamba.is_read(c.slot)), None)
            if victim is None:
                return None  # no checkpoint slots at all, or every one is being read
            self._drop_checkpoint(victim)
            slot = self.mamba.take_checkpoint_slot()
        return slot

    # ---- eviction --------------------------------------------------------------------
    def _drop_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Forget a checkpoint: its slot and its tail block go back to the pools."""
        del self._checkpoints[checkpoint]
        del checkpoint.node.checkpoints[checkpoint.tail]
        self.mamba.free_checkpoint_slot(checkpoint.slot)
        if checkpoint.tail_block >= 0:
            del self._by_block[checkpoint.tail_block]
            self.kv.set_cached(checkpoint.tail_block, False)

    def _on_block_evicted(self, block: int) -> None:
        """The KV pool reuses a cached block: forget what it held (a checkpoint's tail, or a
        node -- then also every node under it and every checkpoint attached to those)."""
        held = self._by_block.pop(block)
        if isinstance(held, Checkpoint):
            held.tail_block = -1  # (the pool already took the block back)
            self._drop_checkpoint(held)
            return
        del held.parent.children[held.tokens]
        stack = [held]
        while stack:
            node = stack.pop()
            node.alive = False
            for checkpoint in list(node.checkpoints.values()):
                self._drop_checkpoint(checkpoint)
            stack.extend(node.children.values())
            if node is not held:
                del self._by_block[node.block]
                self.kv.set_cached(node.block, False)

    @staticmethod
    def _chain(node: CachedBlock) -> list[int]:
        """The blocks from the root to `node`, in order."""
        blocks = []
        while node.parent is not None:
            blocks.append(node.block)
            node = node.parent
        return blocks[::-1]


def _token_slice(request, start: int, end: int) -> tuple[int, ...]:
    """The request's tokens (prompt, then output) in [start, end)."""
    prompt = request.prompt_token_ids
    n = len(prompt)
    if end <= n:
        return tuple(prompt[start:end])
    return tuple(prompt[start:]) + tuple(request.output_token_ids[max(start - n, 0):end - n])
