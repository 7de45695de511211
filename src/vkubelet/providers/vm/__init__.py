"""The vm provider (stub created by vmruntime so its modules import; vmprovider owns this file)."""
