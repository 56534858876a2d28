"""Attention kernels behind one call, blockwise attention, the chunked LM head + cross-entropy: no model."""
