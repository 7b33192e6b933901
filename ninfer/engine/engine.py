"""The Engine: an artifact's model, the KV pool and state slots, a scheduler loop on its own thread.

    engine = Engine("model.ninfer", EngineConfig(max_concurrency=2, kv_dtype="rk8v4")).start()
    handle = engine.submit(GenerationRequest("r1", prompt_ids, SamplingParams(max_tokens=64)))
    while (ev := handle.next_event()) and ev.finish_reason is None: ...
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ninfer.engine.api import GenerationRequest, SamplingParams, TokenEvent
from ninfer.engine.kv_pool import KvPool
from ninfer.engine.memory import (
    MemoryLedger,
    build_ledger,
    device_budget_bytes,
    module_bytes,
    plan_kv_capacity,
)
from ninfer.engine.runner import ModelRunner
from ninfer.engine.sampler import SamplerState, sample_rows, stop_reason, to_device
from ninfer.engine.scheduler import Round, Scheduler, SchedulerLimits, Sequence, WorkItem
from ninfer.engine.state_pool import GdnStatePool
from ninfer.engine.workspace import cpu_workspace, measure_workspace
from ninfer.errors import EngineConfigError, RequestError
from ninfer.kernels.kv_quant import KV_DTYPES
from ninfer.models.cache_spec import CacheSpec

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def default_prefill_chunk(device: str) -> int:
    """Prompt tokens a prefill step takes unless told: 1024 on a GPU (the spec's default; the H200's
    warm 27B prefill runs at ~3,300 tok/s in 512-token chunks and ~9,000 in 2048-token ones, each chunk
    paying ~1,700 launches and a dequantisation of every matrix), 512 on the CPU (the reference path)."""
    return 1024 if device.startswith("cuda") else 512


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 1
    max_context: int = 4096
    kv_capacity: int | str = "auto"  # tokens, or "auto"
    kv_dtype: str = "bf16"
    gdn_state_fp16: bool = False
    max_pending_requests: int = 16
    pending_timeout_ms: int | None = None  # None or 0: wait forever
    prefill_chunk: int | None = None  # None: default_prefill_chunk(device), resolved on construction
    device: str = "cpu"
    dtype: str = "float32"
    gpu_memory_limit_mib: int | None = None
    kv_headroom_mib: int = 1024
    # GGUF weights stay blocks on the device (quantized matmul kernels); None: on CUDA yes, on CPU no
    quantized_weights: bool | None = None
    # decode rounds (all one-token items) replay captured CUDA graphs on CUDA; False: eager (--no-cuda-graphs)
    cuda_graphs: bool = True
    # decode rounds launch the next round before their tokens reach the host; None: on CUDA yes, on
    # CPU no (nothing runs meanwhile there) (--decode-lookahead / --no-decode-lookahead)
    decode_lookahead: bool | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk is None:
            object.__setattr__(self, "prefill_chunk", default_prefill_chunk(self.device))

    @property
    def keeps_quantized_weights(self) -> bool:
        if self.quantized_weights is None:
            return self.device.startswith("cuda")
        return self.quantized_weights

    @property
    def looks_ahead(self) -> bool:
        if self.decode_lookahead is None:
            return self.device.startswith("cuda")
        return self.decode_lookahead

    def validate(self) -> None:
        if not 1 <= self.max_concurrency <= 8:
            raise EngineConfigError(f"--max-concurrency must be 1..8, got {self.max_concurrency}")
        if self.max_context < 2:
            raise EngineConfigError(f"--max-context must be >= 2, got {self.max_context}")
        if self.kv_dtype not in KV_DTYPES:
            raise EngineConfigError(f"unknown --kv-dtype {self.kv_dtype!r}; choose one of "
                                    f"{', '.join(KV_DTYPES)}")
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"unknown --dtype {self.dtype!r}; choose float32, bfloat16 or float16")
        if self.prefill_chunk < 1:
            raise EngineConfigError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_pending_requests < 0:
            raise EngineConfigError(f"--max-pending-requests must be >= 0, got {self.max_pending_requests}")
        if self.kv_capacity != "auto" and (not isinstance(self.kv_capacity, int) or self.kv_capacity < 1):
            raise EngineConfigError(f"--kv-capacity must be a token count or auto, got {self.kv_capacity!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineConfigError(f"--device {self.device}: no CUDA GPU is visible; use --device cpu")


class EngineHandle:
    """Thread-safe stream of one request's TokenEvents (implements api.RequestHandle)."""

    def __init__(self, request_id: str, engine: Engine):
        self.request_id = request_id
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._engine = engine
        self.seq: Sequence | None = None

    def _put(self, event: TokenEvent) -> None:
        self._events.put(event)

    def next_event(self, timeout_s: float | None = None) -> TokenEvent | None:
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def cancel(self) -> None:
        if self.seq is not None:
            self.seq.cancel_requested = True
            self._engine._wake()

    def __iter__(self):
        """Events until (and including) the one with finish_reason set."""
        while True:
            ev = self.next_event()
            yield ev
            if ev.finish_reason is not None:
                return


# the sampler of an item whose request ended meanwhile (its token is dropped): greedy, no draw
_ENDED = SamplerState(SamplingParams(temperature=0.0), ())


@dataclass
class _Lookahead:
    """A decode round already launched on the device, before the round that feeds it was committed: its
    items (start = the next position, token ids placeholders), their logits rows and their argmax on the
    device (a decode graph's static outputs, until its next replay)."""

    items: list[WorkItem]
    logits: torch.Tensor
    ids: torch.Tensor

    def detached(self) -> _Lookahead:
        """Its outputs copied (before a round that may replay their graph)."""
        return replace(self, logits=self.logits.clone(), ids=self.ids.clone())

    def rows(self, rnd: Round) -> dict[int, int]:
        """{index in rnd.items: row in `ids`} of the round's items this lookahead already ran."""
        by_seq = {id(it.seq): (row, it) for row, it in enumerate(self.items)}
        done = {}
        for i, item in enumerate(rnd.items):
            hit = by_seq.get(id(item.seq))
            if hit is None:
                continue
            if item.start != hit[1].start or len(item.token_ids) != 1 or not item.sample:
                # running it again would advance the lane's GDN state twice
                raise RuntimeError(f"decode lookahead out of step for lane {item.lane}: planned position "
                                   f"{hit[1].start}, scheduled {item.start}")
            done[i] = hit[0]
        return done


class Engine:
    def __init__(self, artifact_path: str | Path, config: EngineConfig):
        from ninfer.artifact import open_artifact
        from ninfer.models import load_model

        config.validate()
        self.artifact = open_artifact(artifact_path)
        model = load_model(self.artifact, dtype=DTYPES[config.dtype], device=config.device, load_mtp=False,
                           quantized_weights=config.keeps_quantized_weights)
        self._setup(model, config, eos_token_ids(self.artifact))
        try:  # the tokenizer's eos (e.g. <|im_end|>) ends a chat turn too
            self.eos_ids = self.eos_ids | frozenset(self.tokenizer.eos_token_ids)
            # the output head may be padded past the tokenizer (e.g. 248,320 rows for 248,077 tokens):
            # those rows are never sampled
            self.sample_vocab = min(self.tokenizer.vocab_size, model.vocab_size)
        except Exception:  # an artifact without tokenizer resources still serves token ids
            pass
        self._prepare_graphs()

    @classmethod
    def from_model(cls, model, config: EngineConfig, eos_ids: tuple[int, ...] = ()) -> Engine:
        """An engine over an already-built model (tests, synthetic benchmarks)."""
        config.validate()
        engine = cls.__new__(cls)
        engine.artifact = None
        engine._setup(model, config, eos_ids)
        engine._prepare_graphs()
        return engine

    def _setup(self, model, config: EngineConfig, eos_ids: tuple[int, ...]) -> None:
        self.config = config
        self.model = model
        self.eos_ids = frozenset(eos_ids)
        self.sample_vocab: int | None = None  # sample only ids below this (None: every logit column)
        self.spec: CacheSpec = model.cache_spec
        budget = device_budget_bytes(config.device, config.gpu_memory_limit_mib)
        weights = module_bytes(model)
        # + 1: the scratch slot that pads CUDA-graph decode batches
        slots = config.max_concurrency + 1
        gdn_bytes = GdnStatePool.bytes_per_slot(self.spec, config.gdn_state_fp16) * slots
        on_gpu = config.device.startswith("cuda")
        graphs = config.cuda_graphs and on_gpu
        workspace = cpu_workspace()
        if on_gpu:
            workspace = measure_workspace(
                model, self.spec, kv_dtype=config.kv_dtype, gdn_state_fp16=config.gdn_state_fp16,
                lanes=config.max_concurrency, prefill_chunk=min(config.prefill_chunk, config.max_context),
                max_context=config.max_context, graphs=graphs, device=torch.device(config.device))
        capacity = plan_kv_capacity(
            config.kv_capacity, spec=self.spec, kv_dtype=config.kv_dtype, device=config.device,
            budget_bytes=budget, weights_bytes=weights, gdn_bytes=gdn_bytes, workspace_bytes=workspace.total,
            headroom_mib=config.kv_headroom_mib,
            max_context=config.max_context, max_concurrency=config.max_concurrency)
        self.kv = KvPool(self.spec, config.kv_dtype, capacity, config.max_concurrency, config.max_context,
                         config.device)
        self.states = GdnStatePool(self.spec, config.max_concurrency, config.gdn_state_fp16, config.device)
        self.runner = ModelRunner(model, self.kv, self.states, config.device, decode_graphs=graphs)
        timeout = config.pending_timeout_ms / 1000 if config.pending_timeout_ms else None
        limits = SchedulerLimits(config.max_concurrency, config.max_context, config.max_pending_requests,
                                 timeout, config.prefill_chunk)
        self.scheduler = Scheduler(limits, self.kv.allocator)
        self._ledger = build_ledger(config.device, budget, weights, self.kv, self.states, config.kv_dtype,
                                    workspace)
        self._samplers: dict[int, SamplerState] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._tokens_generated = 0
        self._requests_finished = 0
        self._rounds = 0
        self._tokenizer = None
        self._ahead: _Lookahead | None = None
        # the sampled tokens' way to the host, one per lane (pinned on CUDA, so the copy is asynchronous)
        self._host_ids = torch.empty(config.max_concurrency, dtype=torch.long,
                                     pin_memory=config.device.startswith("cuda"))

    def _prepare_graphs(self) -> None:
        """Capture the decode graphs now (the argmax over the sampled vocabulary), not in the first round."""
        if self.runner.graphs is not None:
            self.runner.graphs.prepare(self.sample_vocab)

    # -- public ----------------------------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, request: GenerationRequest) -> EngineHandle:
        """Queue a request; raises RequestError (context_length_exceeded, server_overloaded, ...) at once."""
        if self._stop:
            raise RequestError("the engine is shutting down", code="engine_shutdown")
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in request.prompt_ids):
            raise RequestError(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        handle = EngineHandle(request.request_id, self)
        seq = Sequence(request, self._emitter(handle))
        handle.seq = seq
        with self._lock:
            self.scheduler.add(seq)
            self._samplers[id(seq)] = SamplerState(request.sampling, request.prompt_ids)
        self._wake()
        return handle

    def generate(self, request: GenerationRequest) -> list[TokenEvent]:
        """Submit and wait for every event (the loop must be started)."""
        return list(self.submit(request))

    def stats(self) -> dict:
        with self._lock:
            s = self.scheduler
            return {
                "lanes_total": s.limits.max_concurrency,
                "lanes_busy": s.busy_lanes,
                "queue_depth": len(s.pending),
                "kv_pages_total": self.kv.num_pages,
                "kv_pages_used": self.kv.allocator.used_pages,
                "kv_pages_free": self.kv.allocator.free_pages,
                "kv_capacity_tokens": self.kv.capacity_tokens,
                "kv_dtype": self.config.kv_dtype,
                "tokens_generated": self._tokens_generated,
                "requests_finished": self._requests_finished,
                "rounds": self._rounds,
            }

    def memory_ledger(self) -> MemoryLedger:
        """Where the device memory went; the decode graphs' pool as captured so far."""
        graphs = self.runner.graphs
        return replace(self._ledger, graphs_bytes=graphs.graph_bytes) if graphs is not None else self._ledger

    @property
    def tokenizer(self):
        """The artifact's tokenizer (ninfer.frontend), loaded on first use."""
        if self._tokenizer is None and self.artifact is not None:
            from ninfer.frontend.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_artifact(self.artifact)
        return self._tokenizer

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; in-flight and queued requests end with an error event."""
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            self.scheduler.fail_all("the engine shut down before this request finished", "engine_shutdown")

    # -- loop ------------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        self._wakeup.set()

    def _emitter(self, handle: EngineHandle):
        def emit(event: TokenEvent) -> None:
            if event.finish_reason is not None:
                self._samplers.pop(id(handle.seq), None)
                self._requests_finished += 1
            self._tokens_generated += len(event.token_ids)
            handle._put(event)
        return emit

    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                rnd = self.scheduler.schedule()
            if rnd is None:
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                continue
            try:
                self.step(rnd)
            except Exception as exc:  # a bug must not hang every client: fail what is running, keep serving
                traceback.print_exc()
                with self._lock:
                    for item in rnd.items:
                        self.scheduler.fail_one(item.seq, f"internal error: {exc}", "internal_error")

    def step(self, rnd: Round) -> None:
        """Run one planned round and commit its tokens. Items that the previous step's lookahead already ran
        (`EngineConfig.decode_lookahead`) take its logits; a decode round launches the next one before its
        own tokens come back to the host, so the device works while the host commits."""
        ahead, self._ahead = self._ahead, None
        done = ahead.rows(rnd) if ahead is not None else {}
        rest = [it for i, it in enumerate(rnd.items) if i not in done]
        if done and rest:  # the lookahead's outputs are a decode graph's: running `rest` may replay it
            ahead = ahead.detached()
        logits = self.runner.run(Round(rest, rnd.admitted, rnd.released))
        sampled = [i for i, it in enumerate(rnd.items) if it.sample]
        known = {}
        if sampled:
            tokens = self._sample(rnd, sampled, done, ahead, logits)
            wait = self._copy_to_host(tokens)
            if self.config.looks_ahead:
                self._launch_lookahead(rnd, tokens)
            known = dict(zip(sampled, wait(), strict=True))
        self._commit(rnd, known)

    def _sample(self, rnd: Round, sampled: list[int], done: dict[int, int], ahead: _Lookahead | None,
                logits: torch.Tensor | None) -> torch.Tensor:
        """The sampled items' tokens in item order, on the logits' device: the decode graph's own argmax where
        every one is plain greedy, else `sample_rows` over their logits (the lookahead's rows for `done`
        items, this run's for the rest) — only the token ids cross to the host."""
        if self._all_plain_greedy(rnd):
            ids = self.runner.greedy_ids(logits, self.sample_vocab) if logits is not None else None
            return _rows_in_order(sampled, done, ahead.ids if done else None, ids)
        rows = _rows_in_order(sampled, done, ahead.logits if done else None, logits)
        states = [self._samplers.get(id(rnd.items[i].seq), _ENDED) for i in sampled]
        return sample_rows(rows[:, : self.sample_vocab], states)

    def _copy_to_host(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        """Start copying `tokens` to the host; returns the function that waits for them (a list of ints)."""
        host = self._host_ids[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        if not tokens.is_cuda:
            return host.tolist
        copied = torch.cuda.Event()
        copied.record()

        def wait() -> list[int]:
            copied.synchronize()
            return host.tolist()
        return wait

    def _launch_lookahead(self, rnd: Round, tokens: torch.Tensor) -> None:
        """A round of only one-token decode items (`tokens`: theirs, on the device) launches the next one,
        each item one position on and fed its token from the device, except items that end now (max_tokens,
        cancelled); the next `step` samples its logits (its penalties then count this round's tokens)."""
        if not all(len(it.token_ids) == 1 and it.sample for it in rnd.items):
            return
        keep = [r for r, it in enumerate(rnd.items) if not self._ends_after(it)]
        if not keep:
            return
        items = [replace(rnd.items[r], token_ids=(0,), start=rnd.items[r].start + 1) for r in keep]
        feed = tokens if len(keep) == len(rnd.items) else tokens[index_on(tokens.device, keep)]
        logits = self.runner.run(Round(items, [], []), device_ids=feed)
        self._ahead = _Lookahead(items, logits, self.runner.greedy_ids(logits, self.sample_vocab))

    def _ends_after(self, item: WorkItem) -> bool:
        """The item's request ends with the token this round samples for it (or is gone already)."""
        state = self._samplers.get(id(item.seq))
        return state is None or item.seq.cancel_requested or item.seq.generated + 1 >= state.params.max_tokens

    def _commit(self, rnd: Round, known: dict[int, int]) -> None:
        """Record every item of the round: its token (`known`, by item index) and whether its request ends."""
        self._rounds += 1
        now = time.monotonic()
        with self._lock:
            for i, item in enumerate(rnd.items):
                if not item.sample:
                    self.scheduler.commit(item, None, None, now)
                    continue
                state = self._samplers.get(id(item.seq))
                if state is None or item.seq.finished:
                    continue
                token = known[i]
                state.record(token)
                finish = stop_reason(token, item.seq.generated + 1, state.params, self.eos_ids)
                self.scheduler.commit(item, token, finish, now)

    def _all_plain_greedy(self, rnd: Round) -> bool:
        """Every sampled item of the round is greedy without penalties (argmax of the raw logits)."""
        for item in rnd.items:
            state = self._samplers.get(id(item.seq)) if item.sample else None
            if state is None:
                continue
            p = state.params
            if not p.greedy or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                return False
        return True


def _rows_in_order(sampled: list[int], done: dict[int, int], ahead_rows: torch.Tensor | None,
                   run_rows: torch.Tensor | None) -> torch.Tensor:
    """Rows (token ids or logits) of the round's sampled items in item order: from the lookahead's rows for
    `done` items (index → row), from this run's (in order) for the rest."""
    if not done:
        return run_rows
    if len(done) == len(sampled) and [done[i] for i in sampled] == list(range(ahead_rows.shape[0])):
        return ahead_rows
    pool = ahead_rows if run_rows is None else torch.cat([ahead_rows, run_rows])
    rest = iter(range(ahead_rows.shape[0], pool.shape[0]))
    order = [done[i] if i in done else next(rest) for i in sampled]
    return pool[index_on(pool.device, order)]


def index_on(device: torch.device, rows: list[int]) -> torch.Tensor:
    """`rows` as an index tensor on `device` (`sampler.to_device`: a lane ending beside others, the lookahead
    gathering their tokens, must not wait for the rounds in flight)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def eos_token_ids(artifact) -> tuple[int, ...]:
    """End-of-sequence ids from the text config and generation_config.json."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(artifact.components["text"].config.get("eos_token_id"))
    try:
        add(json.loads(artifact.resource("text", "generation_config.json")).get("eos_token_id"))
    except Exception:  # resource optional for dense recipes
        pass
    return tuple(sorted(ids))
