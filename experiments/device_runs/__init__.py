"""Scripts for one session on a lent GPU host, each under 5 minutes of device time, written and checked on CPUs
(dry runs) but not yet run on the GPU: issue21_kernels (one H200: kernel tests, scan and attention variants
from HBM), issue15_two_gpus (two H200s: one GPU vs the dp_ep layout, float32 equality). Logs under $OUT."""
