"""Where the code runs: device kind, distributed backend, and the CPU bridges for megatron-core.

Kept free of heavy imports: `cpu_wheels` is imported from a .pth file at interpreter start.
"""
