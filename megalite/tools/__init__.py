"""What is not the product: benchmarks (`megalite bench`), the stress harness (`megalite stress ckpt`) and the
simulated cluster for multi-host tests. The CLI reaches these lazily; nothing in megalite's core imports them."""
