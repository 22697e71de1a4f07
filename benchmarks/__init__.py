"""Side-by-side benchmarks of fastreplay against TorchRL (run ``python -m benchmarks``)."""
