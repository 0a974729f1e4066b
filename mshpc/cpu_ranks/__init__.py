"""What exists only for CPU ranks (gloo, one host's cores), behind one seam: `tunings.py` chooses
it once per process at start-up, from where the rank computes, and logs the choice in one line.
A GPU rank (NCCL) runs none of it, and the modules it runs (comm.py, zero.py, the optimizers) read
as torch's own path. Each part says why it exists:

- `gloo_p2p.py`: gloo's reduce-scatter and all-gather as point-to-point sends, the transport
  comm.py uses on CPU ranks (gloo's own cost a full all-reduce or a copy through a flat buffer);
- `shared_buckets.py`: ZeRO's bucket buffers in /dev/shm for the dp ranks of one host
  (`parallel.dp_shared_memory`), so the collectives read their peers' rows in place;
- `heap.py`: glibc's trim and mmap thresholds raised, so a step's freed buffers stay in the heap;
- `eager_optimizer.py`: mshpc's optimizers without the import of torch._dynamo (torch's private
  `__wrapped__`), about 2 CPU-s per rank.
"""
