import os

# Deterministic CPU numerics for the suite; set before jax is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 simulated CPU devices for the sharding tests; single-device code runs on device 0 as before.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_force_host_platform_device_count=8")
