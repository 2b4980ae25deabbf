"""Where the code runs: device kind, distributed backend, and the CPU bridges for megatron-core.

Kept free of heavy imports: `torchvision_compat` is imported from a .pth file at interpreter start.
"""
