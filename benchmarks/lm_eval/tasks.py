"""Loaders for the offline task set (lm-eval `custom_dataset` callables): the
data lies next to this file, so nothing is fetched from a hub. Sources are
in README.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _rows(name: str) -> list[dict[str, Any]]:
    with open(HERE / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def hellaswag(**_: Any) -> datasets.DatasetDict:
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(
        _rows("hellaswag_val_500.jsonl"))})


def arithmetic_2da(**_: Any) -> datasets.DatasetDict:
    rows = _rows("arithmetic_2da_200.jsonl")
    for r in rows:  # "\n\nQ: What is 98 plus 45?\n\nA:" -> "What is 98 plus 45?"
        r["question"] = re.search(r"Q: (.*?)\n", r["context"]).group(1)
        r["answer"] = r["completion"].strip()
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})
