"""Serving many requests at once: KV shared across requests (ChunkAttention) and batched decoding."""

from pc_rag.serving.partition_attention import SharedRun, partition_attention

__all__ = ["SharedRun", "partition_attention"]
