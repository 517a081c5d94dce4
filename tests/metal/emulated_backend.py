"""A CPU stand-in for a direct-kernel backend: the kernels' contract, in numpy.

It takes exactly the arguments the host code passes to ``mx.fast.cuda_kernel`` /
``metal_kernel`` kernels (inputs, template, grid, threadgroup, output shapes and dtypes,
init value) and computes what the kernels promise (kvtrio.metal.kernels' theory of
operation): per work item of the kernel table, the partial accumulator and the base-2
maximum and normalizer of every query row; per sequence and row, the log-sum-exp merge. So
the host side (the kernel table, work items, grid, output layouts, dispatch) is tested on
the CPU; the GPU tests check that the real kernels keep the same contract.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np


class _Fault(Exception):
    """The emulated kernel was told to fail (a kernel that does not build)."""


class EmulatedBackend:
    """Kernels in numpy; ``wrong`` perturbs the merge output, ``broken`` makes calls raise."""

    TENSOR_CORES = True

    def __init__(self, name: str = "emulated", *, wrong: bool = False,
                 broken: bool = False) -> None:
        self.NAME = name
        self.wrong = wrong
        self.broken = broken
        self.calls: list[str] = []

    def partial(self, quantized: bool) -> Callable[..., list[mx.array]]:
        return lambda **kw: self._partial("partial_q" if quantized else "partial", **kw)

    def partial_mma(self) -> Callable[..., list[mx.array]]:
        return lambda **kw: self._partial("partial_mma", **kw)

    def merge(self) -> Callable[..., list[mx.array]]:
        return self._merge

    FUSED_MERGE = True

    def partial_mma_fused(self) -> Callable[..., list[mx.array]]:
        return self._fused

    def _fused(self, *, inputs: list[mx.array], template: list[tuple[str, Any]],
               grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
               output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
               init_value: float | None = None) -> list[mx.array]:
        """The fused kernel's contract: the merged result, and a scratch of one counter word
        per sequence and block row (rounded up to 4), then partials and normalizers, every
        word starting at the init value whose float bits are INIT_BITS."""
        t = dict(template)
        assert init_value is not None, "the counters need a known start"
        assert struct.pack("<f", init_value) == struct.pack("<i", t["INIT_BITS"])
        table = np.array(inputs[3])
        batch, items = int(table[1]), int(table[2])
        hqn, d = t["HK"] * t["G"] * t["N"], t["D"]
        counters = -(-(batch * grid[1] // threadgroup[1]) // 4) * 4
        assert output_shapes[1] == (counters + hqn * items * (d + 2),)
        partials, normal = self._partial(
            "partial_mma", inputs=inputs, template=template, grid=grid,
            threadgroup=threadgroup, output_shapes=[(hqn, items, d), (hqn, items, 2)],
            output_dtypes=[mx.float32, mx.float32])
        (out,) = self._merge(
            inputs=[partials, normal, inputs[3]],
            template=[("D", d), ("HQN", hqn), ("MAX_PARTS", 1024)], grid=(d, batch * hqn, 1),
            threadgroup=(d, 1, 1), output_shapes=output_shapes[:1],
            output_dtypes=output_dtypes[:1])
        del self.calls[-2:]
        self.calls.append("partial_mma_fused")
        return [out, mx.zeros(output_shapes[1], dtype=mx.float32)]

    def _partial(self, kind: str, *, inputs: list[mx.array], template: list[tuple[str, Any]],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
                 init_value: float | None = None) -> list[mx.array]:
        self.calls.append(kind)
        if self.broken:
            raise _Fault("this kernel does not build")
        t = dict(template)
        hk, g, n, d, bs = t["HK"], t["G"], t["N"], t["D"], t["BS"]
        scale = struct.unpack("<f", struct.pack("<i", t["SCALE_BITS"]))[0]
        q = np.array(inputs[0].astype(mx.float32))
        if "BITS" in t:
            ks, kb, vs, vb = inputs[4:8]
            keys = mx.dequantize(inputs[1], ks, kb, group_size=t["GS"], bits=t["BITS"])
            values = mx.dequantize(inputs[2], vs, vb, group_size=t["GS"], bits=t["BITS"])
        else:
            keys, values = inputs[1], inputs[2]
        k = np.array(keys.astype(mx.float32))
        v = np.array(values.astype(mx.float32))
        table = np.array(inputs[3])
        part, batch, items = (int(x) for x in table[:3])
        assert grid[0] == threadgroup[0] * items, "one thread block per work item"
        rows = g * n
        assert grid[1] % hk == 0
        out = np.full(output_shapes[0], np.nan, dtype=np.float32)
        normal = np.full(output_shapes[1], np.nan, dtype=np.float32)
        assert out.shape == (hk * rows, items, d)
        for item in range(items):
            seq = int(table[3 + 3 * batch + item])
            length, blocks_at, first = (int(x) for x in table[3 + 3 * seq: 6 + 3 * seq])
            start = (item - first) * part
            stop = min(length, start + part)
            assert 0 <= start < stop, "every item holds tokens"
            tokens = np.arange(start, stop)
            blocks = table[blocks_at + tokens // bs]
            for h in range(hk):
                kk = k[blocks, h, tokens % bs]  # [tokens, d]
                vv = v[blocks, h, tokens % bs]
                for r in range(rows):
                    qrow = q[seq].reshape(hk * rows, d)[h * rows + r]
                    s = kk @ qrow * scale
                    visible = length - n + r % n + 1 if t["CAUSAL"] else length
                    s = np.where(tokens < visible, s, -np.inf)
                    top = s.max()
                    w = np.zeros_like(s) if top == -np.inf else np.exp2(s - top)
                    out[h * rows + r, item] = w @ vv
                    normal[h * rows + r, item] = (top, w.sum())
        return [mx.array(out), mx.array(normal)]

    def _merge(self, *, inputs: list[mx.array], template: list[tuple[str, Any]],
               grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
               output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
               init_value: float | None = None) -> list[mx.array]:
        self.calls.append("merge")
        t = dict(template)
        partials, normal = np.array(inputs[0]), np.array(inputs[1])
        table = np.array(inputs[2])
        part, batch = int(table[0]), int(table[1])
        hqn = t["HQN"]
        assert grid[1] == threadgroup[1] * batch * hqn, "one merge block per sequence and row"
        out = np.full((batch, hqn, t["D"]), np.nan, dtype=np.float32)
        for seq in range(batch):
            length, _, first = (int(x) for x in table[3 + 3 * seq: 6 + 3 * seq])
            parts = -(-length // part)
            assert parts <= t["MAX_PARTS"]
            for row in range(hqn):
                m = normal[row, first: first + parts, 0]
                top = m.max()
                w = np.where(m == -np.inf, 0.0, np.exp2(m - top))
                total = (w * normal[row, first: first + parts, 1]).sum()
                out[seq, row] = (w[:, None] * partials[row, first: first + parts]).sum(0) / total
        if self.wrong:
            out = out + 0.5
        return [mx.array(out.reshape(output_shapes[0])).astype(output_dtypes[0])]
