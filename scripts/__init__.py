"""Tools run from a checkout, not installed with the package: the device check (`python -m
scripts.gpu_check`). A regular package, so that no other top-level `scripts` on the path can shadow it."""
