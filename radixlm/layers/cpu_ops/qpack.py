"""GGUF blocks (and float weights, for int8) into the kernels' tile layout.

Two steps. `decompose_gguf` reads a GGUF tensor's blocks as codes, scales
and mins/offsets such that scale * (code - offset) (symmetric formats) or
scale * code + min (the others) is exactly what gguf's dequantization
computes, in the same float32 operations; the K-quants' two-level scales
become one fp32 scale (and min) per sub-block, exact products of their parts.
`pack` then interleaves the codes of 16 rows and splits them into nibbles
and bit planes (`qgemm.h`). Both are numpy over whole tensors: a one-time
cost at load, cached with the converted checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixlm.layers.cpu_ops.qgemm import ACT_BLOCK, QuantizedWeight

TILE = 16
# format -> (code bits, k per scale, offset (symmetric) or None (scale * code + min))
LAYOUT = {
    "q4_0": (4, 32, 8), "q4_1": (4, 32, None), "q8_0": (8, 32, 128),
    "q4_k": (4, 32, None), "q5_k": (5, 32, None), "q6_k": (6, 16, 32), "int8": (8, 32, 128),
}
# GGUF type name -> our format; the types whose blocks we keep.
GGUF_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k",
                "Q5_K": "q5_k", "Q6_K": "q6_k"}
# Bytes per GGUF block and values per block.
_GGUF_BLOCKS = {"q4_0": (18, 32), "q4_1": (20, 32), "q8_0": (34, 32), "q4_k": (144, 256),
                "q5_k": (176, 256), "q6_k": (210, 256)}


@dataclass
class Codes:
    """W [n, k] as codes [n, k] (uint8), scales [n, k / block] (or [n] per
    channel) and mins (asymmetric formats), before the tile interleave."""

    format: str
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes of `chunk` nibble pairs -> [low nibbles of the chunk, high nibbles]."""
    qs = qs.reshape(qs.shape[0], -1, 1, chunk) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _k_scale_min(d: np.ndarray, dmin: np.ndarray, packed: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    import gguf.quants

    sc, m = gguf.quants.Q4_K.get_scale_min(packed)
    scale = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    return scale, -(dmin.astype(np.float32)[:, None] * m.astype(np.float32))


def _blocks_q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return _nibbles(b[:, 2:], 16), _f16(b[:, 0:2])[:, None], None


def _blocks_q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:], 16), _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]


def _blocks_q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return b[:, 2:] ^ np.uint8(0x80), _f16(b[:, 0:2])[:, None], None  # int8 q -> q + 128


def _blocks_q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, mins = _k_scale_min(_f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16])
    return _nibbles(b[:, 16:], 32), scale, mins


def _blocks_q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, mins = _k_scale_min(_f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    high = (qh & np.uint8(1)).reshape(b.shape[0], -1)
    return _nibbles(b[:, 48:], 32) | (high << np.uint8(4)), scale, mins


def _blocks_q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    low = _nibbles(b[:, :128], 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (qh & np.uint8(3)).reshape(b.shape[0], -1)
    sub_scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    scale = _f16(b[:, 208:210]).astype(np.float32)[:, None] * sub_scales
    return low | (high << np.uint8(4)), scale, None


_BLOCK_READERS = {"q4_0": _blocks_q4_0, "q4_1": _blocks_q4_1, "q8_0": _blocks_q8_0,
                  "q4_k": _blocks_q4_k, "q5_k": _blocks_q5_k, "q6_k": _blocks_q6_k}


def decompose_gguf(raw: np.ndarray, fmt: str, n: int, k: int) -> Codes:
    """The blocks of a GGUF tensor of type `fmt` (a GGUF_FORMATS value) with n
    rows of k values ([n, bytes per row] uint8, as GGUFReader gives them)."""
    block_bytes, block_values = _GGUF_BLOCKS[fmt]
    if k % block_values:
        raise ValueError(f"a {fmt} row of {k} values is not a whole number of blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    if blocks.shape[0] != n * k // block_values:
        raise ValueError(f"{fmt} data has {blocks.shape[0]} blocks, expected "
                         f"{n * k // block_values} for [{n}, {k}]")
    codes, scales, mins = _BLOCK_READERS[fmt](blocks)
    return Codes(fmt, codes.reshape(n, k), scales.reshape(n, -1),
                 None if mins is None else mins.reshape(n, -1))


def quantize_int8(w: torch.Tensor) -> Codes:
    """Per-channel symmetric int8 of a float weight [n, k]: scale = max|row| / 127,
    code = round(w / scale) + 128; k is padded with zeros to a multiple of 32."""
    w32 = w.detach().float().cpu()
    k = w32.shape[1]
    padded = -k % ACT_BLOCK
    if padded:
        w32 = torch.nn.functional.pad(w32, (0, padded))
    scale = w32.abs().amax(dim=1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(w32 * inv[:, None]).clamp_(-127, 127).to(torch.int16) + 128
    return Codes("int8", q.to(torch.uint8).numpy(), scale.numpy())


def dequantize_codes(c: Codes) -> np.ndarray:
    """W from its codes, in gguf's float32 operations (a reference for tests)."""
    _, block, offset = LAYOUT[c.format]
    n, k = c.codes.shape
    if c.format == "int8":
        return (c.codes.astype(np.float32) - np.float32(offset)) * c.scales[:, None]
    scales = np.repeat(c.scales.astype(np.float32), block, axis=1)
    if offset is not None:
        return scales * (c.codes.astype(np.float32) - np.float32(offset))
    return scales * c.codes.astype(np.float32) + np.repeat(c.mins.astype(np.float32), block, axis=1)


def pack(c: Codes, in_features: int | None = None) -> QuantizedWeight:
    """The tile layout of `qgemm.h` for `c`."""
    bits, block, offset = LAYOUT[c.format]
    n, k = c.codes.shape
    tiles = -(-n // TILE)
    npad = tiles * TILE
    codes = np.zeros((npad, k), np.uint8)
    codes[:n] = c.codes
    groups = (codes.reshape(tiles, TILE, k // block, block // 4, 4)
              .transpose(0, 2, 3, 1, 4).reshape(tiles, k // block, block // 4, 4 * TILE))
    if bits == 8:
        body = groups.reshape(tiles, k // block, -1)
    else:
        nibbles = (groups[:, :, 0::2] & 0x0F) | ((groups[:, :, 1::2] & 0x0F) << 4)
        planes = [np.packbits((groups >> (4 + p)) & 1, axis=-1, bitorder="little")
                  for p in range(bits - 4)]
        parts = [nibbles.reshape(tiles, k // block, -1)]
        if planes:
            parts.append(np.stack(planes, axis=3).reshape(tiles, k // block, -1))
        body = np.concatenate(parts, axis=-1)
    scale_dtype = np.float16 if c.scales.dtype == np.float16 else np.float32
    return QuantizedWeight(
        format=c.format, n=n, k=k, in_features=k if in_features is None else in_features,
        qweight=torch.from_numpy(np.ascontiguousarray(body).reshape(-1)),
        scales=torch.from_numpy(_tile_scales(c.scales, npad, scale_dtype, c.format == "int8")),
        mins=(torch.empty(0, dtype=torch.float16 if scale_dtype is np.float16 else torch.float32)
              if c.mins is None else torch.from_numpy(_tile_scales(c.mins, npad, scale_dtype))))


def _tile_scales(s: np.ndarray, npad: int, dtype: type, per_channel: bool = False) -> np.ndarray:
    if per_channel:
        out = np.zeros(npad, dtype)
        out[:s.shape[0]] = s
        return out
    padded = np.zeros((npad, s.shape[1]), dtype)
    padded[:s.shape[0]] = s
    tiled = padded.reshape(npad // TILE, TILE, -1).transpose(0, 2, 1)
    return np.ascontiguousarray(tiled).reshape(-1)


def pack_gguf(raw: np.ndarray, gguf_type: str, n: int, k: int) -> QuantizedWeight:
    """A GGUF tensor's blocks ready for the kernels."""
    return pack(decompose_gguf(raw, GGUF_FORMATS[gguf_type], n, k))


def pack_int8(w: torch.Tensor) -> QuantizedWeight:
    """A float weight [n, k] as per-channel int8 for the kernels."""
    return pack(quantize_int8(w), in_features=w.shape[1])


def slice_rows(w: QuantizedWeight, start: int, size: int) -> QuantizedWeight:
    """Rows [start, start + size) of W (a column-parallel rank's piece): whole
    tiles, so `start` is a multiple of 16 and so is `size` unless the slice
    ends at the last row."""
    end = start + size
    if start % TILE or (size % TILE and end != w.n) or not 0 <= start < end <= w.n:
        raise ValueError(f"rows [{start}, {end}) of a {w.n}-row quantized weight: slices "
                         f"must be whole tiles of {TILE} rows")
    tiles = -(-w.n // TILE)
    t0, t1 = start // TILE, -(-end // TILE)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t
        return t.view(tiles, -1)[t0:t1].reshape(-1).clone()

    return QuantizedWeight(w.format, size, w.k, w.in_features, cut(w.qweight),
                           cut(w.scales), cut(w.mins))


def slice_k(w: QuantizedWeight, start: int, size: int) -> QuantizedWeight:
    """Input features [start, start + size) of W (a row-parallel rank's piece):
    whole blocks of 32, within the unpadded features."""
    _, block, _ = LAYOUT[w.format]
    end = start + size
    if start % ACT_BLOCK or size % ACT_BLOCK or not 0 <= start < end <= w.in_features:
        raise ValueError(f"features [{start}, {end}) of a quantized weight with "
                         f"{w.in_features}: slices must be whole blocks of {ACT_BLOCK}")
    tiles, blocks = -(-w.n // TILE), w.k // block
    b0, b1 = start // block, end // block

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return t
        return t.view(tiles, blocks, -1)[:, b0:b1].reshape(-1).clone()

    scales = w.scales.clone() if w.format == "int8" else cut(w.scales)
    return QuantizedWeight(w.format, w.n, size, size, cut(w.qweight), scales, cut(w.mins))
