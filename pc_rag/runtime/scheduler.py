"""Continuous batching: requests from many threads, decoded together, one token each per step.

One worker thread owns decoding. Between steps it admits waiting requests (up to ``max_batch`` live): each is
spliced into a buffer of its own and their new tokens run in one packed pass (``BatchPrefill``; a request with
a recovery refresh is prefilled alone, ``executor.prefill``), and its first token is sampled. Its shareable,
unrefreshed parts are acquired from the ``SharedKVPool`` (one copy for every request that imports them; the pool
starts at ``shared_tokens`` and grows to what ``max_batch`` requests of the model's context can hold) and the
rest of its KV is copied into a row of the ``PrivateArena``; its buffer goes back to the pool. Each step then
runs ``BatchDecodeStep`` over all live rows: the weights are read once per step, and shared KV once per step.
Torch's threads follow the free cores (``--threads auto``) before the calls it runs (``call``), at each admission
and every ``threads.ADAPT_EVERY`` batched steps, the pace of a request decoded alone: a batch on a busy machine
keeps no thread the load took. Requests whose model calls run inside a context (a splice adapter applied: the
default mode ``fast``) are prefilled and decoded the same way, inside it: rows whose calls share a context
(``ModelCall.context_key``) run in one step, and each other context gets a step of its own over its rows. A
request the batched step cannot serve (a model it does not describe, a call with attention kwargs such as
calibration, teacher-forced scoring) is served alone, advanced between the batched steps.

Tokens reach the caller's thread through a queue; detokenizing, stop strings and timing run there
(``run_generation``). A caller that stops reading (a stop string, an abandoned stream) or calls
``Submitted.cancel`` (an HTTP client gone) cancels its request: a waiting one is dropped, a live one frees its
row at its next step.
When ``queue_limit`` requests are waiting, ``submit`` refuses with ``ServerBusyError``: nothing is dropped
silently. This module knows nothing about PML, chunks or HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from pc_rag.errors import KVPoolFullError, PCRagError, ServerBusyError
from pc_rag.kv import BufferPool, SpanKV, kv_shape
from pc_rag.model import LoadedModel
from pc_rag.runtime.arena import PrivateArena
from pc_rag.runtime.batch_prefill import BatchPrefill, PrefillJob
from pc_rag.runtime.batch_step import BatchDecodeStep, SharedRead
from pc_rag.runtime.executor import Prefilled, execute, prefill, splice_request
from pc_rag.runtime.generate import GenerationResult, ReplyStream, eos_ids, run_generation, sample
from pc_rag.runtime.model_call import ModelCall
from pc_rag.runtime.request import Request
from pc_rag.runtime.shared_pool import CHUNK_TOKENS, Segment, SharedKVPool
from pc_rag.runtime.submission import END, Entry, Started, Submitted
from pc_rag.runtime.threads import adapt_threads, adapt_threads_at

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class _Live:
    """A request decoding in the batch: its arena row, shared segments, sampler and the token it feeds next."""

    entry: Entry
    row: int
    segments: list[Segment]
    generator: torch.Generator | None
    call: ModelCall  # how its decode steps call the model (their context: ``call.context_key``)
    step: int = 0  # tokens emitted so far
    token: int = 0  # the last one, fed to the next step


class Scheduler:
    """Continuous batching on one model; ``submit`` and ``stream`` are thread-safe. See the module docstring."""

    def __init__(
        self, lm: LoadedModel, buffers: BufferPool | None = None, *, max_batch: int = 16, queue_limit: int = 64,
        shared_tokens: int = 8192,
    ) -> None:  # fmt: skip
        self.lm = lm
        self.buffers = buffers or BufferPool(lm.model)
        self.max_batch, self.queue_limit = max_batch, queue_limit
        self.stop_ids = eos_ids(lm.model, lm.tokenizer)
        layers, heads, dim = kv_shape(lm.model)
        chunks = -(-shared_tokens // CHUNK_TOKENS)
        most = max(chunks, max_batch * -(-lm.max_positions // CHUNK_TOKENS))  # every live request's whole context
        self.pool = SharedKVPool(layers, heads, dim, chunks=chunks, max_chunks=most, dtype=lm.dtype, device=lm.device)
        self.arena = PrivateArena(layers, heads, dim, rows=max_batch, dtype=lm.dtype, device=lm.device)
        self._step = BatchDecodeStep.of(lm.model)
        self.batch_steps = 0  # batched decode steps run (each paces the thread policy as one alone decode step does)
        self._prefill = BatchPrefill.of(lm.model)
        self._waiting: deque[Entry] = deque()
        self._rows: list[_Live] = []  # by arena row
        self._alone: list[tuple[Entry, Iterator[str | GenerationResult]]] = []
        self._lock = threading.Condition()
        self._calls: list[tuple[Callable[[], object], Future[object]]] = []
        self._closed = False
        self._worker: threading.Thread | None = None
        self.peak_kv_bytes = (0, 0)  # ``kv_bytes`` when the most requests shared the pool
        self.served: Counter[str] = Counter()  # requests admitted "batched" and "alone"
        self.widest_step = 0  # the most rows one batched decode step has run

    def stream(self, request: Request) -> ReplyStream:
        """Submit ``request`` and stream its reply (text deltas; ``.result`` at the end)."""
        return ReplyStream(self.submit(request))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> int:
        """Requests queued, not yet admitted."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests admitted and not finished: the batch's rows and those served alone."""
        return len(self._rows) + len(self._alone)

    def submit(self, request: Request) -> Submitted:
        """Queue ``request``; iterate the result for text deltas, then its ``GenerationResult``.

        Raises ``ServerBusyError`` when ``queue_limit`` requests are already waiting."""
        batched = self._shares_step(request.calls.later([])) and request.reference_ids is None
        entry = Entry(request, batched)
        with self._lock:
            if self._closed:
                raise PCRagError("the scheduler is closed")
            if len(self._waiting) >= self.queue_limit:
                msg = f"{len(self._waiting)} requests are waiting (queue limit {self.queue_limit}); retry later"
                raise ServerBusyError(msg)
            self._waiting.append(entry)
            self._start()
            self._lock.notify()
        return Submitted(self._replies(entry), entry.tokens.cancelled)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker thread between decode steps and return its result (or raise its error).

        Model work done outside the worker (encoding, a request served without batching) belongs here. torch's CPU
        threads are fastest when one thread drives them all: each thread that runs a parallel op gets OpenMP
        threads of its own, and once they outnumber the cores OpenMP stops spinning and every small op pays a
        wake-up (measured here: a 16-row decode step 126 ms on one driving thread, 175-200 ms with two)."""
        if threading.current_thread() is self._worker:  # already on the worker: waiting for it would never end
            return fn()
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise PCRagError("the scheduler is closed")
            self._calls.append((fn, future))  # type: ignore[arg-type]
            self._start()
            self._lock.notify()
        return future.result()

    def close(self) -> None:
        """Stop the worker; requests not finished get a ``PCRagError``."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()

    def run(self, driver: Callable[[], T]) -> T:
        """Serve on the calling thread while ``driver`` runs on another; close and return its result when it ends.

        For programs that own their main thread (the CLI's benchmarks and server): the thread that loaded the
        model keeps driving torch, and ``driver`` (which submits requests, or runs an HTTP server) does no model
        work of its own but through ``submit`` and ``call``."""
        result: Future[T] = Future()

        def drive() -> None:
            try:
                result.set_result(driver())
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
                result.set_exception(e)
            finally:
                with self._lock:
                    self._closed = True
                    self._lock.notify()

        with self._lock:
            if self._worker is not None or self._closed:
                raise PCRagError("the scheduler is already running or closed")
            self._worker = threading.current_thread()
        thread = threading.Thread(target=drive, name="pc-rag-driver")
        thread.start()
        self._run()
        thread.join()
        return result.result()

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes the pool holds for live requests' shared segments, bytes those segments would take duplicated
        in every request that reads them)."""
        with self._lock:
            return self._kv_bytes()

    def kv_memory(self) -> dict[str, Callable[[], int]]:
        """Readers of the KV bytes held, by kind: the shared pool's live segments, the private arena's rows."""
        arena = self.arena
        return {
            "shared_pool": self.pool.held_bytes,
            "arena": lambda: arena.keys.nbytes + arena.values.nbytes,
        }

    def _shares_step(self, call: ModelCall) -> bool:
        """Whether the batched step can run ``call``: one without attention kwargs (its context, an adapter applied
        to the linear modules, acts inside the step: a merged adapter's term is added to the fused kernels' rows, and
        a layer a hook acts on runs as its module, ``decode_step.kernel_corrections``)."""
        return self._step is not None and not call.kwargs

    def _kv_bytes(self) -> tuple[int, int]:
        tokens = sum(s.length for live in self._rows for s in live.segments)
        return self.pool.held_bytes(), tokens * self.pool.chunk_bytes // CHUNK_TOKENS

    def _start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="pc-rag-scheduler", daemon=True)
            self._worker.start()

    def _replies(self, entry: Entry) -> Iterator[str | GenerationResult]:
        tokens = entry.tokens
        try:
            first = tokens.queue.get()
            if isinstance(first, BaseException):
                raise first
            if first is END:  # cancelled before it was admitted
                return
            if not entry.batched:  # served alone: the worker forwards the executor's items
                item = first
                while item is not END:
                    assert isinstance(item, str | GenerationResult)
                    yield item
                    item = tokens.queue.get()
                    if isinstance(item, BaseException):
                        raise item
                return
            assert isinstance(first, Started)
            request = entry.request
            yield from run_generation(
                tokens, self.lm.tokenizer, request.params, request.watch, first.logits, *first.counts
            )
        finally:
            tokens.cancelled.set()

    @torch.inference_mode()
    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._rows or self._alone or self._calls or self._closed):
                    self._lock.wait()
                if self._closed:
                    break
                room = self.max_batch - len(self._rows) - len(self._alone)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                calls, self._calls = self._calls, []
            for entry in [e for e in admitted if e.tokens.cancelled.is_set()]:  # its caller left while it waited
                admitted.remove(entry)
                entry.tokens.queue.put(END)
            if calls:  # building requests is model work too (a conversation's prefix, chunk KV): at today's threads
                adapt_threads()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - the caller's own failure, raised in its thread
                        future.set_exception(e)
            try:
                self._admit_all(admitted)
                self._step_batch()
                self._step_alone()
            except Exception as e:  # a failure of the scheduler itself: every live request learns of it, none hangs
                logger.exception("scheduler step failed")
                self._fail_all(e, admitted)
        closed = PCRagError("the scheduler is closed")
        self._fail_all(closed)
        with self._lock:
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(closed)

    def _admit_all(self, entries: list[Entry]) -> None:
        """Admit ``entries``: the batched ones without recovery prefill packed together (one pass per context their
        first call runs in), the others one by one."""
        packed: dict[object, list[Entry]] = {}
        for entry in entries:
            request = entry.request
            if entry.batched and self._prefill is not None and request.refresh is None and request.new_ids:
                first = request.calls.first([])
                if not first.kwargs:
                    packed.setdefault(first.context_key, []).append(entry)
                    continue
            try:
                self._admit(entry)
            except Exception as e:  # noqa: BLE001 - the request's own failure (too long, bad input): its caller raises it
                entry.tokens.queue.put(e)
        for group in packed.values():
            self._admit_packed(group)

    def _admit_packed(self, entries: list[Entry]) -> None:
        """Prefill ``entries`` (their first calls share a context) in one packed pass inside that context."""
        spliced = []
        for entry in entries:
            try:
                spliced.append((entry, *splice_request(self.lm, self.buffers, entry.request)))
            except Exception as e:  # noqa: BLE001 - as above
                entry.tokens.queue.put(e)
        if not spliced:
            return
        adapt_threads()  # as ``executor.prefill`` does for a request prefilled alone
        try:
            assert self._prefill is not None
            jobs = [PrefillJob(buffer, n, e.request.new_ids, e.request.new_positions) for e, buffer, n in spliced]
            with entries[0].request.calls.first([]).context():
                logits = self._prefill(jobs)
        except Exception as e:  # noqa: BLE001 - the packed forward failed: each of its requests learns why
            for entry, buffer, _ in spliced:
                self.buffers.release(buffer)
                entry.tokens.queue.put(e)
            return
        for (entry, buffer, n), first in zip(spliced, logits, strict=True):
            length = n + len(entry.request.new_ids)
            self._join(entry, Prefilled(entry.request, buffer, buffer.cache(length), length, first, []))

    def _admit(self, entry: Entry) -> None:
        if not entry.batched:
            items = execute(self.lm, self.buffers, entry.request, self.stop_ids)
            with self._lock:
                self._alone.append((entry, items))
                self.served["alone"] += 1
            return
        self._join(entry, prefill(self.lm, self.buffers, entry.request))

    def _join(self, entry: Entry, done: Prefilled) -> None:
        """Move a prefilled request into the batch: shared parts into the pool, the rest into an arena row."""
        try:
            segments, private = self._split(done)
            buffer = done.buffer
            index = torch.as_tensor(private, dtype=torch.long, device=buffer.keys.device)
            keys, values = buffer.keys[:, 0].index_select(2, index), buffer.values[:, 0].index_select(2, index)
        finally:
            self.buffers.release(done.buffer)
        params = entry.request.params
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        call = entry.request.calls.later(done.recomputed)
        assert self._shares_step(call), "a batched request's decode call changed with its recomputed entries"
        # float32 on the CPU here: a conversion on the caller's thread would start torch threads of its own there
        entry.tokens.queue.put(Started(done.logits.float().cpu(), done.counts))
        with self._lock:
            live = _Live(entry, self.arena.admit(keys, values), segments, generator, call)
            self._rows.append(live)
            self.served["batched"] += 1
            self.peak_kv_bytes = max(self.peak_kv_bytes, self._kv_bytes(), key=lambda held_dup: held_dup[1])
        self._emit(live, done.logits)

    def _split(self, done: Prefilled) -> tuple[list[Segment], list[int]]:
        """The request's shared segments (acquired in the pool) and the cache indices of the rest of its KV."""
        buffer, recomputed = done.buffer, set(done.recomputed)
        segments, private, offset = [], [], 0
        for part in done.request.parts:
            end = offset + part.kv.length
            span = range(offset, end)
            shared = None
            if part.share is not None and span and not recomputed.intersection(span):
                kv = SpanKV(buffer.keys[:, 0, :, offset:end], buffer.values[:, 0, :, offset:end], part.kv.positions)
                try:
                    shared = self.pool.acquire(part.share, kv)
                except KVPoolFullError:
                    logger.info("shared pool full: a part of %d tokens stays private", len(span))
            if shared is not None:
                segments.append(shared)
            else:
                private.extend(span)
            offset = end
        private.extend(range(offset, done.length))
        return segments, private

    def _emit(self, live: _Live, logits: torch.Tensor, greedy: int | None = None) -> None:
        """Sample the next token of ``live`` from ``logits`` [V] (``greedy``: their argmax, if known) and send it;
        retire the request when it ends."""
        params, tokens = live.entry.request.params, live.entry.tokens
        if live.step < params.keep_logits:
            tokens.step_logits.append(logits)
        token = greedy if greedy is not None and params.temperature == 0 else sample(logits, params, live.generator)
        if tokens.cancelled.is_set() or token in self.stop_ids:
            self._retire(live)
            return
        tokens.queue.put(token)
        live.step += 1
        live.token = token
        if live.step == params.max_new_tokens:
            self._retire(live)

    def _retire(self, live: _Live) -> None:
        live.entry.tokens.queue.put(END)
        with self._lock:
            moved = self.arena.retire(live.row)
            if moved is not None:
                self._rows[live.row] = self._rows[moved]
                self._rows[live.row].row = live.row
            self._rows.pop()
        for segment in live.segments:
            self.pool.release(segment)

    def _step_batch(self) -> None:
        """One decode step of every live row: one batched forward per context the rows' calls run in (usually one),
        each inside its context; then every row's next token is sampled."""
        if not self._rows:
            return
        self.batch_steps += 1
        adapt_threads_at(self.batch_steps)
        groups: dict[object, list[_Live]] = {}
        for live in self._rows:
            groups.setdefault(live.call.context_key, []).append(live)
        stepped = [(rows, self._step_rows(rows, whole=len(groups) == 1)) for rows in groups.values()]
        for rows, (logits, best) in stepped:  # rows retire only now: every step above saw the same arena rows
            for live, row_logits, greedy in zip(rows, logits, best, strict=True):
                self._emit(live, row_logits, greedy)

    def _step_rows(self, rows: list[_Live], whole: bool) -> tuple[torch.Tensor, list[int]]:
        """The logits [B, V] of one batched step of ``rows`` (``whole``: every live row, in arena order) inside their
        calls' context, and their argmax."""
        readers: dict[int, tuple[Segment, list[int]]] = {}
        for index, live in enumerate(rows):  # a read names the step's rows (when whole, index == live.row)
            for segment in live.segments:
                readers.setdefault(id(segment), (segment, []))[1].append(index)
        reads = [SharedRead(s, torch.tensor(r, device=self.lm.device), tuple(r)) for s, r in readers.values()]
        device = self.lm.device
        tokens = torch.tensor([live.token for live in rows], device=device)
        positions = torch.tensor([live.entry.request.next_position + live.step - 1 for live in rows], device=device)
        assert self._step is not None
        with rows[0].call.context():
            logits = self._step(
                tokens, positions, self.arena, self.pool, reads, None if whole else [live.row for live in rows]
            )
        self.widest_step = max(self.widest_step, len(rows))
        return logits, logits.argmax(-1).tolist()  # one batched argmax, one device-to-host copy per step

    def _step_alone(self) -> None:
        for entry, items in list(self._alone):
            if entry.tokens.cancelled.is_set():
                items.close()
                entry.tokens.queue.put(END)  # a reader blocked on the next item (a cancel from elsewhere) ends
                ended = True
            else:
                try:
                    entry.tokens.queue.put(next(items))
                    ended = False
                except StopIteration:
                    entry.tokens.queue.put(END)
                    ended = True
                except Exception as e:  # noqa: BLE001 - forwarded: the caller raises it
                    entry.tokens.queue.put(e)
                    ended = True
            if ended:
                with self._lock:
                    self._alone.remove((entry, items))

    def _fail_all(self, error: Exception, admitted: list[Entry] | None = None) -> None:
        """Every live and waiting request (and ``admitted``, which may be neither yet) gets ``error``."""
        with self._lock:
            entries = [live.entry for live in self._rows] + [entry for entry, _ in self._alone] + list(self._waiting)
            entries += [e for e in admitted or [] if e not in entries]
            lives = list(self._rows)
            self._rows.clear()
            self._alone.clear()
            self._waiting.clear()
            while self.arena.active:
                self.arena.retire(self.arena.active - 1)
        for live in lives:
            for segment in live.segments:
                self.pool.release(segment)
        for entry in entries:
            entry.tokens.queue.put(error)
