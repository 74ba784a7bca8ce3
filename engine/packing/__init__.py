"""Pack/balance: batch arithmetic, micro-batch packing and DP assignment (pure Python/torch)."""
