"""Dumping finished requests to disk (SGLang's --dump-requests-folder).

The TokenizerManager tells the dumper about every request it sends and every
output message it routes; when a request finishes, one JSON object goes into a
buffer: its input ids, sampling parameters, output text and ids, meta_info
(token counts, finish reason) and wall-clock timestamps. Every `threshold`
finished requests (and at shutdown) the buffer is appended to
`{folder}/requests-{start time}-{pid}.jsonl`, one object per line. JSON, never
pickle: a dump can be read by anything, and reading one runs no code.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from radixlm.protocol import GenerateReq, StrOut

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 1000


class RequestDumper:
    def __init__(self, folder: str | None = None, threshold: int = DEFAULT_THRESHOLD) -> None:
        self.folder: Path | None = None
        self.threshold = DEFAULT_THRESHOLD
        self.pending: dict[str, dict[str, Any]] = {}  # rid -> the record being built
        self.buffer: list[dict[str, Any]] = []
        self.file_name = f"requests-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
        self.configure(folder, threshold)

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    @property
    def path(self) -> Path | None:
        return self.folder / self.file_name if self.folder is not None else None

    def configure(self, folder: str | None = None, threshold: int | None = None) -> None:
        """Change the folder ("" turns dumping off) and/or the threshold at run time;
        what is buffered goes to the old folder first. ValueError for a threshold
        below 1 or a folder that cannot be created."""
        if threshold is not None:
            if not isinstance(threshold, int) or threshold < 1:
                raise ValueError(f"dump_requests_threshold must be an integer >= 1, got "
                                 f"{threshold!r}")
            self.threshold = threshold
        if folder is not None:
            new = Path(folder).expanduser() if folder else None
            if new is not None:
                try:
                    new.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ValueError(f"dump_requests_folder {folder!r} cannot be created: "
                                     f"{e}") from None
            self.flush()
            self.folder = new
            if new is None:
                self.pending.clear()
        if len(self.buffer) >= self.threshold:
            self.flush()

    # ---- events from the TokenizerManager ------------------------------------------------
    def on_submit(self, reqs: list[GenerateReq]) -> None:
        if self.folder is None:
            return
        now = time.time()
        for r in reqs:
            self.pending[r.rid] = {
                "rid": r.rid, "input_ids": list(r.input_ids),
                "sampling_params": dict(r.sampling_params), "stream": r.stream,
                "output_text": "", "output_ids": [], "created_time": now}

    def on_output(self, out: StrOut) -> None:
        record = self.pending.get(out.token.rid)
        if record is None:
            return
        t = out.token
        record["output_text"] += out.new_text
        record["output_ids"] += t.new_token_ids
        if t.finish_reason is None:
            return
        del self.pending[t.rid]
        record["meta_info"] = {
            "id": t.rid, "finish_reason": t.finish_reason, "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens, "cached_tokens": t.cached_tokens}
        record["finished_time"] = time.time()
        self.buffer.append(record)
        if len(self.buffer) >= self.threshold:
            self.flush()

    # ---- writing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Append the buffered records to the dump file (a failure is logged, not raised:
        dumping must never break serving)."""
        if not self.buffer or self.path is None:
            self.buffer.clear()
            return
        records, self.buffer = self.buffer, []
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
        except (OSError, TypeError, ValueError) as e:
            logger.error("could not dump %d request(s) to %s: %s", len(records), self.path, e)
            return
        logger.info("dumped %d request(s) to %s", len(records), self.path)

    def close(self) -> None:
        self.flush()
