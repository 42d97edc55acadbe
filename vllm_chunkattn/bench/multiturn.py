"""Multi-turn benchmark: closed-loop conversations against `vllm serve`, stock
vLLM against the PensieveConnector, as the Pensieve paper's section 6 does.

    python -m vllm_chunkattn.bench.multiturn            # full run, bench-gqa model (30-45 minutes, estimated)
    python -m vllm_chunkattn.bench.multiturn --quick    # CI: tiny model, 4 conversations, one rate (about 2 minutes)

Each conversation takes `--turns` turns. A turn's prompt is the whole
conversation so far (earlier user messages and the server's own answers, as
token ids, so every turn's prefix is exactly the previous turn's prompt and
answer) plus a new user message; the answer has a length drawn for that turn
(max_tokens = min_tokens, ignore_eos), greedy. Between turns the user thinks
(exponential, `--think-time` mean); new conversations arrive as a Poisson
process at each swept `--rates` (conversations per second). Message lengths
are long-tailed like ShareGPT's (lognormal, scaled down by `--length-scale`).
The same seed gives the same conversations for every configuration and rate.

Four server configurations run the same workload with the same engine
arguments and a KV cache `--kv-ratio` times smaller than the conversations'
KV (`--num-gpu-blocks-override`), so histories are evicted between turns:
`stock-nocache` (no prefix caching), `stock` (vLLM's prefix cache),
`pensieve-lru` and `pensieve` (`--attention-backend chunk` with the
PensieveConnector's host tier under LRU or Pensieve's eviction). Every run
gets a freshly started server, so each starts with an empty KV cache and an
empty host tier (the connector has no reset of its own); the configurations
run one after another at each rate, in an order that rotates with the rate.

Before a configuration's speed is reported, its greedy answers must match
the reference's (stock): after its last timed run, the same server answers
`--check-conversations` separate conversations with logprobs, and every
turn's tokens must equal the reference's, top logprobs within 1e-3 (a token
may differ only at a near tie, after which that conversation is not compared
further; testing/compare.py). A configuration that fails is reported without
speeds and the benchmark exits 1.

Output in one folder: progress lines while it runs, table.md (one table per
metric, the SLO summary), results.json (every number, the machine), raw
per-turn records, server logs, and plots of p90 normalised latency and p90
TTFT of turns >= 2 against the request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp

from vllm_chunkattn.bench import machine
from vllm_chunkattn.bench.metrics_poller import MetricsPoller, metrics_text
from vllm_chunkattn.bench.report import _pyplot, percentile
from vllm_chunkattn.bench.serve import Progress, environment_info, error_lines, raise_terminated
from vllm_chunkattn.testing.compare import compare_runs
from vllm_chunkattn.testing.models import SPECIAL_TOKENS, add_model_arguments
from vllm_chunkattn.testing.server import ServerError, VllmServer

# ---------------------------------------------------------------- the workload

# Mean tokens per user message and per answer at --length-scale 1: the per-request means the vLLM paper
# (Kwon et al., SOSP 2023) reports for ShareGPT. The Pensieve paper's own Table 2 (ShareGPT and LMSYS
# turn lengths) is missing from the copy in ../shared/papers, so its numbers could not be used.
SHAREGPT_USER_MEAN = 160
SHAREGPT_ANSWER_MEAN = 340
LENGTH_SIGMA = 1.0  # of the lognormal's log: long-tailed, as chat turns are
TAIL_CAP = 4.0  # draws above this many times the mean are clipped, so max-model-len stays small
FIRST_ORDINARY_TOKEN = len(SPECIAL_TOKENS)  # ids 0..3 are <s>, </s>, <unk>, <pad>


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal token counts with mean `mean` before clipping at TAIL_CAP x mean, at least `minimum`."""
    mean: float
    sigma: float = LENGTH_SIGMA
    minimum: int = 1

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma ** 2 / 2

    @property
    def cap(self) -> int:
        return max(self.minimum, round(TAIL_CAP * self.mean))

    def draw(self, rng: random.Random) -> int:
        return max(self.minimum, min(self.cap, round(rng.lognormvariate(self.mu, self.sigma))))

    def clipped_mean(self) -> float:
        """The mean of the draws (without rounding and the minimum): E[min(X, cap)] of the lognormal X."""
        log_cap = math.log(self.cap)
        below = self.mean * _normal_cdf((log_cap - self.mu - self.sigma ** 2) / self.sigma)
        return below + self.cap * (1.0 - _normal_cdf((log_cap - self.mu) / self.sigma))


@dataclass(frozen=True)
class WorkloadShape:
    conversations: int
    turns: int
    user_tokens: LengthDistribution
    answer_tokens: LengthDistribution
    think_time_mean_s: float
    vocab_size: int


@dataclass(frozen=True)
class Turn:
    user_tokens: tuple[int, ...]  # the new user message
    answer_tokens: int  # the answer's length: max_tokens = min_tokens
    think_time_s: float  # the user's pause after the previous answer (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    index: int
    arrival_at_unit_rate_s: float  # arrival time at 1 conversation/s; at rate r it arrives at this / r
    turns: tuple[Turn, ...]

    @property
    def total_tokens(self) -> int:
        """The conversation's length after its last answer: its KV at the end."""
        return sum(len(t.user_tokens) + t.answer_tokens for t in self.turns)

    @property
    def user_time_s(self) -> float:
        return sum(t.think_time_s for t in self.turns)


def make_conversations(shape: WorkloadShape, seed: int) -> list[Conversation]:
    """Deterministic in (shape, seed): Poisson arrivals (exponential gaps, the first at 0), then per
    conversation and turn a user message of random ordinary token ids, an answer length and a think time."""
    rng = random.Random(seed)
    conversations = []
    arrival = 0.0
    for index in range(shape.conversations):
        if index:
            arrival += rng.expovariate(1.0)
        turns = []
        for t in range(shape.turns):
            user = tuple(rng.randrange(FIRST_ORDINARY_TOKEN, shape.vocab_size)
                         for _ in range(shape.user_tokens.draw(rng)))
            answer = shape.answer_tokens.draw(rng)
            think = rng.expovariate(1.0 / shape.think_time_mean_s) if t and shape.think_time_mean_s > 0 else 0.0
            turns.append(Turn(user, answer, think))
        conversations.append(Conversation(index, arrival, tuple(turns)))
    return conversations


# ---------------------------------------------------------------- cache sizes

@dataclass(frozen=True)
class KVShape:
    """What one KV block costs, from the model's config.json."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    def block_bytes(self, block_size: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * block_size * self.dtype_bytes


DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def read_model_shape(model: str, dtype: str) -> tuple[KVShape, int]:
    """The model's KV shape and vocabulary size."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return KVShape(config["num_hidden_layers"], kv_heads, head_dim, DTYPE_BYTES[dtype]), config["vocab_size"]


def blocks_of(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class CacheSizing:
    block_size: int
    conversation_blocks: int  # KV of every conversation's whole history, summed: what keeping all would take
    longest_tokens: int  # the longest conversation (timed or checked), prompt and last answer
    kv_cache_blocks: int  # --num-gpu-blocks-override
    max_model_len: int
    host_tier_blocks: int
    block_bytes: int

    @property
    def kv_ratio(self) -> float:
        return self.conversation_blocks / self.kv_cache_blocks

    @property
    def host_cache_gib(self) -> float:
        return self.host_tier_blocks * self.block_bytes / 2 ** 30


def size_caches(timed: list[Conversation], checked: list[Conversation], block_size: int, kv_ratio: float,
                host_ratio: float, block_bytes: int) -> CacheSizing:
    """A KV cache `kv_ratio` times smaller than the timed conversations' KV, but never too small for the
    longest conversation (one request must fit, and vLLM wants max_model_len <= (blocks - 1) x block size),
    and a host tier of `host_ratio` times their KV."""
    conversation_blocks = sum(blocks_of(c.total_tokens, block_size) for c in timed)
    longest = max(c.total_tokens for c in timed + checked)
    max_model_len = blocks_of(longest, block_size) * block_size
    kv_blocks = max(math.ceil(conversation_blocks / kv_ratio), max_model_len // block_size + 1)
    host_blocks = max(1, round(conversation_blocks * host_ratio))
    return CacheSizing(block_size, conversation_blocks, longest, kv_blocks, max_model_len, host_blocks, block_bytes)


def peak_live_blocks(conversations: list[Conversation], rate: float, block_size: int) -> int:
    """A rough bound from below on the KV of conversations alive at once at `rate`: each holds its final
    KV from arrival until its last turn, with zero service time (the server only makes lives longer)."""
    events = []
    for c in conversations:
        start = c.arrival_at_unit_rate_s / rate
        blocks = blocks_of(c.total_tokens, block_size)
        events += [(start, blocks), (start + c.user_time_s, -blocks)]
    live = peak = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts at the same time
        live += change
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------- server configurations

@dataclass(frozen=True)
class ServerConfig:
    name: str
    prefix_caching: bool
    attention_backend: str | None = None  # None: vLLM's default
    eviction_policy: str | None = None  # the PensieveConnector's; None: no connector

    def server_args(self, host_cache_gib: float) -> list[str]:
        args = ["--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.attention_backend:
            args += ["--attention-backend", self.attention_backend]
        if self.eviction_policy:
            extra = {"host_cache_gib": host_cache_gib, "eviction_policy": self.eviction_policy}
            args += ["--kv-transfer-config", json.dumps({"kv_connector": "PensieveConnector", "kv_role": "kv_both",
                                                         "kv_connector_extra_config": extra})]
        return args


CONFIGS = {c.name: c for c in (
    ServerConfig("stock-nocache", prefix_caching=False),
    ServerConfig("stock", prefix_caching=True),
    ServerConfig("pensieve-lru", prefix_caching=True, attention_backend="chunk", eviction_policy="lru"),
    ServerConfig("pensieve", prefix_caching=True, attention_backend="chunk", eviction_policy="pensieve"),
)}
REFERENCE = "stock"  # whose answers the others must give, and whose latency sets the default SLO


# ---------------------------------------------------------------- the client

@dataclass
class TurnRecord:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    answer_tokens_asked: int
    sent_s: float  # since the run's start
    first_token_s: float | None = None
    finished_s: float | None = None
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details: prefix cache and host tier
    answer: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[str, float]]] | None = None  # the greedy check's, per answer token
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def normalised_latency_s(self) -> float | None:
        """End-to-end latency over output tokens (the paper's metric, after vLLM's)."""
        if not self.ok or not self.answer:
            return None
        return (self.finished_s - self.sent_s) / len(self.answer)


async def request_turn(session, url: str, model: str, record: TurnRecord, prompt: list[int], conversation_id: str,
                       started: float, logprobs: bool) -> None:
    """One streamed completion; fills `record` (the answer's token ids, first-token and finish times)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": record.answer_tokens_asked,
        "min_tokens": record.answer_tokens_asked, "ignore_eos": True, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        "kv_transfer_params": {"conversation_id": conversation_id},
    }
    if logprobs:
        body |= {"logprobs": 2, "return_tokens_as_token_ids": True}
        record.top_logprobs = []
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
            return
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = str(chunk["error"])[:300]
                return
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and record.first_token_s is None:
                    record.first_token_s = time.perf_counter() - started
                record.answer += ids
                if logprobs and choice.get("logprobs"):
                    record.top_logprobs += [sorted(top.items(), key=lambda kv: -kv[1])
                                            for top in choice["logprobs"]["top_logprobs"]]
            usage = chunk.get("usage")
            if usage:
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    record.finished_s = time.perf_counter() - started
    if len(record.answer) != record.answer_tokens_asked:
        record.error = f"answered {len(record.answer)} tokens, asked for {record.answer_tokens_asked}"


@dataclass
class ClientRun:
    records: list[TurnRecord]
    duration_s: float  # from the run's start to its last answer
    timed_out: bool


async def _converse(session, url: str, model: str, conversation: Conversation, arrival_s: float, started: float,
                    logprobs: bool, records: list[TurnRecord], done: list[int]) -> None:
    await asyncio.sleep(max(0.0, arrival_s - (time.perf_counter() - started)))
    history: list[int] = []
    for number, turn in enumerate(conversation.turns, start=1):
        await asyncio.sleep(turn.think_time_s)
        prompt = history + list(turn.user_tokens)
        record = TurnRecord(conversation.index, number, len(prompt), turn.answer_tokens,
                            sent_s=time.perf_counter() - started)
        records.append(record)
        try:
            await request_turn(session, url, model, record, prompt, f"conversation-{conversation.index}", started,
                               logprobs)
        except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        if not record.ok:
            return  # closed loop: without this answer the conversation cannot go on
        history = prompt + record.answer
    done[0] += 1


async def _run_client(url: str, model: str, conversations: list[Conversation], rate: float | None, logprobs: bool,
                      timeout_s: float, progress_interval_s: float, progress) -> ClientRun:
    records: list[TurnRecord] = []
    done = [0]
    total_turns = sum(len(c.turns) for c in conversations)
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(_converse(session, url, model, c,
                                               c.arrival_at_unit_rate_s / rate if rate else 0.0,
                                               started, logprobs, records, done))
                 for c in conversations]

        async def report() -> None:
            while True:
                await asyncio.sleep(progress_interval_s)
                answered = sum(r.ok for r in records)
                in_flight = sum(r.finished_s is None and r.error is None for r in records)
                progress(f"    {done[0]}/{len(conversations)} conversations done, {answered}/{total_turns} turns "
                         f"answered, {in_flight} in flight, {time.perf_counter() - started:.0f} s")

        reporter = asyncio.create_task(report())
        finished, pending = await asyncio.wait(tasks, timeout=timeout_s)
        reporter.cancel()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, reporter, return_exceptions=True)
        for task in finished:
            if task.exception() is not None:
                raise task.exception()
    last = max((r.finished_s for r in records if r.ok), default=0.0)
    for r in records:
        if not r.ok and r.error is None:
            r.error = "not finished when the run timed out"
    return ClientRun(sorted(records, key=lambda r: (r.conversation, r.turn)), last, bool(pending))


def run_client(url: str, model: str, conversations: list[Conversation], rate: float | None, logprobs: bool = False,
               timeout_s: float = 3600.0, progress_interval_s: float = 15.0, progress=print) -> ClientRun:
    """Every conversation, closed loop; `rate` None: all start at once."""
    return asyncio.run(_run_client(url, model, conversations, rate, logprobs, timeout_s, progress_interval_s,
                                   progress))


# ---------------------------------------------------------------- server counters

# vLLM 0.32's Prometheus counters (v1/metrics/loggers.py), as /metrics names them.
PROMPT_TOKENS = "vllm:prompt_tokens_total"
# source: local_compute (prefilled), local_cache_hit, external_kv_transfer
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
HOST_TIER_QUERIES = "vllm:external_prefix_cache_queries_total"  # tokens asked of the connector beyond vLLM's hit
HOST_TIER_HITS = "vllm:external_prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
# Cached prompt tokens by the tier that supplied them: device (vLLM's KV cache), host, disk, p2p, or
# external_unspecified when the connector does not say (vLLM's CacheHitSource).
CACHED_BY_TIER = "vllm:prompt_tokens_cached_by_source_total"
COUNTERS = (PROMPT_TOKENS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, HOST_TIER_QUERIES, HOST_TIER_HITS, PREEMPTIONS)
BY_SOURCE = (PROMPT_TOKENS_BY_SOURCE, CACHED_BY_TIER)  # kept apart per `source` label, as name{source}


def parse_counters(text: str) -> dict[str, float]:
    """The counters above, summed over label sets but for `source`."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                key = sample.name
            elif sample.name in BY_SOURCE:
                key = f"{sample.name}{{{sample.labels.get('source')}}}"
            else:
                continue
            values[key] = values.get(key, 0.0) + sample.value
    return values


def read_counters(url: str) -> dict[str, float]:
    return parse_counters(metrics_text(url, timeout_s=30))


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# ---------------------------------------------------------------- metrics of a run

def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


@dataclass
class RunMetrics:
    config: str
    rate: float  # conversations per second
    conversations: int
    conversations_completed: int
    turns: int
    turns_completed: int
    timed_out: bool
    duration_s: float
    request_throughput: float  # answered turns per second
    output_throughput: float  # answer tokens per second
    ttft_p50_s: float | None  # turns >= 2
    ttft_p90_s: float | None  # turns >= 2
    ttft_first_turn_p50_s: float | None
    normalised_latency_mean_s: float | None  # seconds per output token, all turns
    normalised_latency_p50_s: float | None
    normalised_latency_p90_s: float | None
    prompt_tokens: int | None  # the server's counters over the run
    prefill_computed_tokens: int | None  # prompt tokens neither in the prefix cache nor loaded from the host tier
    prefix_cache_hit_tokens: int | None  # from vLLM's KV cache
    host_tier_hit_tokens: int | None  # loaded by the connector
    prefix_cache_hit_rate: float | None  # hits / queries of vLLM's prefix cache
    host_tier_hit_rate: float | None  # hits / queries of the connector (tokens beyond vLLM's hit); None without one
    cached_tokens_by_tier: dict[str, int]  # CACHED_BY_TIER's sources with tokens: device, host, disk, ...
    preemptions: int | None
    peak_kv_cache_usage: float | None
    peak_running: int | None


def summarise_run(config: str, rate: float, conversations: list[Conversation], client: ClientRun,
                  counters: dict[str, float] | None, poller=None) -> RunMetrics:
    answered = [r for r in client.records if r.ok]
    later_ttfts = [r.ttft_s for r in answered if r.turn >= 2]
    first_ttfts = [r.ttft_s for r in answered if r.turn == 1]
    normalised = [r.normalised_latency_s for r in answered]
    completed = sum(sum(r.ok for r in client.records if r.conversation == c.index) == len(c.turns)
                    for c in conversations)
    counters = counters or {}

    def counter(name: str) -> int | None:
        return int(counters[name]) if name in counters else None

    has_connector = CONFIGS[config].eviction_policy is not None if config in CONFIGS else HOST_TIER_QUERIES in counters
    summary = poller.summary() if poller is not None else None
    return RunMetrics(
        config=config, rate=rate, conversations=len(conversations), conversations_completed=completed,
        turns=sum(len(c.turns) for c in conversations), turns_completed=len(answered), timed_out=client.timed_out,
        duration_s=client.duration_s,
        request_throughput=len(answered) / client.duration_s if client.duration_s else 0.0,
        output_throughput=sum(len(r.answer) for r in answered) / client.duration_s if client.duration_s else 0.0,
        ttft_p50_s=_pct(later_ttfts, 50), ttft_p90_s=_pct(later_ttfts, 90), ttft_first_turn_p50_s=_pct(first_ttfts, 50),
        normalised_latency_mean_s=sum(normalised) / len(normalised) if normalised else None,
        normalised_latency_p50_s=_pct(normalised, 50), normalised_latency_p90_s=_pct(normalised, 90),
        prompt_tokens=counter(PROMPT_TOKENS),
        prefill_computed_tokens=counter(f"{PROMPT_TOKENS_BY_SOURCE}{{local_compute}}"),
        prefix_cache_hit_tokens=counter(f"{PROMPT_TOKENS_BY_SOURCE}{{local_cache_hit}}"),
        host_tier_hit_tokens=counter(f"{PROMPT_TOKENS_BY_SOURCE}{{external_kv_transfer}}"),
        prefix_cache_hit_rate=_ratio(counters.get(PREFIX_CACHE_HITS), counters.get(PREFIX_CACHE_QUERIES)),
        host_tier_hit_rate=(_ratio(counters.get(HOST_TIER_HITS), counters.get(HOST_TIER_QUERIES))
                            if has_connector else None),
        cached_tokens_by_tier={key[len(CACHED_BY_TIER) + 1:-1]: int(value) for key, value in counters.items()
                               if key.startswith(CACHED_BY_TIER + "{") and value},
        preemptions=counter(PREEMPTIONS),
        peak_kv_cache_usage=summary.peak_kv_cache_usage if summary else None,
        peak_running=summary.peak_running if summary else None,
    )


# ---------------------------------------------------------------- the SLO

@dataclass(frozen=True)
class SloResult:
    highest_swept_rate: float | None  # the highest swept rate with this and every lower rate under the SLO
    interpolated_rate: float | None  # where p90 normalised latency crosses the SLO, linearly between two rates
    all_under: bool  # every swept rate was under: the true limit is at least the highest rate

    def describe(self) -> str:
        if self.interpolated_rate is None:
            return "over the SLO already at the lowest rate"
        return (f"{'>= ' if self.all_under else ''}{self.interpolated_rate:.3g} conv/s"
                f"{'' if self.all_under else f' (highest swept rate under it: {self.highest_swept_rate:g})'}")


def max_rate_under_slo(points: dict[float, float | None], slo_s: float) -> SloResult:
    """`points`: rate -> p90 normalised latency (None: the run failed or timed out, over any SLO).
    Walks up the rates until the first one over the SLO; the crossing is interpolated between it and the
    last one under. Rates above the first one over are ignored: latency has to stay under."""
    last_under: tuple[float, float] | None = None
    for rate in sorted(points):
        latency = points[rate]
        if latency is not None and latency <= slo_s:
            last_under = (rate, latency)
            continue
        if last_under is None:
            return SloResult(None, None, False)
        r0, l0 = last_under
        crossing = r0 if latency is None else r0 + (slo_s - l0) * (rate - r0) / (latency - l0)
        return SloResult(r0, crossing, False)
    if last_under is None:
        return SloResult(None, None, False)
    return SloResult(last_under[0], last_under[0], True)


# ---------------------------------------------------------------- the correctness gate

LOGPROB_ATOL = 1e-3  # the project's float32 tolerance on top logprobs (tests/e2e, bench/offline.py)


@dataclass
class GateResult:
    config: str
    reference: str
    turns_compared: int
    conversations_diverged_at_near_tie: list[str]  # "conversation c turn t": compared up to there
    problems: list[str]  # each a difference outside the tolerance; any fails the gate
    worst_logprob_diff: float

    @property
    def passed(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        line = (f"{self.config}: {self.turns_compared} turns compared with {self.reference}, "
                f"worst top logprob difference {self.worst_logprob_diff:.2g}")
        if self.conversations_diverged_at_near_tie:
            line += "; parted at a near tie: " + ", ".join(self.conversations_diverged_at_near_tie)
        if self.problems:
            line += "; DIFFERENT: " + "; ".join(self.problems[:5]) + (" ..." if len(self.problems) > 5 else "")
        return line


def _as_compared(record: TurnRecord) -> dict:
    return {"tokens": record.answer, "top_logprobs": record.top_logprobs or [[] for _ in record.answer]}


def compare_conversations(config: str, reference: str, ours: list[TurnRecord], theirs: list[TurnRecord],
                          atol: float = LOGPROB_ATOL) -> GateResult:
    """Turn by turn, conversation by conversation: each turn's tokens equal and top logprobs within `atol`,
    a token differing only at a near tie (testing/compare.py). After a turn that parted at a near tie the
    conversation's later prompts differ, so it is compared no further. A turn one run lacks is a problem."""
    by_turn = {(r.conversation, r.turn): r for r in theirs}
    result = GateResult(config, reference, 0, [], [], 0.0)
    parted: set[int] = set()
    for record in sorted(ours, key=lambda r: (r.conversation, r.turn)):
        if record.conversation in parted:
            continue
        name = f"conversation {record.conversation} turn {record.turn}"
        other = by_turn.get((record.conversation, record.turn))
        if other is None or not other.ok or not record.ok:
            reason = record.error or (other.error if other else f"{reference} has no such turn")
            result.problems.append(f"{name}: not answered by both ({reason})")
            parted.add(record.conversation)
            continue
        if len(record.answer) != len(other.answer):
            result.problems.append(f"{name}: {len(record.answer)} tokens against {len(other.answer)}")
            parted.add(record.conversation)
            continue
        report = compare_runs({"results": [_as_compared(other)]}, {"results": [_as_compared(record)]}, atol, atol)
        result.turns_compared += 1
        result.worst_logprob_diff = max(result.worst_logprob_diff, report["worst_logprob_diff"])
        result.problems += [f"{name}: {p.removeprefix('request 0 ')}" for p in report["problems"]]
        if report["diverged_requests"]:
            parted.add(record.conversation)
            if not report["problems"]:
                result.conversations_diverged_at_near_tie.append(name)
    turns = {(r.conversation, r.turn) for r in ours}
    result.problems += [f"conversation {c} turn {t}: missing" for c, t in sorted(set(by_turn) - turns)
                        if c not in parted]
    return result


def answers_agreeing(ours: list[TurnRecord], theirs: list[TurnRecord]) -> tuple[int, int]:
    """Informational, for the timed runs (no logprobs there): turns with identical answers, turns compared."""
    by_turn = {(r.conversation, r.turn): r.answer for r in theirs if r.ok}
    pairs = [(r.answer, by_turn[(r.conversation, r.turn)])
             for r in ours if r.ok and (r.conversation, r.turn) in by_turn]
    return sum(a == b for a, b in pairs), len(pairs)


# ---------------------------------------------------------------- options

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_chunkattn.bench.multiturn", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Full mode's defaults (bench-gqa, 12 conversations of 5 turns at 0.1, 0.2 and 0.3 conv/s, four "
               "configurations, a server start per run) should take 30 to 45 minutes on a 2-core CPU: an estimate "
               "from the serving benchmark's bench-gqa rates, not a measurement. --quick takes about 2 minutes.")
    add_model_arguments(ap, default="bench-gqa")
    ap.add_argument("--quick", action="store_true",
                    help="CI: tiny model, 4 conversations of 5 short turns, one rate; the same checks")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"which configurations, of {', '.join(CONFIGS)}")
    ap.add_argument("--rates", help="Poisson arrival rates of new conversations (conversations/s), swept "
                    "(default 0.1,0.2,0.3; --quick 1)")
    ap.add_argument("--conversations", type=int, help="conversations per run (default 12; --quick 4)")
    ap.add_argument("--turns", type=int, default=5, help="turns per conversation (the paper keeps conversations "
                    "of at least 5)")
    ap.add_argument("--length-scale", type=float, help="message lengths are ShareGPT-like means "
                    f"({SHAREGPT_USER_MEAN} tokens per user message, {SHAREGPT_ANSWER_MEAN} per answer) times this "
                    "(default 0.25; --quick 0.125)")
    ap.add_argument("--think-time", type=float, help="mean seconds a user thinks between an answer and the next "
                    "message, exponential (default 5: the paper's minimum response time; --quick 0.5)")
    ap.add_argument("--kv-ratio", type=float, default=4.0, help="the conversations' KV over the KV cache: "
                    "--num-gpu-blocks-override is their blocks / this (at least the longest conversation's)")
    ap.add_argument("--host-ratio", type=float, default=0.5, help="the host tier's size over the conversations' "
                    "KV (below 1 it evicts too, where Pensieve's policy and LRU differ)")
    ap.add_argument("--host-cache-gib", type=float, help="the host tier's size (default: from --host-ratio)")
    ap.add_argument("--slo", type=float, help="SLO on p90 normalised latency, seconds per output token "
                    "(default: --slo-factor x the median normalised latency of the lowest-rate stock run)")
    ap.add_argument("--slo-factor", type=float, default=5.0, help="see --slo")
    ap.add_argument("--check-conversations", type=int, help="conversations of the greedy check, all at once, "
                    "after each configuration's last run (default 3; --quick 2)")
    ap.add_argument("--dtype", default="float32", help="float32: greedy answers comparable across configurations")
    ap.add_argument("--block-size", type=int, default=32, help="tokens per KV block, every server")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the servers' largest batch")
    ap.add_argument("--seed", type=int, default=0, help="of the workload; also the servers' --seed")
    ap.add_argument("--extra-server-args", default="", help="more `vllm serve` options, given to every server")
    ap.add_argument("--out", help="results folder (default: results/multiturn/<timestamp>)")
    ap.add_argument("--progress-interval", type=float, help="seconds between progress lines (default 15; --quick 5)")
    ap.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics samples "
                    "(peak KV cache usage and batch)")
    ap.add_argument("--run-timeout", type=float, default=1200.0, help="seconds after which a run is stopped; "
                    "its unanswered turns count as failed and it is over any SLO")
    args = ap.parse_args(argv)
    quick = args.quick
    args.model_name = args.model_name or ("tiny" if quick else "bench-gqa")
    args.rates = sorted(float(r) for r in (args.rates or ("1" if quick else "0.1,0.2,0.3")).split(",") if r.strip())
    args.conversations = args.conversations or (4 if quick else 12)
    args.length_scale = args.length_scale or (0.125 if quick else 0.25)
    args.think_time = args.think_time if args.think_time is not None else (0.5 if quick else 5.0)
    args.check_conversations = args.check_conversations or (2 if quick else 3)
    args.progress_interval = args.progress_interval or (5.0 if quick else 15.0)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    if not args.rates or min(args.rates) <= 0:
        ap.error("--rates needs positive rates")
    if args.turns < 2 or args.conversations < 1:
        ap.error("need at least one conversation of at least two turns")
    return args


def workload_shapes(args: argparse.Namespace, vocab_size: int) -> tuple[WorkloadShape, WorkloadShape]:
    """The timed conversations, and the greedy check's (the same distributions, all at once)."""
    user = LengthDistribution(SHAREGPT_USER_MEAN * args.length_scale)
    answer = LengthDistribution(SHAREGPT_ANSWER_MEAN * args.length_scale, minimum=2)
    timed = WorkloadShape(args.conversations, args.turns, user, answer, args.think_time, vocab_size)
    checked = WorkloadShape(args.check_conversations, args.turns, user, answer, 0.0, vocab_size)
    return timed, checked


def engine_args(args: argparse.Namespace, sizing: CacheSizing) -> list[str]:
    """What every server gets, identically."""
    common = ["--dtype", args.dtype, "--enforce-eager", "--block-size", str(args.block_size),
              "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(sizing.max_model_len),
              "--num-gpu-blocks-override", str(sizing.kv_cache_blocks), "--seed", str(args.seed),
              # usage.prompt_tokens_details.cached_tokens per turn, for the raw records
              "--enable-prompt-tokens-details"]
    return common + shlex.split(args.extra_server_args)


def run_order(configs: list[str], rate_index: int) -> list[str]:
    """The configurations at one rate, rotated by the rate's index so none always goes first."""
    shift = rate_index % len(configs)
    return configs[shift:] + configs[:shift]


# ---------------------------------------------------------------- the report

def _ms(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{1000 * x:.{digits}f}"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pct_str(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


METRIC_TABLES = (  # title, cell of a run
    ("Throughput, answered turns/s", lambda m: _num(m["request_throughput"], "{:.3f}")),
    ("Output tokens/s", lambda m: _num(m["output_throughput"], "{:.1f}")),
    ("TTFT of turns >= 2, p50 ms", lambda m: _ms(m["ttft_p50_s"])),
    ("TTFT of turns >= 2, p90 ms", lambda m: _ms(m["ttft_p90_s"])),
    ("Normalised latency (end-to-end / output tokens), mean ms/token",
     lambda m: _ms(m["normalised_latency_mean_s"], 2)),
    ("Normalised latency, p90 ms/token", lambda m: _ms(m["normalised_latency_p90_s"], 2)),
    ("Prefill tokens computed (of the prompt tokens)", lambda m: "–" if m["prefill_computed_tokens"] is None else
     f"{m['prefill_computed_tokens']} of {m['prompt_tokens']}"
     + (f" ({100 * m['prefill_computed_tokens'] / m['prompt_tokens']:.0f}%)" if m["prompt_tokens"] else "")),
    ("Prefix cache (vLLM's KV cache) hit rate, hits / queries", lambda m: _pct_str(m["prefix_cache_hit_rate"])),
    ("Host tier (PensieveConnector) hit rate, hits / queries beyond the prefix cache's hit",
     lambda m: _pct_str(m["host_tier_hit_rate"])),
    ("Tokens from the host tier", lambda m: _num(m["host_tier_hit_tokens"], "{:d}")),
    ("Cached prompt tokens by the tier that supplied them (vLLM's `prompt_tokens_cached_by_source`)",
     lambda m: ", ".join(f"{tier} {n}" for tier, n in sorted(m["cached_tokens_by_tier"].items())) or "none"),
    ("Preemptions", lambda m: _num(m["preemptions"], "{:d}")),
    ("Conversations completed", lambda m: f"{m['conversations_completed']}/{m['conversations']}"
     + (" (timed out)" if m["timed_out"] else "")),
)


def metric_tables(results: dict) -> list[str]:
    configs = results["configs"]
    runs = {(r["config"], r["rate"]): r for r in results["runs"]}
    lines = []
    for title, cell in METRIC_TABLES:
        lines += [f"### {title}", "", "| conv/s | " + " | ".join(configs) + " |",
                  "|---:|" + "---:|" * len(configs)]
        for rate in results["rates"]:
            cells = []
            for config in configs:
                run = runs.get((config, rate))
                if run is None:
                    cells.append("not run")
                elif run.get("withheld"):
                    cells.append("withheld")
                else:
                    cells.append(cell(run["metrics"]))
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def slo_summary(results: dict) -> tuple[list[str], dict]:
    """The highest rate under the SLO per configuration, pensieve/stock there, and TTFT p90 ratios."""
    configs, slo = results["configs"], results["slo"]
    summary = {"slo_s_per_token": slo["seconds_per_token"], "by_config": {}}
    lines = [f"### Highest rate under the SLO: p90 normalised latency <= {_ms(slo['seconds_per_token'], 2)} ms/token",
             "", slo["why"], ""]
    if slo["seconds_per_token"] is None:
        return lines + ["No SLO: the reference run has no latency.", ""], summary
    lines += ["| configuration | highest rate under the SLO |", "|---|---|"]
    for config in configs:
        runs = [r for r in results["runs"] if r["config"] == config]
        if not runs or any(r.get("withheld") for r in runs):
            lines.append(f"| {config} | withheld (greedy check failed) |" if runs else f"| {config} | not run |")
            continue
        # A run with unanswered turns (timed out, server died) claims no latency: it is over any SLO.
        points = {r["rate"]: r["metrics"]["normalised_latency_p90_s"]
                  if r["metrics"]["turns_completed"] == r["metrics"]["turns"] else None for r in runs}
        result = max_rate_under_slo(points, slo["seconds_per_token"])
        summary["by_config"][config] = asdict(result)
        lines.append(f"| {config} | {result.describe()} |")
    lines.append("")
    ours, theirs = summary["by_config"].get("pensieve"), summary["by_config"].get("stock")
    if ours and theirs:
        if theirs["interpolated_rate"] and ours["interpolated_rate"] is not None:
            ratio = ours["interpolated_rate"] / theirs["interpolated_rate"]
            bound = " (a lower bound: pensieve stayed under the SLO at every rate)" if ours["all_under"] else ""
            bound += " (stock stayed under the SLO at every rate: sweep higher rates)" if theirs["all_under"] else ""
            summary["pensieve_over_stock_rate"] = ratio
            lines.append(f"**pensieve / stock, rate at the SLO: {ratio:.2f}x**{bound} (issue 14's target: >= 1.3x)")
        else:
            lines.append("pensieve / stock at the SLO: undefined (a configuration is over the SLO at the lowest rate)")
        lines.append("")
        by_rate = {(r["config"], r["rate"]): r["metrics"] for r in results["runs"] if not r.get("withheld")}
        ttft = []
        for rate in results["rates"]:
            a, b = by_rate.get(("pensieve", rate)), by_rate.get(("stock", rate))
            value = _ratio(a and a["ttft_p90_s"], b and b["ttft_p90_s"])
            if value is not None:
                ttft.append((rate, value))
        summary["pensieve_over_stock_ttft_p90"] = {str(rate): v for rate, v in ttft}
        if ttft:
            lines += ["p90 TTFT of turns >= 2, pensieve / stock: "
                      + ", ".join(f"{v:.2f} at {rate:g} conv/s" for rate, v in ttft) + " (target: below 1)", ""]
    return lines, summary


def markdown(results: dict) -> str:
    w, sizing = results["workload"], results["sizing"]
    lines = [
        "## Multi-turn benchmark: stock vLLM against the PensieveConnector", "",
        machine.describe_line(results["machine"]), "",
        machine.IDENTITY_LINE.format(results["machine"]["cpu_identity"]), "",
        *machine.other_cpu_warning(results.get("results_from_other_cpus", [])),
        "```", results["command"], "```", "",
        (f"Model `{Path(results['model']).name}`; {w['conversations']} conversations of {w['turns']} turns per run, "
         f"arriving as a Poisson process at each rate; user messages {w['user_tokens_mean']:.0f} tokens and answers "
         f"{w['answer_tokens_mean']:.0f} tokens on average (lognormal, sigma {LENGTH_SIGMA:g}, clipped at "
         f"{TAIL_CAP:g}x the mean), think time exponential with mean {w['think_time_mean_s']:g} s; conversations end "
         f"at {w['conversation_tokens_mean']:.0f} tokens on average, {w['conversation_tokens_max']} at most."),
        "",
        (f"KV cache: {sizing['kv_cache_blocks']} blocks of {sizing['block_size']} tokens; the conversations' KV is "
         f"{sizing['conversation_blocks']} blocks, **{sizing['kv_ratio']:.1f}x the KV cache**. Peak KV of the "
         "conversations alive at once (a bound from below: zero service time): "
         + ", ".join(f"{sizing['peak_live_ratio'][str(r)]:.1f}x the cache at {r:g} conv/s" for r in results["rates"])
         + f". Host tier: {sizing['host_tier_blocks']} blocks ({sizing['host_cache_gib']:.4g} GiB)."),
        "",
        f"Every server: `{shlex.join(results['engine_args'])}`; per configuration: "
        + "; ".join(f"{name}: `{shlex.join(args) or '(nothing more)'}`"
                    for name, args in results["config_args"].items()),
        "",
        ("Each run starts its own server (an empty KV cache and host tier; the connector has no reset), the "
         "configurations one after another at each rate, in an order rotated per rate."),
        "",
        "### Greedy check", "",
        *([f"- {g['summary']}" for g in results["gate"].values()]
          or [f"Nothing to compare: {results['reference']} ran alone."]), "",
    ]
    agreement = results.get("timed_answers_identical") or {}
    if agreement:
        lines += ["Identical answers to the reference's in the timed runs (informational; batching may part a near "
                  "tie): " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in agreement.items()), ""]
    lines += metric_tables(results)
    lines += results.get("slo_lines", [])
    copies = {name: info["copy_times"] for name, info in results["servers"].items() if info.get("copy_times")}
    if copies:
        lines += ["### Host-tier copies", "",
                  "The connector's worker at shutdown: its copies between vLLM's KV cache and the host tier, which run "
                  "a layer at a time on a background thread during the forward pass, and how long the forward pass "
                  "waited for them.", "", *[f"- {name}: {line}" for name, line in copies.items()], ""]
    lines += ["Normalised latency: a turn's end-to-end latency (sent to last token, server queueing included, think "
              "time not) over its output tokens. TTFT: sent to the first streamed token. Prefill computed and hit "
              "counts: the server's counters (`vllm:prompt_tokens_by_source`, `vllm:prefix_cache_*`, "
              "`vllm:external_prefix_cache_*`) read before and after the run.", ""]
    return "\n".join(lines)


STYLE = {"stock-nocache": dict(color="tab:gray", marker="x"), "stock": dict(color="tab:blue", marker="o"),
         "pensieve-lru": dict(color="tab:orange", marker="^"), "pensieve": dict(color="tab:red", marker="s")}
PLOTS = {  # file: (metric, y label)
    "normalised_latency_p90.png": ("normalised_latency_p90_s", "p90 normalised latency (ms/token)"),
    "ttft_p90_turns2plus.png": ("ttft_p90_s", "p90 TTFT of turns >= 2 (ms)"),
}


def write_plots(results: dict, out: Path) -> list[str]:
    plt = _pyplot()
    for name, (metric, label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5.5, 4.0))
        for config in results["configs"]:
            points = sorted((r["rate"], 1000 * r["metrics"][metric]) for r in results["runs"]
                            if r["config"] == config and not r.get("withheld") and r["metrics"][metric] is not None)
            if points:
                ax.plot(*zip(*points), label=config, **STYLE.get(config, {}))
        slo = results["slo"]["seconds_per_token"]
        if metric == "normalised_latency_p90_s" and slo:
            ax.axhline(1000 * slo, color="black", linestyle="--", linewidth=0.8, label="SLO")
        ax.set_xlabel("new conversations per second")
        ax.set_ylabel(label)
        ax.set_title(f"{Path(results['model']).name}: {results['workload']['conversations']} conversations x "
                     f"{results['workload']['turns']} turns", fontsize=9)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    return list(PLOTS)


# ---------------------------------------------------------------- main

def default_slo(results: dict, factor: float) -> dict:
    """`factor` x the median normalised latency of the reference's lowest-rate run: nearly uncontended,
    so the SLO is "at most `factor` times slower per token than an idle server"."""
    reference = results["reference"]
    lowest = min(results["rates"])
    run = next((r for r in results["runs"] if r["config"] == reference and r["rate"] == lowest
                and not r.get("withheld")), None)
    base = run and run["metrics"]["normalised_latency_p50_s"]
    return {"seconds_per_token": factor * base if base else None,
            "why": (f"SLO: {factor:g}x the median normalised latency of {reference}'s run at {lowest:g} conv/s "
                    f"({_ms(base, 2)} ms/token), the least contended run (`--slo-factor`; `--slo` sets it).")}


# What run_once keeps of the connector's log lines (results.json, "servers"): its tier at start, and at
# shutdown how long its copies took and how long the forward pass waited for them.
CONNECTOR_LOG_LINES = {"connector_log": "host tier of", "copy_times": "host-tier copies took"}


def run_once(args, model: str, config: ServerConfig, rate: float, timed: list[Conversation],
             checked: list[Conversation] | None, sizing: CacheSizing, common: list[str], out: Path,
             progress) -> tuple[RunMetrics | None, ClientRun | None, ClientRun | None, dict]:
    """One server start: the timed run at `rate`, then (given `checked`) the greedy check on the same server."""
    name = f"{config.name}-r{rate:g}"
    server = VllmServer(model, config.server_args(sizing.host_cache_gib) + common,
                        log_path=out / "logs" / f"{name}.server.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    info: dict = {"url": server.url, "log": str(server.log_path.relative_to(out))}
    started = time.monotonic()
    try:
        server.start()
    except ServerError:
        for line in error_lines(server.log_text()):
            progress(f"    {config.name}: {line}")
        info["error"] = "server did not start"
        return None, None, None, info
    try:
        info["start_s"] = time.monotonic() - started
        progress(f"    healthy after {info['start_s']:.0f} s on {server.url}")
        before = read_counters(server.url)
        with MetricsPoller(server.url, args.metrics_interval) as poller:
            client = run_client(server.url, model, timed, rate, timeout_s=args.run_timeout,
                                progress_interval_s=args.progress_interval, progress=progress)
        counters = counter_deltas(before, read_counters(server.url))
        metrics = summarise_run(config.name, rate, timed, client, counters, poller)
        info["counters"] = counters
        progress(f"    {metrics.turns_completed}/{metrics.turns} turns in {metrics.duration_s:.1f} s: "
                 f"{metrics.output_throughput:.1f} output tok/s, p90 normalised latency "
                 f"{_ms(metrics.normalised_latency_p90_s, 2)} ms/token, "
                 f"p90 TTFT turns>=2 {_ms(metrics.ttft_p90_s)} ms, "
                 f"prefill computed {metrics.prefill_computed_tokens}/{metrics.prompt_tokens} tokens, "
                 f"host tier {metrics.host_tier_hit_tokens or 0} tokens")
        check = None
        if checked is not None:
            t0 = time.monotonic()
            check = run_client(server.url, model, checked, None, logprobs=True, timeout_s=args.run_timeout,
                               progress_interval_s=args.progress_interval, progress=progress)
            progress(f"    greedy check: {sum(r.ok for r in check.records)} turns in {time.monotonic() - t0:.0f} s")
        if server.process.poll() is not None:
            info["error"] = "server exited: " + "; ".join(error_lines(server.log_text()))
        return metrics, client, check, info
    finally:
        server.stop()
        log_lines = server.log_text().splitlines()
        for key, mark in CONNECTOR_LOG_LINES.items():
            line = next((line for line in log_lines if f"PensieveConnector: {mark}" in line), None)
            if line:
                info[key] = line.split("PensieveConnector: ", 1)[1]


def _raw(records: list[TurnRecord]) -> list[dict]:
    return [{**asdict(r), "ttft_s": r.ttft_s, "normalised_latency_s": r.normalised_latency_s} for r in records]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = Progress()
    from vllm_chunkattn.testing.models import ensure_model

    model = args.model or ensure_model(args.model_name)
    kv_shape, vocab_size = read_model_shape(model, args.dtype)
    timed_shape, checked_shape = workload_shapes(args, vocab_size)
    timed = make_conversations(timed_shape, args.seed)
    checked = make_conversations(checked_shape, args.seed + 1)  # their own tokens: the timed ones are in the tiers
    sizing = size_caches(timed, checked, args.block_size, args.kv_ratio, args.host_ratio,
                         kv_shape.block_bytes(args.block_size))
    if args.host_cache_gib:
        sizing = CacheSizing(**{**asdict(sizing), "host_tier_blocks": int(args.host_cache_gib * 2 ** 30)
                                // sizing.block_bytes})
    common = engine_args(args, sizing)
    configs = [CONFIGS[c] for c in args.configs]
    reference = REFERENCE if REFERENCE in args.configs else args.configs[0]

    out = Path(args.out or f"results/multiturn/{datetime.now():%Y%m%d-%H%M%S}")
    for sub in ("raw", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    machine_record = machine.describe_machine()
    others = machine.results_from_other_cpus(out.parent, machine_record["cpu_identity"], exclude=(out,))
    progress(machine.describe_line(machine_record))
    if others:
        progress(f"WARNING: {out.parent} holds {len(others)} results files of another CPU (or of none recorded), "
                 f"listed in table.md; the first: {others[0]}")
    totals = [c.total_tokens for c in timed]
    results = {
        "command": ("python -m vllm_chunkattn.bench.multiturn "
                    + shlex.join(argv if argv is not None else sys.argv[1:])).strip(),
        "args": vars(args), "model": model, "machine": machine_record, "environment": environment_info(model),
        "results_from_other_cpus": others, "configs": args.configs, "reference": reference, "rates": args.rates,
        "engine_args": common, "config_args": {c.name: c.server_args(sizing.host_cache_gib) for c in configs},
        "workload": {
            "conversations": len(timed), "turns": args.turns, "seed": args.seed,
            "user_tokens_mean": timed_shape.user_tokens.clipped_mean(),
            "answer_tokens_mean": timed_shape.answer_tokens.clipped_mean(),
            "think_time_mean_s": args.think_time,
            "conversation_tokens_mean": sum(totals) / len(totals), "conversation_tokens_max": max(totals),
            "check_conversations": len(checked),
        },
        "sizing": {**asdict(sizing), "kv_ratio": sizing.kv_ratio, "host_cache_gib": sizing.host_cache_gib,
                   "peak_live_ratio": {str(r): peak_live_blocks(timed, r, args.block_size) / sizing.kv_cache_blocks
                                       for r in args.rates}},
        "runs": [], "gate": {}, "servers": {},
    }
    progress(f"results in {out}; {len(timed)} conversations x {args.turns} turns, "
             f"{sum(totals)} tokens in all; rates {', '.join(f'{r:g}' for r in args.rates)} conv/s; "
             f"configurations {', '.join(args.configs)}")
    progress(f"KV cache {sizing.kv_cache_blocks} blocks of {sizing.block_size}: the conversations' KV "
             f"({sizing.conversation_blocks} blocks) is {sizing.kv_ratio:.1f}x it; host tier {sizing.host_tier_blocks} "
             f"blocks ({sizing.host_cache_gib:.4g} GiB); max-model-len {sizing.max_model_len}")
    if sizing.kv_ratio < 2:
        progress(f"WARNING: the KV cache is only {sizing.kv_ratio:.1f}x smaller than the conversations' KV (the "
                 "longest conversation sets its size): more or shorter conversations would evict more")

    previous = {s: signal.signal(s, raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 0
    clients: dict[tuple[str, float], ClientRun] = {}
    checks: dict[str, ClientRun] = {}
    try:
        total = len(args.rates) * len(configs)
        done = 0
        for rate_index, rate in enumerate(args.rates):
            for name in run_order(args.configs, rate_index):
                done += 1
                last = rate_index == len(args.rates) - 1
                progress(f"[{done}/{total}] {name} at {rate:g} conv/s" + (", then the greedy check" if last else ""))
                metrics, client, check, info = run_once(args, model, CONFIGS[name], rate, timed,
                                                        checked if last else None, sizing, common, out, progress)
                results["servers"][f"{name}-r{rate:g}"] = info
                if client is not None:
                    clients[(name, rate)] = client
                    (out / "raw" / f"{name}-r{rate:g}.json").write_text(json.dumps(_raw(client.records)) + "\n")
                    results["runs"].append({"config": name, "rate": rate, "metrics": asdict(metrics)})
                if check is not None:
                    checks[name] = check
                    (out / "raw" / f"{name}-check.json").write_text(json.dumps(_raw(check.records)) + "\n")
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({str(exc) or 'Ctrl-C'}); servers stopped")
        status = 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

    # The gate: every configuration's greedy answers against the reference's.
    failed = []
    for name in args.configs:
        if name == reference:
            continue
        if name not in checks or reference not in checks:
            missing = name if name not in checks else reference
            gate = {"passed": False, "summary": f"{name}: no greedy check ({missing}'s did not run)"}
        else:
            result = compare_conversations(name, reference, checks[name].records, checks[reference].records)
            gate = {**asdict(result), "passed": result.passed, "summary": result.describe()}
        results["gate"][name] = gate
        progress(f"greedy check: {gate['summary']}")
        if not gate["passed"]:
            failed.append(name)
    for run in results["runs"]:
        if run["config"] in failed:
            run["withheld"] = True
            run.pop("metrics")  # no speed for a configuration whose answers are wrong
    results["timed_answers_identical"] = {
        f"{name}@{rate:g}": answers_agreeing(client.records, clients[(reference, rate)].records)
        for (name, rate), client in clients.items() if name != reference and (reference, rate) in clients}
    results["slo"] = ({"seconds_per_token": args.slo, "why": "SLO given with --slo."} if args.slo
                      else default_slo(results, args.slo_factor))
    results["slo_lines"], results["slo_summary"] = slo_summary(results)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    table = markdown(results)
    (out / "table.md").write_text(table)
    plots = write_plots(results, out) if results["runs"] else []
    print("\n" + table, flush=True)
    progress(f"wrote table.md, results.json, {', '.join(plots)} in {out}")
    summary = results["slo_summary"]
    line = "SLO summary: " + "; ".join(f"{c}: {SloResult(**r).describe()}" for c, r in summary["by_config"].items())
    if "pensieve_over_stock_rate" in summary:
        line += f"; pensieve/stock at the SLO {summary['pensieve_over_stock_rate']:.2f}x (target >= 1.3x)"
    progress(line)
    if failed:
        progress(f"FAILED greedy check: {', '.join(failed)} (no speed reported for them)")
        status = status or 1
    if len(results["runs"]) < len(args.rates) * len(configs) and status == 0:
        progress("FAILED: some runs did not happen (a server did not start)")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
