"""Test support: the CPU shim that lets megatron-core run over gloo without CUDA."""
