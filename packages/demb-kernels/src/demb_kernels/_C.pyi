"""The native library: importing it registers the `demb` torch ops. No Python API."""
