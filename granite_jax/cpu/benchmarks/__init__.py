"""The CPU kernels against XLA on this machine, as scripts (`python granite_jax/cpu/benchmarks/kernels.py`, or
`python -m granite_jax.cpu.benchmarks.kernels`):

- `kernels`: each kernel on a released model's decode shapes (products, Mamba state update and step, experts,
  attention), GB/s or microseconds of both, side by side;
- `decode_attention`: whole decode steps with and without the decode-attention kernel, interleaved.
"""
