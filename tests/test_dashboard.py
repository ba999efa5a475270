"""The /dashboard page in a real headless Chromium: the figures appear and
change under load; a screenshot goes to test-artifacts/dashboard.png (or
$RADIXLM_TEST_ARTIFACTS). The JSON endpoint and the throughput history are
also tested on their own, and so is deploy/grafana.json against the metrics
the server really exports."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
from browser import Browser, find_chromium
from server_utils import REPO, ServerProcess, default_server

from radixlm.server.dashboard import ThroughputHistory, dashboard_data
from radixlm.server.metrics import Metrics

ARTIFACTS = Path(os.environ.get("RADIXLM_TEST_ARTIFACTS", REPO / "test-artifacts"))
FIGURES = ("running", "queued", "kv-usage", "radix-tokens", "hit-rate", "gen-tps", "generated")
READ = """(() => {
  const o = {};
  for (const id of IDS) o[id] = document.getElementById(id).textContent;
  o.points = document.getElementById("chart").dataset.points;
  o.replicas = document.querySelectorAll("#replicas tr").length;
  return JSON.stringify(o);
})()""".replace("IDS", json.dumps(FIGURES))


def figures(browser: Browser) -> dict[str, str]:
    return json.loads(browser.evaluate(READ))


def load(server: ServerProcess, stop: threading.Event, n: int = 3) -> list[threading.Thread]:
    """Background chat requests until `stop` (bounded: each is 48 tokens)."""
    def worker() -> None:
        client = server.openai()
        for _ in range(20):
            if stop.is_set():
                return
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                      max_tokens=48, temperature=0.8)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.skipif(find_chromium() is None, reason="no Chromium (apt-get install chromium)")
def test_dashboard_in_a_browser() -> None:
    server = default_server()
    with Browser() as browser:
        browser.open(server.url + "/dashboard")
        assert browser.wait_for("document.getElementById('status').textContent"
                                ".startsWith('live')"), browser.evaluate("document.body.innerText")
        before = figures(browser)
        assert re.fullmatch(r"\d+(\.\d)?%", before["kv-usage"]) and before["replicas"] == 1
        stop = threading.Event()
        threads = load(server, stop)
        try:
            busy = browser.wait_for(
                "document.getElementById('running').textContent !== '0' && "
                "parseFloat(document.getElementById('gen-tps').textContent) > 0", timeout=60)
            during = figures(browser)
            # A few seconds of history, so the screenshot shows the chart too.
            browser.wait_for("document.getElementById('chart').dataset.points >= 6", timeout=30)
            browser.screenshot(ARTIFACTS / "dashboard.png")
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert busy, during
        assert int(during["running"]) > 0 and float(during["gen-tps"]) > 0
        assert int(during["points"]) >= 1
        generated = json.dumps(before["generated"])
        after = browser.wait_for(
            f"document.getElementById('generated').textContent !== {generated}"
            " && document.getElementById('running').textContent === '0'", timeout=60)
        assert after, figures(browser)
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_dashboard_data_endpoint() -> None:
    server = default_server()
    with server.client() as c:
        page = c.get("/dashboard")
        data = c.get("/dashboard/data").json()
    assert page.status_code == 200 and "/dashboard/data" in page.text
    assert {"running", "queued", "kv_usage", "radix_tokens", "cache_hit_rate", "throughput",
            "replicas"} <= set(data)
    assert data["model"] == "SmolLM2-135M-Instruct" and len(data["replicas"]) == 1


def test_throughput_history() -> None:
    history = ThroughputHistory()
    info = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_cached_tokens": 0,
            "kv_tokens_total": 100, "kv_tokens_in_use": 25}
    dashboard_data(info, history, "m", 0.0)
    dashboard_data({**info, "num_generated_tokens": 5}, history, "m", 0.5)  # too soon: skipped
    out = dashboard_data({**info, "num_generated_tokens": 40, "num_prompt_tokens": 20},
                         history, "m", 2.0)
    assert out["throughput"] == [{"ago": 0.0, "gen_tps": 20.0, "prompt_tps": 10.0}]
    assert out["kv_usage"] == 0.25
    dp = {**info, "dp": {"replicas": [info, {**info, "num_running_requests": 3}]}}
    assert [r["running"] for r in dashboard_data(dp, history, "m", 3.0)["replicas"]] == [0, 3]
    dashboard_data(info, history, "m", 400.0)
    assert len(history.samples) == 1  # older than five minutes: gone


def test_grafana_dashboard_uses_real_metrics() -> None:
    board = json.loads((REPO / "deploy" / "grafana.json").read_text())
    def family(name: str) -> str:
        return re.sub(r"_(bucket|sum|count|total)$", "", name)

    exported = {family(n) for n in re.findall(r"^# TYPE (radixlm:\w+) ",
                                              Metrics("m").render().decode(), re.M)}
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    for expr in exprs:
        used = set(re.findall(r"radixlm:\w+", expr))
        assert used, expr
        for name in used:
            assert family(name) in exported, (name, sorted(exported))
    assert board["title"] and all(p.get("title") for p in board["panels"])
