"""Launch shapes of the direct paged-attention kernels (re-exported by kvtrio.metal.attention)."""

from __future__ import annotations

import attrs

__all__ = ["DEFAULT_TUNING", "KernelTuning"]


@attrs.frozen(cache_hash=True)  # a key of every direct call's launch lookup
class KernelTuning:
    """Launch shape of the direct kernel (``kvtrio bench attention --sweep`` compares them)."""

    # The scalar kernel (float32 and quantized pools, or any pool with mma=False):
    warps: int = 4  # warps per thread block
    rows: int = 4  # query rows (GQA group x queries) a block serves; more take more blocks
    unroll: int = 4  # tokens each lane keeps in flight per step (2 when a block has > 4 rows)
    pipeline: bool = True  # load the next step's keys and values before using this step's
    target_blocks: int = 1024  # thread blocks to aim for: a few per multiprocessor
    min_part_tokens: int = 128
    # The tensor-core kernel (float16/bfloat16 pools; 8 query rows per block and 16 tokens
    # per warp tile): whether to use it (None: where the backend has tensor cores, i.e. CUDA;
    # Metal's version emulates them), its warps per block and thread blocks to aim for.
    mma: bool | None = None
    mma_warps: int = 8
    mma_blocks: int = 264  # 2 per multiprocessor of an H200 (from the sweep)
    mma_tiles: int = 1  # 16-token tiles a warp loads before using any (bytes in flight)
    mma_wide_l2: bool = True  # loads ask L2 for 256-byte lines (CUDA's L2::256B hint)
    # A batch of several sequences aims for this many times the blocks above: its items end
    # at different times, and more, smaller items keep the GPU full to the end.
    batch_waves: int = 4
    # The tensor-core kernel merges in the same launch (the last block of a sequence merges
    # its items; CUDA only, where the backend has FUSED_MERGE): one kernel call instead of two.
    fused_merge: bool = False
    # From a kept launch's second call on, replay its kernel calls through mx.compile instead
    # of calling the kernels from Python (kvtrio.metal.launch): no kernel source rendered per
    # call on the host.
    compiled_launch: bool = True

    @classmethod
    def parse(cls, text: str) -> KernelTuning:
        """``warps,rows,unroll,pipeline,blocks[,mma[,mma_warps,mma_blocks[,mma_tiles,
        mma_wide_l2[,batch_waves[,fused_merge[,compiled_launch]]]]]]`` (pipeline, mma_wide_l2,
        fused_merge and compiled_launch 0 or 1; mma 0, 1 or -1 for the backend's default);
        fields left out keep their defaults."""
        fields = [int(x) for x in text.split(",")]
        if len(fields) not in (5, 6, 8, 10, 11, 12, 13):
            raise ValueError(
                f"expected 5, 6, 8, 10, 11, 12 or 13 comma-separated integers, got {text!r}"
            )
        tuning = cls(
            warps=fields[0], rows=fields[1], unroll=fields[2], pipeline=bool(fields[3]),
            target_blocks=fields[4],
        )
        if len(fields) > 5:
            tuning = attrs.evolve(tuning, mma=None if fields[5] < 0 else bool(fields[5]))
        if len(fields) > 6:
            tuning = attrs.evolve(tuning, mma_warps=fields[6], mma_blocks=fields[7])
        if len(fields) > 8:
            tuning = attrs.evolve(tuning, mma_tiles=fields[8], mma_wide_l2=bool(fields[9]))
        if len(fields) > 10:
            tuning = attrs.evolve(tuning, batch_waves=fields[10])
        if len(fields) > 11:
            tuning = attrs.evolve(tuning, fused_merge=bool(fields[11]))
        if len(fields) > 12:
            tuning = attrs.evolve(tuning, compiled_launch=bool(fields[12]))
        return tuning

    def text(self) -> str:
        """The ``--tuning`` argument that parses back to this shape."""
        fields = [self.warps, self.rows, self.unroll, int(self.pipeline), self.target_blocks,
                  -1 if self.mma is None else int(self.mma), self.mma_warps, self.mma_blocks,
                  self.mma_tiles, int(self.mma_wide_l2), self.batch_waves,
                  int(self.fused_merge), int(self.compiled_launch)]
        return ",".join(str(x) for x in fields)


DEFAULT_TUNING = KernelTuning()
