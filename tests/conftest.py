import os

# Deterministic CPU numerics for the suite; set before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 simulated CPU devices for the sharding tests; single-device code runs on device 0 as before.
# A collective waits for all of its device threads: on a loaded 2-core machine one can start later than
# XLA's default 40 s, which aborts the process; wait up to 10 minutes instead.
COLLECTIVE_PATIENCE = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=8 "
                      + COLLECTIVE_PATIENCE)
