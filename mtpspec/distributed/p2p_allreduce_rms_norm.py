"""One-kernel ("one-shot") all-reduce + residual add + RMSNorm over peer memory.

A backend of :func:`mtpspec.distributed.allreduce_rms_norm.fused_allreduce_rms_norm` for draft-step
sizes, where an NCCL all-reduce is latency-bound and the norm is a second launch. The engine
installs it on every rank at worker start with ``allreduce_backend="p2p"`` (``--allreduce-backend
p2p``; :func:`~mtpspec.distributed.allreduce_rms_norm.init_allreduce_rms_norm_backend`); by hand:
``register_allreduce_rms_norm_backend(P2PAllReduceRMSNorm(capacity_bytes))`` on every rank.

Protocol (one launch per call; ``W`` ranks; rank ``r``; program ``j`` of ``G``):

1. **Epoch.** Every program reads this rank's call counter ``epoch`` from a device word and
   uses ``e = epoch + 1``, buffer ``b = e mod NUM_BUFFERS``. Each program then adds 1 to an
   arrival word (acq_rel); the last to arrive resets it and stores ``epoch + 1``, after every
   program has read the old value. The counter lives on the device and is advanced by the kernel
   itself, so a call needs no host-side state and a CUDA graph replays it correctly: each replay
   runs the next epoch. All ranks issue the same calls in the same order (as with any
   collective), so their counters agree.
2. **Push.** Program ``j`` copies its rows of ``hidden_states`` into slot ``(b, r)`` of every
   rank's buffer (peer pointers from a table of addresses mapped by
   :mod:`mtpspec.distributed.peer_memory`), then, after a block barrier, writes
   ``e * 2**20 + tag`` into flag ``(b, r, j)`` of every rank with a release store at system
   scope (``atomic_xchg(sem="release", scope="sys")``): the data is visible to a reader that
   sees the flag. ``tag`` (:func:`call_tag`) hashes the call's shape and dtype, so a peer that
   made the same call with another shape is reported, not silently mixed in.
3. **Wait.** Program ``j`` spins on its own flags ``(b, s, j)`` for ``s = 0..W-1`` with acquire
   loads (``atomic_add(0, sem="acquire", scope="sys")``) until each holds its value; a block barrier
   then orders the whole block's data loads after them. The spin is bounded: after
   ``timeout_s`` (the GPU's ``%globaltimer``) or ``max_spins`` tries it gives up, records which
   peer and epoch in a host-visible error word, marks this rank failed (sticky: later calls
   neither push, signal nor wait; they re-raise the error word and write NaN) and writes NaN
   outputs. A peer that stopped signalling makes every rank fail in turn. The host raises
   :class:`PeerTimeoutError` (at once on CPU; on CUDA at the next call or at
   :meth:`P2PAllReduceRMSNorm.check_error`), so a dead peer is an error, not a hang.
4. **Reduce + norm.** Program ``j`` sums slots ``(b, 0) .. (b, W-1)`` of its own buffer in fp32
   in that fixed order (so the result does not depend on arrival order and is bit-identical on
   every rank and every run), adds the residual in fp32, rounds once to the dtype
   (``new_residual``), and applies RMSNorm to the rounded sum with fp32 statistics: the
   convention of :func:`mtpspec.ops.rms_norm.fused_add_rms_norm` (docs/structures.md), with its
   row arithmetic (:mod:`mtpspec.ops.triton_helpers`). The NCCL
   fallback rounds the all-reduced sum before adding the residual, so the two agree within one
   rounding of the dtype.

Why flags, not Lamport sentinels: sentinel values (e.g. ``-0.0`` written as "empty") need every
buffer cleared again after each use (a third buffer and an extra pass), steal a bit pattern from
the data (real ``-0.0`` must be canonicalised, changing bits), and rely on element stores being
seen whole, which the PTX memory model does not promise for a polling reader. A flag per
(buffer, source rank, program) costs one more small store and load per peer, is ordered by the
memory model's release/acquire, and works the same way in Triton's CPU interpreter.

Multi-buffer invariant (``NUM_BUFFERS >= 2``): when rank ``r`` starts call ``e`` it has finished
call ``e - 1``, whose programs each saw peer ``p``'s flag for ``e - 1``; so ``p`` had started call
``e - 1``, hence (stream order on ``p``) finished call ``e - 2`` and every earlier call. Slot
``(e mod NUM_BUFFERS, r)`` of ``p``'s buffer was last read at call ``e - NUM_BUFFERS <= e - 2``:
``r`` never overwrites data or a flag a slow peer may still read (a rank whose wait failed
pushes nothing more, so it cannot run ahead). Flags carry the epoch (int64, ``2**43`` calls
before the tag bits would overflow), so a stale flag (``e - NUM_BUFFERS``) never passes for a
new one. Zero-token calls and calls too big
for the buffers launch nothing and advance no epoch, on every rank alike (the decision depends
only on the shape and dtype, equal on all ranks). Calls of one backend must be ordered on the
device (one stream, eager or graphed).

CUDA graphs: buffers, address tables, counters and the error word are allocated once in the
constructor and never move; a call launches one kernel with no host synchronisation and reads
no device memory from the host, so it can be captured. Capture runs nothing (no epoch is
consumed); every replay runs the next epoch. After replays, call :meth:`check_error`.

Programs: ``G = min(row blocks, max_programs)``; program ``j`` only waits for program ``j`` of
its peers, never for other programs of its own rank, and ``max_programs`` is kept at or below
the GPU's SM count so every program can be resident at once (no program waits for one that
cannot be scheduled). Under the interpreter programs run one after another, which the same
rule makes safe.

Sizes: a call fits when ``num_tokens * hidden_size * element_size <= max_bytes``, with
``max_bytes`` the real size of one (buffer, rank) slot; above it :meth:`accepts` is False and
the dispatcher runs the exact NCCL fallback. Each slot is followed by a guard band that the
constructor fills with a pattern (:meth:`guards_intact` checks it).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from mtpspec.distributed.parallel_state import get_tp_group
from mtpspec.distributed.peer_memory import PeerBuffers, allocate_peer_buffers
from mtpspec.distributed.allreduce_rms_norm import AllReduceRMSNormBackend
from mtpspec.ops.rms_norm import _check
from mtpspec.ops.triton_utils import (FLOAT_DTYPES, HAS_TRITON, MAX_FUSED_HIDDEN, ROWS_TARGET_ELEMS,
                                      LazyKernel, cdiv, interpreting, next_power_of_2,
                                      num_warps_for, tl, use_triton)

if HAS_TRITON:
    from mtpspec.ops.triton_helpers import (rms_norm_pass2, rms_rstd, store_rms_norm_rows,
                                            store_rounded)
    from mtpspec.ops.triton_utils import device_function

#: Least bytes of guard pattern after every data slot (the slot stride rounds up to 256 bytes).
GUARD_BYTES = 64
#: The guard pattern (every guard byte).
GUARD_BYTE = 0xA5
#: Column block of the two-pass path (rows longer than ``max_fused_hidden``).
LOOP_BLOCK_N = 4096
#: Interpreter spin pace used to turn ``timeout_s`` into a spin count (measured: ~0.5 ms/spin).
INTERPRETER_SECONDS_PER_SPIN = 5e-4
#: Error-word layout (int64): failed flag, peer that did not arrive, epoch, program, this rank,
#: the flag value last seen from that peer, this call's tag.
ERR_FAILED, ERR_PEER, ERR_EPOCH, ERR_PROGRAM, ERR_RANK, ERR_SEEN, ERR_TAG = range(7)
#: Flags hold ``epoch * 2**TAG_BITS + tag``, the tag a hash of the call's shape and dtype.
TAG_BITS = 20
#: Device-state layout (int64): call counter, arrivals of the current launch, sticky failure.
STATE_EPOCH, STATE_ARRIVALS, STATE_FAILED = range(3)


class PeerTimeoutError(RuntimeError):
    """A peer's data did not arrive within the bounded wait (a failed, stuck or absent rank,
    or ranks calling the backend in different orders).

    Attributes:
        outputs: when raised right after the failing launch (CPU), that call's
            ``(normed, new_residual)``, which are all NaN; otherwise ``None``.
    """

    outputs: Optional[Tuple[torch.Tensor, torch.Tensor]] = None


if HAS_TRITON:
    @device_function
    def _reduce_block(own, slot_stride, res_ptr, res_out_ptr, rows, cols, mask, n_cols, stride_res,
                      poison, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BF16_BY_BITS: tl.constexpr):
        # Columns `cols` of rows `rows`: the slots of ranks 0..WORLD-1 summed in fp32 in that order
        # (+ poison: NaN after a failed wait), + residual, rounded once and written to res_out;
        # returned in fp32, zero where masked off. Slots are read through L2 (.cg): peers wrote
        # them from other GPUs / processes.
        s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + poison
        for src in tl.static_range(WORLD):
            s += tl.load(own + (src * slot_stride).to(tl.int64) + rows[:, None] * n_cols + cols[None, :],
                         mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
        return tl.where(mask, store_rounded(res_out_ptr, rows, n_cols, cols, s, mask, BF16_BY_BITS), 0.0)

    def _p2p_allreduce_rms_norm_kernel(
            x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
            data_table, flag_table, state_ptr, err_ptr,
            n_rows, n_cols, stride_x, stride_res, eps, rank, slot_stride, timeout_ns, max_spins,
            call_tag, WORLD: tl.constexpr, NUM_BUFFERS: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BF16_BY_BITS: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
        # data_table / flag_table: int64 [WORLD], addresses (in this process) of every rank's
        # data slots and flags. Slot (b, s) starts slot_stride elements * (b * WORLD + s) in;
        # flag (b, s, j) is int64 index (b * WORLD + s) * MAX_PROGRAMS + j.
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        # 1. Epoch: read, then arrive; the last program to arrive advances the counter.
        # state: [0] call counter, [1] arrivals of this launch, [2] sticky failure (STATE_*).
        epoch = tl.load(state_ptr)
        failed = tl.load(state_ptr + 2)
        arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if arrived == n_prog - 1:
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, epoch + 1)
        e = epoch + 1
        buf = e % NUM_BUFFERS
        # A flag holds epoch * 2**20 + a 20-bit tag of (shape, dtype): a peer at the same epoch
        # with a different shape never passes for a match.
        fv = e * 1048576 + call_tag
        dt = x_ptr.dtype.element_ty
        n_blocks = tl.cdiv(n_rows, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        ok = failed == 0
        if failed != 0:
            tl.store(err_ptr, 1)  # sticky: keep the host's error word raised
        if ok:
            # 2. Push this program's rows into slot (buf, rank) of every rank, then signal.
            src_off = (buf * WORLD + rank).to(tl.int64) * slot_stride
            for rb in range(pid, n_blocks, n_prog):
                rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
                row_mask = rows < n_rows
                rows = rows.to(tl.int64)
                for start in range(0, n_cols, BLOCK_N):
                    c = start + cols
                    mask = row_mask[:, None] & (c < n_cols)[None, :]
                    v = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask)
                    for i in tl.static_range(WORLD):
                        p = (rank + i) % WORLD  # staggered: ranks do not all start on one peer
                        # Buffers are 256-byte aligned (allocator, mmap); slots 256-byte multiples.
                        dst = tl.multiple_of(tl.load(data_table + p).to(tl.pointer_type(dt)), 16)
                        tl.store(dst + src_off + rows[:, None] * n_cols + c[None, :], v, mask=mask)
            tl.debug_barrier()
            for i in tl.static_range(WORLD):
                p = (rank + i) % WORLD
                flag = tl.load(flag_table + p).to(tl.pointer_type(tl.int64))
                tl.atomic_xchg(flag + (buf * WORLD + rank) * MAX_PROGRAMS + pid, fv,
                               sem="release", scope="sys")
            # 3. Wait (bounded) for every rank's flag of this epoch on this program's slot.
            my_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int64))
            t0 = 0
            if USE_GLOBALTIMER:  # %globaltimer: a nanosecond clock (CUDA only)
                t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid],
                                               dtype=tl.int64, is_pure=False, pack=1)
            for s in tl.static_range(WORLD):
                fp = my_flags + (buf * WORLD + s) * MAX_PROGRAMS + pid
                seen = tl.atomic_add(fp, 0, sem="acquire", scope="sys")
                spins = 0
                waited = t0 - t0  # int64 0 with the timer, a constant 0 without
                while (seen != fv) & (spins < max_spins) & (waited <= timeout_ns):
                    seen = tl.atomic_add(fp, 0, sem="acquire", scope="sys")
                    spins += 1
                    if USE_GLOBALTIMER:
                        waited = tl.inline_asm_elementwise(
                            "mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64,
                            is_pure=False, pack=1) - t0
                if seen != fv:
                    # err: [0] failed, [1] peer, [2] epoch, [3] program, [4] rank, [5] the flag
                    # value last seen, [6] this call's tag (ERR_*).
                    tl.store(state_ptr + 2, 1)
                    tl.store(err_ptr + 1, s)
                    tl.store(err_ptr + 2, e)
                    tl.store(err_ptr + 3, pid)
                    tl.store(err_ptr + 4, rank)
                    tl.store(err_ptr + 5, seen)
                    tl.store(err_ptr + 6, call_tag)
                    tl.store(err_ptr, 1)
                ok = ok & (seen == fv)
            tl.debug_barrier()
        # 4. Reduce in rank order 0..WORLD-1 (fp32), add the residual, round once, normalise.
        # Slots are read through L2 (.cg): peers wrote them from other GPUs / processes.
        poison = tl.where(ok, 0.0, float("nan"))
        own = tl.multiple_of(tl.load(data_table + rank).to(tl.pointer_type(dt)), 16) \
            + (buf * WORLD).to(tl.int64) * slot_stride
        for rb in range(pid, n_blocks, n_prog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            rows = rows.to(tl.int64)
            if ONE_PASS:
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                s = _reduce_block(own, slot_stride, res_ptr, res_out_ptr, rows, cols, mask, n_cols,
                                  stride_res, poison, WORLD, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BF16_BY_BITS)
                store_rms_norm_rows(out_ptr, w_ptr, rows, n_cols, cols, col_mask, mask, s, n_cols, eps,
                                    BF16_BY_BITS)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK_N):
                    c = start + cols
                    mask = row_mask[:, None] & (c < n_cols)[None, :]
                    s = _reduce_block(own, slot_stride, res_ptr, res_out_ptr, rows, c, mask, n_cols,
                                      stride_res, poison, WORLD, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BF16_BY_BITS)
                    acc += s * s
                rstd = rms_rstd(acc, n_cols, eps)
                # Pass 2 reads back this block's own res_out stores.
                rms_norm_pass2(res_out_ptr, n_cols, out_ptr, w_ptr, rows, row_mask, n_cols, cols,
                               n_cols, rstd, BLOCK_N, BF16_BY_BITS)

    _kernel = LazyKernel(_p2p_allreduce_rms_norm_kernel)

    def _touch_kernel(ptr):
        tl.store(ptr + 7, tl.load(ptr + 7))

    _touch = LazyKernel(_touch_kernel)


def call_tag(num_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """A :data:`TAG_BITS`-bit hash of a call's shape and dtype, carried in every flag."""
    code = FLOAT_DTYPES.index(dtype) + 1
    h = (num_tokens * 0x9E3779B1 + hidden_size * 0x85EBCA77 + code * 0xC2B2AE3D) & 0xFFFFFFFF
    return (h ^ (h >> 15)) & ((1 << TAG_BITS) - 1)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class P2PAllReduceRMSNorm(AllReduceRMSNormBackend):
    """One-shot all-reduce + residual + RMSNorm in one Triton kernel over peer memory.

    Construct on every rank of the TP group (a collective: it allocates and maps the peer
    buffers), then ``register_allreduce_rms_norm_backend(backend)`` on every rank. Requires the
    ranks to share a host (CUDA IPC between GPUs of one node, or several ranks on one GPU; CPU
    shared memory under Triton's interpreter for tests).

    Args:
        capacity_bytes: the largest ``hidden_states`` (``num_tokens * hidden_size *
            element_size`` bytes) a call may carry; rounded up to 16 bytes, which becomes
            :attr:`max_bytes`. Memory per rank: ``num_buffers * world_size`` slots of
            ``max_bytes + 64`` rounded up to 256 bytes, plus flags.
        num_buffers: buffers used in rotation, ``>= 2`` (two suffice: see the module's invariant).
        timeout_s: how long a wait for a peer may last before the call fails with
            :class:`PeerTimeoutError` (GPU: time from ``%globaltimer``; interpreter: turned
            into a spin count at :data:`INTERPRETER_SECONDS_PER_SPIN`). Must exceed the longest
            expected skew between ranks (on one GPU shared by time-sliced processes, several
            scheduler time slices).
        max_spins: an upper bound on spin iterations per wait, in addition to ``timeout_s``;
            ``None``: on the GPU ``timeout_s * 1e8`` (a safety net behind the clock), on CPU the
            interpreter's count from ``timeout_s``.
        max_programs: most programs (thread blocks) per launch; default ``min(128, SM count)`` on
            CUDA, 128 on CPU. Kept at or below the SM count so all can be resident.
        max_block_rows: most rows a program handles at once (default: as many as fit
            ``ROWS_TARGET_ELEMS`` elements, at most 64).
        max_fused_hidden: longest row kept whole in registers; longer rows take two passes over
            column blocks of :data:`LOOP_BLOCK_N` (default ``MAX_FUSED_HIDDEN``).
        device: this rank's device; default the TP group's.

    Raises:
        ValueError: a bad argument. RuntimeError: peer memory could not be set up.
    """

    name = "p2p_oneshot+rms_norm"

    def __init__(self, capacity_bytes: int, num_buffers: int = 2, *, timeout_s: float = 30.0,
                 max_spins: Optional[int] = None, max_programs: Optional[int] = None,
                 max_block_rows: Optional[int] = None, max_fused_hidden: int = MAX_FUSED_HIDDEN,
                 device: Optional[torch.device] = None):
        if not HAS_TRITON:
            raise RuntimeError("P2PAllReduceRMSNorm needs Triton")
        if int(capacity_bytes) < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if int(num_buffers) < 2:
            raise ValueError(f"num_buffers must be >= 2 (a slow peer may still read the previous "
                             f"call's buffer), got {num_buffers}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if max_spins is not None and int(max_spins) < 1:
            raise ValueError(f"max_spins must be >= 1 or None, got {max_spins}")
        if max_block_rows is not None and int(max_block_rows) < 1:
            raise ValueError(f"max_block_rows must be >= 1 or None, got {max_block_rows}")
        if int(max_fused_hidden) < 1:
            raise ValueError(f"max_fused_hidden must be >= 1, got {max_fused_hidden}")
        tp = get_tp_group()
        self.device = torch.device(device) if device is not None else tp.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size = tp.rank_in_group, tp.world_size
        self.num_buffers = int(num_buffers)
        self.timeout_s = float(timeout_s)
        self.max_spins = None if max_spins is None else int(max_spins)
        self.max_block_rows = None if max_block_rows is None else int(max_block_rows)
        self.max_fused_hidden = int(max_fused_hidden)
        if max_programs is None:
            max_programs = 128
            if self.device.type == "cuda":
                max_programs = min(max_programs, torch.cuda.get_device_properties(self.device).multi_processor_count)
        if int(max_programs) < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.max_programs = int(max_programs)
        # Layout of every rank's buffer: data slots (b, s), each followed by a guard band; flags.
        self.max_bytes = _round_up(int(capacity_bytes), 16)
        # 256-byte slot stride: every slot start is 16-byte aligned and a multiple of 16 elements
        # for every dtype (vectorised stores and loads; the kernel asserts it with multiple_of).
        self.slot_stride_bytes = _round_up(self.max_bytes + GUARD_BYTES, 256)
        data_bytes = self.num_buffers * self.world_size * self.slot_stride_bytes
        self.flag_offset = _round_up(data_bytes, 128)
        nbytes = self.flag_offset + self.num_buffers * self.world_size * self.max_programs * 8
        self.peers: PeerBuffers = allocate_peer_buffers(nbytes, self.device)
        if self.peers.rank != self.rank or self.peers.world_size != self.world_size:
            raise RuntimeError(f"peer memory ranks ({self.peers.rank} of {self.peers.world_size}) "
                               f"differ from the TP group's ({self.rank} of {self.world_size})")
        self._guards().fill_(GUARD_BYTE)
        self._data_table = self.peers.address_table(0)
        self._flag_table = self.peers.address_table(self.flag_offset)
        # Device state (call counter, arrivals, sticky failure) and the error word, which lives
        # in pinned host memory on CUDA (mapped into the GPU's address space), so the host
        # reads it without synchronising; on device memory if this GPU cannot map it.
        self._state = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._err = torch.zeros(8, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.error_word_on_host = True
        self._err_np = self._err.numpy()
        if self.device.type == "cuda":
            try:
                _touch[(1,)](self._err)
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a launcher that refuses host pointers
                self._err = torch.zeros(8, dtype=torch.int64, device=self.device)
                self.error_word_on_host = False
                self._err_np = None
            torch.cuda.synchronize(self.device)
        if self.world_size > 1:
            dist.barrier(group=tp.device_group)  # guards filled everywhere before any call
        self.calls = 0
        self.closed = False

    # -- layout ------------------------------------------------------------------------------
    def _guards(self) -> torch.Tensor:
        """This rank's guard bands, uint8 ``[num_buffers * world_size, slot_stride - max_bytes]``."""
        own = self.peers.buffers[self.rank]
        n_slots = self.num_buffers * self.world_size
        return own[:n_slots * self.slot_stride_bytes].view(n_slots, self.slot_stride_bytes)[:, self.max_bytes:]

    def guards_intact(self) -> bool:
        """Whether every guard band after this rank's data slots still holds the pattern (no
        rank ever wrote past a slot). Synchronises on CUDA."""
        return bool((self._guards() == GUARD_BYTE).all().item())

    # -- dispatch ----------------------------------------------------------------------------
    def accepts(self, hidden_states: torch.Tensor) -> bool:
        """True when ``hidden_states`` fits one slot (``numel * element_size <= max_bytes``), is a
        2-D fp16/bf16/fp32 tensor with unit column stride on this backend's device, and the
        kernel can run (CUDA, or CPU under ``TRITON_INTERPRET=1``; no autograd). The answer
        depends only on the shape, dtype and device, so every rank takes the same path."""
        h = hidden_states
        if self.closed or h.dim() != 2 or h.dtype not in FLOAT_DTYPES or h.device != self.device:
            return False
        if h.shape[1] > 1 and h.stride(1) != 1:
            return False
        if h.numel() * h.element_size() > self.max_bytes:
            return False
        return use_triton(h)

    def _spin_bounds(self) -> Tuple[int, int, bool]:
        """(max_spins, timeout_ns, use the GPU clock) for this launch mode."""
        if self.device.type == "cuda" and not interpreting():
            # Safety net should the clock misbehave: a spin (a system-scope acquire load) takes
            # well over 10 ns, so this count outlasts timeout_s.
            spins = self.max_spins if self.max_spins is not None else max(1, int(self.timeout_s * 1e8))
            return spins, int(self.timeout_s * 1e9), True
        spins = max(1, int(self.timeout_s / INTERPRETER_SECONDS_PER_SPIN))
        if self.max_spins is not None:
            spins = min(spins, self.max_spins)
        return spins, 2 ** 62, False

    def _launch_shape(self, n_rows: int, n_cols: int, elem_bytes: int) -> Tuple[int, int, bool, int, int]:
        """(block_m, block_n, one_pass, num_warps, programs) for ``n_rows x n_cols``."""
        block_n = next_power_of_2(n_cols)
        if n_cols <= self.max_fused_hidden:
            block_m = min(64, max(1, ROWS_TARGET_ELEMS // block_n), next_power_of_2(n_rows))
            one_pass = True
        else:
            block_m, block_n, one_pass = 1, min(LOOP_BLOCK_N, next_power_of_2(self.max_fused_hidden)), False
        if self.max_block_rows is not None:
            block_m = min(block_m, next_power_of_2(self.max_block_rows + 1) // 2)
        programs = min(cdiv(n_rows, block_m), self.max_programs)
        return block_m, block_n, one_pass, num_warps_for(block_m * block_n, elem_bytes), programs

    def check_error(self, synchronize: bool = True) -> None:
        """Raise :class:`PeerTimeoutError` if a launch of this backend gave up waiting for a
        peer. ``synchronize``: wait for this rank's queued work first (CUDA), so launches
        already issued (e.g. CUDA graph replays) are covered."""
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._err_np is not None:
            err = self._err_np
        elif synchronize:
            err = self._err.cpu().numpy()
        else:
            return
        if err[ERR_FAILED]:
            spins, timeout_ns, use_timer = self._spin_bounds()
            bound = f"{timeout_ns / 1e9:g} s or {spins} spins" if use_timer else f"{spins} spins"
            epoch, seen = int(err[ERR_EPOCH]), int(err[ERR_SEEN])
            seen_epoch, seen_tag = seen >> TAG_BITS, seen & ((1 << TAG_BITS) - 1)
            if seen_epoch == epoch and seen_tag != int(err[ERR_TAG]):
                why = ("it made this call with a different shape or dtype (ranks must pass "
                       "hidden_states of the same [num_tokens, hidden_size] and dtype)")
            else:
                why = (f"its last signal here was for call {seen_epoch}: it failed, stopped, is "
                       "still far behind, or called the backend in a different order")
            raise PeerTimeoutError(
                f"p2p all-reduce + RMSNorm: rank {int(err[ERR_RANK])} gave up waiting for rank "
                f"{int(err[ERR_PEER])} at call {epoch} (program {int(err[ERR_PROGRAM])}) after "
                f"{bound}; {why}. Outputs of that call and of every later call of this backend "
                f"are NaN; rebuild the backend on all ranks.")

    def __call__(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                 weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(s), s)`` with ``s = round(sum over ranks of hidden_states + residual)``.

        Args:
            hidden_states: ``[num_tokens, hidden_size]`` this rank's partial sum, fp16 / bf16 /
                fp32, unit column stride, accepted by :meth:`accepts`.
            residual: ``None`` (never read) or ``[num_tokens, hidden_size]`` in the same dtype.
            weight: ``[hidden_size]`` RMSNorm weight. eps: RMSNorm epsilon (>= 0).

        Returns:
            ``(normed, new_residual)``, fresh contiguous ``[num_tokens, hidden_size]`` tensors in
            ``hidden_states``' dtype, bit-identical on every rank.

        Raises:
            ValueError / TypeError: bad inputs, or inputs :meth:`accepts` refuses.
            PeerTimeoutError: a peer did not arrive (CPU: this call; CUDA: an earlier call).
        """
        x2, r2 = _check(hidden_states, residual, weight, eps)
        if not self.accepts(x2):
            raise ValueError(f"{self.name}: hidden_states {tuple(x2.shape)} {x2.dtype} on {x2.device} "
                             f"is not accepted (max {self.max_bytes} bytes on {self.device}); "
                             "dispatch through fused_allreduce_rms_norm to get the fallback")
        self.check_error(synchronize=False)
        n_rows, n_cols = x2.shape
        out = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
        r_out = torch.empty_like(out)
        if n_rows == 0:
            return out, r_out
        block_m, block_n, one_pass, num_warps, programs = self._launch_shape(n_rows, n_cols, x2.element_size())
        max_spins, timeout_ns, use_timer = self._spin_bounds()
        _kernel[(programs,)](
            x2, r2 if r2 is not None else x2, weight, out, r_out,
            self._data_table, self._flag_table, self._state, self._err,
            n_rows, n_cols, x2.stride(0), r2.stride(0) if r2 is not None else 0, float(eps),
            self.rank, self.slot_stride_bytes // x2.element_size(), timeout_ns, max_spins,
            call_tag(n_rows, n_cols, x2.dtype), WORLD=self.world_size, NUM_BUFFERS=self.num_buffers, MAX_PROGRAMS=self.max_programs,
            HAS_RESIDUAL=r2 is not None, ONE_PASS=one_pass, BLOCK_M=block_m, BLOCK_N=block_n,
            BF16_BY_BITS=interpreting() and x2.dtype == torch.bfloat16, USE_GLOBALTIMER=use_timer,
            num_warps=num_warps)
        self.calls += 1
        if self.device.type == "cpu":
            try:
                self.check_error(synchronize=False)
            except PeerTimeoutError as exc:
                exc.outputs = (out, r_out)
                raise
        return out, r_out

    def close(self) -> None:
        """Release the peer mappings (every rank, after its last call has finished); the
        backend then accepts nothing (unregister it first)."""
        self.closed = True
        self.peers.close()
