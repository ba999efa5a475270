"""A live status page: `GET /dashboard` (one static HTML file, no build step)
polls `GET /dashboard/data` every second.

The data is the scheduler's live state (the same reply /metrics and
/get_server_info read) plus throughput history. History is sampled when the
data is read, at most once a second, and kept for `HISTORY_S`: a server
nobody watches does no work for the page.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from radixlm.server.errors import APIError

HISTORY_S = 300.0
MIN_SAMPLE_GAP_S = 1.0


@dataclass
class Sample:
    t: float
    generated: int
    prompt: int


@dataclass
class ThroughputHistory:
    """Token counters over time, and the rates between consecutive samples."""

    samples: deque[Sample] = field(default_factory=deque)

    def add(self, info: dict[str, Any], now: float) -> None:
        s = Sample(now, int(info.get("num_generated_tokens", 0)),
                   int(info.get("num_prompt_tokens", 0)) + int(info.get("num_cached_tokens", 0)))
        if self.samples and now - self.samples[-1].t < MIN_SAMPLE_GAP_S:
            return
        self.samples.append(s)
        while self.samples and now - self.samples[0].t > HISTORY_S:
            self.samples.popleft()

    def rates(self, now: float) -> list[dict[str, float]]:
        """Per interval: seconds before now, generated and prompt tokens per second."""
        out = []
        pairs = list(self.samples)
        for a, b in zip(pairs, pairs[1:]):
            dt = b.t - a.t
            # A counter that went down is a restarted scheduler (weights reloaded): skip.
            if dt <= 0 or b.generated < a.generated or b.prompt < a.prompt:
                continue
            out.append({"ago": round(now - b.t, 2),
                        "gen_tps": round((b.generated - a.generated) / dt, 2),
                        "prompt_tps": round((b.prompt - a.prompt) / dt, 2)})
        return out


def replica_row(info: dict[str, Any], rank: int) -> dict[str, Any]:
    total = max(int(info.get("kv_tokens_total", 0)), 1)
    return {"dp_rank": rank, "running": info.get("num_running_requests", 0),
            "queued": info.get("num_queued_requests", 0),
            "kv_usage": info.get("kv_tokens_in_use", 0) / total,
            "radix_tokens": info.get("kv_tokens_cached", 0),
            "cache_hit_rate": info.get("cache_hit_rate", 0.0),
            "generated_tokens": info.get("num_generated_tokens", 0)}


def dashboard_data(info: dict[str, Any], history: ThroughputHistory, model: str,
                   now: float) -> dict[str, Any]:
    history.add(info, now)
    replicas = (info.get("dp") or {}).get("replicas") or [info]
    return {"model": model, "time": now, **replica_row(info, 0),
            "kv_tokens_total": info.get("kv_tokens_total", 0),
            "kv_tokens_in_use": info.get("kv_tokens_in_use", 0),
            "max_running_requests": info.get("max_running_requests", 0),
            "throughput": history.rates(now),
            "replicas": [replica_row(r, i) for i, r in enumerate(replicas)]}


def dashboard_html() -> str:
    return resources.files("radixlm.server").joinpath("static/dashboard.html").read_text()


def add_dashboard_routes(app: FastAPI, state: Any) -> None:
    history = ThroughputHistory()
    page = dashboard_html()

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/data")
    async def data() -> dict[str, Any]:
        if state.dead is not None:
            raise APIError(503, state.dead)
        reply = await state.tm.control("get_server_info", timeout=5.0)
        if not reply.success:
            raise APIError(500, reply.message)
        return dashboard_data(reply.result, history, state.served_name, time.monotonic())
