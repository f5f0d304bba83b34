"""The top layer: what a user runs. The CLI, the local and Ray launchers, `generate` and `serve`,
the in-process engine (`LLMEngine`), the checkpoint tools and the benchmarks. These compose the
layers below (the control plane, the compute side, the torch-free base); nothing below imports them."""
