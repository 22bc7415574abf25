"""The demo's runs: ``swap`` (sequences take turns on the device) and ``stream`` (one sequence
longer than the device tier, streamed layer by layer), each beside an all-resident run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tierkv.demo.model import KVProvider, ModelConfig, TinyLlama
from tierkv.errors import InvalidInputError
from tierkv.lease import Lease
from tierkv.policies import DEFAULT_POLICY
from tierkv.progress import Progress
from tierkv.store import KVStore


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on (defaults are `tierkv demo`'s)."""

    mode: str = "swap"
    sequences: int = 10
    batch: int = 2
    prompt: int = 128
    generate: int = 256
    turn: int = 16
    page_tokens: int = 16
    kv_dtype: str = "fp16"
    device_fraction: float = 0.45
    host_fraction: float = 1.5
    codec: str | None = "int8"
    compress_after: int = 5
    compress_live: bool = False
    policy: str = DEFAULT_POLICY
    backend: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    seed: int = 0

    def total_tokens(self) -> int:
        """Tokens of KV at the end of the run, all sequences."""
        n = 1 if self.mode == "stream" else self.sequences
        return n * (self.prompt + self.generate)

    def total_kv_bytes(self) -> int:
        """Page bytes of all KV at the end (what an all-resident device tier must hold)."""
        spec = self.model.kv_spec(self.kv_dtype, self.page_tokens)
        n = 1 if self.mode == "stream" else self.sequences
        return n * spec.bytes_for(self.prompt + self.generate)


@dataclass
class RunResult:
    """Tokens, logits and figures of one run."""

    tokens: dict[str, list[int]]
    logits: list[torch.Tensor]
    seconds: float
    stats: dict[str, Any]
    device_bytes: int
    trace: dict[str, Any] | None = None
    loads_after_first_step: float = 0.0
    cpu_seconds: float = 0.0  # the process's CPU time (all threads) over the same span

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second."""
        n = sum(len(t) for t in self.tokens.values())
        return n / self.seconds if self.seconds else 0.0


def _device(cfg: DemoConfig) -> str:
    """Where the model computes: on the GPU with the cuda backend, else on the cpu."""
    if cfg.backend in ("cuda", "auto") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _prompts(cfg: DemoConfig, n: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return {
        f"seq{i}": torch.randint(0, cfg.model.vocab, (cfg.prompt,), generator=g).tolist()
        for i in range(n)
    }


def _store(cfg: DemoConfig, device_bytes: int) -> KVStore:
    spec = cfg.model.kv_spec(cfg.kv_dtype, cfg.page_tokens)
    host = max(int(cfg.total_kv_bytes() * cfg.host_fraction), 8 * spec.page_bytes)
    return KVStore(
        spec,
        device_bytes=device_bytes,
        host_bytes=host,
        backend=cfg.backend,
        codec=cfg.codec,
        compress_after=cfg.compress_after,
        compress_live=cfg.compress_live,
        policy=cfg.policy,
    )


async def run_swap(
    cfg: DemoConfig,
    device_bytes: int,
    *,
    progress: bool = False,
    trace: bool = False,
    label: str = "",
) -> RunResult:
    """Sequences in batches take turns of ``cfg.turn`` tokens; the next batches are announced
    (and prefetched) while the current one computes."""
    model = TinyLlama(cfg.model, cfg.model.kv_spec(cfg.kv_dtype).dtype, _device(cfg))
    prompts = _prompts(cfg, cfg.sequences)
    ids = list(prompts)
    batches = [ids[i : i + cfg.batch] for i in range(0, len(ids), cfg.batch)]
    out: dict[str, list[int]] = {s: [] for s in ids}
    logits: list[torch.Tensor] = []
    rounds = -(-cfg.generate // cfg.turn)
    async with _store(cfg, device_bytes) as store:
        store.timeline.enabled = trace
        for s in ids:
            await store.add_sequence(s, prompts[s])
        first_loads: int | None = None
        t0, c0 = time.perf_counter(), time.process_time()
        with Progress(
            rounds * len(batches) * cfg.turn, label or f"demo {cfg.mode}", enabled=progress
        ) as bar:
            for _ in range(rounds):
                for bi, batch in enumerate(batches):
                    store.schedule([batch, *batches[bi + 1 :], *batches[:bi]])
                    for _ in range(cfg.turn):
                        live = [s for s in batch if len(out[s]) < cfg.generate]
                        if live:
                            await _decode_step(model, store, live, prompts, out, logits)
                        store.step()
                        if first_loads is None:
                            first_loads = store.stats()["page_loads"]
                        bar.update()
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
        await store.drain()
        stats = store.stats()
        tl = store.timeline.to_chrome() if trace else None
    total = stats["page_loads"]
    after = (total - (first_loads or 0)) / total if total else 0.0
    return RunResult(out, logits, seconds, stats, device_bytes, tl, after, cpu)


async def _decode_step(
    model: TinyLlama,
    store: KVStore,
    batch: list[str],
    prompts: dict[str, list[int]],
    out: dict[str, list[int]],
    logits: list[torch.Tensor],
) -> None:
    async with store.lease(batch) as lease:

        async def gate(layer: int) -> KVProvider:
            return lease

        for s in batch:
            t0 = time.perf_counter()
            if not out[s]:
                lg = await model.forward(s, prompts[s], 0, gate)
            else:
                lg = await model.forward(s, out[s][-1:], len(prompts[s]) + len(out[s]) - 1, gate)
            store.timeline.span("forward", "compute", t0, time.perf_counter(), seq=s)
            tok = int(lg.argmax())
            out[s].append(tok)
            logits.append(lg)
            store.add_tokens(s, [tok])


async def run_stream(
    cfg: DemoConfig,
    device_bytes: int,
    *,
    progress: bool = False,
    trace: bool = False,
    label: str = "",
) -> RunResult:
    """One sequence whose KV exceeds the device tier: each layer's pages are leased in turn
    while the next layer's are prefetched."""
    model = TinyLlama(cfg.model, cfg.model.kv_spec(cfg.kv_dtype).dtype, _device(cfg))
    prompt = _prompts(cfg, 1)["seq0"]
    out: dict[str, list[int]] = {"seq0": []}
    logits: list[torch.Tensor] = []
    layers = cfg.model.layers
    async with _store(cfg, device_bytes) as store:
        store.timeline.enabled = trace
        await store.add_sequence("seq0", prompt)
        t0, c0 = time.perf_counter(), time.process_time()
        with Progress(cfg.generate, label or "demo stream", enabled=progress) as bar:
            for _ in range(cfg.generate):
                async with _LayerStream(store, "seq0", layers) as gate:
                    toks = out["seq0"]
                    if not toks:
                        lg = await model.forward("seq0", prompt, 0, gate)
                    else:
                        pos = len(prompt) + len(toks) - 1
                        lg = await model.forward("seq0", toks[-1:], pos, gate)
                tok = int(lg.argmax())
                toks.append(tok)
                logits.append(lg)
                store.add_tokens("seq0", [tok])
                store.step()
                bar.update()
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - c0
        await store.drain()
        stats = store.stats()
        tl = store.timeline.to_chrome() if trace else None
    return RunResult(out, logits, seconds, stats, device_bytes, tl, cpu_seconds=cpu)


class _LayerStream:
    """Leases one layer at a time and prefetches the next: ``gate(layer)`` for the model."""

    def __init__(self, store: KVStore, seq_id: str, layers: int) -> None:
        self.store, self.seq_id, self.layers = store, seq_id, layers
        self.current: Lease | None = None

    async def __call__(self, layer: int) -> KVProvider:
        await self._drop()
        lease = self.store.lease([self.seq_id], [layer])
        await lease.__aenter__()
        self.current = lease
        if layer + 1 < self.layers:  # loads while this layer computes
            await self.store.prefetch([self.seq_id], [layer + 1])
        return lease

    async def _drop(self) -> None:
        if self.current is not None:
            lease, self.current = self.current, None
            await lease.__aexit__(None, None, None)

    async def __aenter__(self) -> _LayerStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._drop()


def device_budget(cfg: DemoConfig) -> int:
    """The device tier of the tiered run: ``device_fraction`` of all KV (swap), or three
    layers' pages of the sequence (stream)."""
    spec = cfg.model.kv_spec(cfg.kv_dtype, cfg.page_tokens)
    if cfg.mode == "stream":
        return 3 * spec.blocks_for(cfg.prompt + cfg.generate) * spec.page_bytes
    return int(cfg.total_kv_bytes() * cfg.device_fraction) // spec.page_bytes * spec.page_bytes


def check_fits(cfg: DemoConfig, device_bytes: int) -> None:
    """Raise ValueError (saying what to change) when one step's pages exceed the device tier."""
    spec = cfg.model.kv_spec(cfg.kv_dtype, cfg.page_tokens)
    per_seq = spec.bytes_for(cfg.prompt + cfg.generate)
    if cfg.mode == "stream":
        need, what = 3 * per_seq // cfg.model.layers, "three layers of the sequence"
    else:
        need, what = cfg.batch * per_seq, f"a batch of {cfg.batch} sequences"
    if need > device_bytes:
        raise InvalidInputError(
            f"the device tier ({device_bytes / 2**20:.2f} MiB) cannot hold {what} "
            f"({need / 2**20:.2f} MiB): raise --device-fraction or lower --batch / --generate"
        )


async def run(cfg: DemoConfig, device_bytes: int, **kw: Any) -> RunResult:
    """One run of ``cfg.mode`` with the given device tier. Raises ValueError when it can't fit."""
    check_fits(cfg, device_bytes)
    fn = run_stream if cfg.mode == "stream" else run_swap
    return await fn(cfg, device_bytes, **kw)


def all_resident(cfg: DemoConfig) -> DemoConfig:
    """The same run with no cold compression (the device tier will hold everything)."""
    return replace(cfg, codec=None)


def lossy_agreement(ref: RunResult, lossy: RunResult, codec: str) -> dict[str, Any]:
    """How a lossy run (``codec`` on live KV) agrees with the lossless ``ref``: tokens agreeing,
    the largest logit drift before the first divergence, the smallest top-2 margin."""
    differ = 0
    drift = 0.0
    n = len(ref.logits)
    for a, b in zip(ref.logits, lossy.logits):
        if int(a.argmax()) != int(b.argmax()):
            differ += 1
            break
        drift = max(drift, float((a - b).abs().max()))
    margins = [float(torch.topk(lg, 2).values.diff().abs()) for lg in ref.logits]
    same = sum(
        x == y for s in ref.tokens for x, y in zip(ref.tokens[s], lossy.tokens[s], strict=False)
    )
    return {
        "codec": codec,
        "tokens_identical": ref.tokens == lossy.tokens,
        "tokens_agreeing": same,
        "tokens": n,
        "max_logit_drift_before_divergence": drift,
        "smallest_top2_margin": min(margins) if margins else 0.0,
        "cold_loads": lossy.stats["hits"]["cold"],
    }
