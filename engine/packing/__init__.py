"""Pack/balance: batch arithmetic, micro-batch packing and DP assignment (pure Python/NumPy/torch).

arithmetic.py  batch_plan (G, k, train_iters; RF06 with working values)
schedule.py    build_dp_schedule (the DP schedule and its four invariants), schedule_stats
balance.py     karmarkar_karp, rebalance (--balance-data)
flops.py       ModelShape.from_hf_config, sequence_flops, flops_per_sample
microbatch.py  MicroBatch, make_micro_batch (flat varlen rows for the trainer)
"""
