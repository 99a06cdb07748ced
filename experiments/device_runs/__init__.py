"""Scripts for one session on a lent GPU host, each within one device command, written and checked on CPUs
(dry runs): issue21_kernels (one H200: kernel tests, the Triton scan's and attention's tiles from HBM; run),
issue15_two_gpus (two H200s: one GPU vs the dp_ep layout, float32 equality; not yet run: the kind was not
lent), issue17_dspark (one H200, two calls on a warm machine: train small and its draft, then speculative vs
plain decode; run), issue12_decode (one H200, two calls: every decode-speed benchmark point and the
batch-1 attribution), issue20_recall (one H200: does the dense `small` learn the recall task within one call;
the learning curve). Steps run under their own timeouts (`_steps.step`). Logs under $OUT."""
